"""The multi-LoRA asynchronous RL trainer: many adapters, one frozen base, one loop.

    python -m miles.main.train_multi_lora_async --config configs/tiny-multi-lora.yaml
    curl -X POST localhost:8068/adapter_runs -d '{"name": "a", "yaml_path": "a.yaml"}'

Every iteration acts on a snapshot of the controller's registry (DESIGN §1):
snapshot -> reconcile adapters with slots -> push changed LoRA weights -> generate a
batch of whole prompt groups -> train (per-adapter accumulation and steps) -> commit
the batch -> save on each adapter's cadence. In service mode (the default) it idles
while no adapter is registered; SIGINT/SIGTERM save every loaded adapter and exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from miles.main.launch import Components, configure_logging, register_initial_adapters, sleep_unless, trainer_run
from miles.main.progress import RunProgress
from miles.rollout.collection import EmptyBatchTimeoutError
from miles.utils.arguments import MilesConfig, parse_args
from miles.utils.tracking import StageTimer

logger = logging.getLogger(__name__)


def is_empty_batch_timeout(exc: BaseException) -> bool:
    """Through Ray the error arrives as a RayTaskError whose cause is the real class."""
    return isinstance(exc, EmptyBatchTimeoutError) or isinstance(
        getattr(exc, "cause", None), EmptyBatchTimeoutError
    )


async def run_loop(cfg: MilesConfig, c: Components, stop: asyncio.Event, progress: RunProgress) -> None:
    timer = StageTimer()
    rollout_id = 0
    while not stop.is_set():
        with timer("snapshot"):
            snapshot = await c.controller.snapshot.remote()
        progress.declare(snapshot)
        if snapshot.all_adapters_cleaned_up:
            if cfg.multi_lora_disable_service_mode:
                logger.info("No adapters; exiting.")
                return
            progress.idle(cfg.multi_lora_idle_poll_s)
            await sleep_unless(stop, cfg.multi_lora_idle_poll_s)
            continue
        with timer("reconcile"):
            await c.train_group.reconcile_adapters()
        with timer("update_weights"):
            pushed = await c.train_group.update_weights()
            if pushed:
                await c.controller.record_weight_update.remote(pushed)
        if not (await c.controller.snapshot.remote()).sampleable:
            continue
        with timer("generate"):
            try:
                rollout = await c.rollout_manager.generate.remote(rollout_id)
            except Exception as exc:
                if not is_empty_batch_timeout(exc):
                    raise
                logger.warning("No batch this round (%s); retrying", exc)
                continue
        with timer("train"):
            train_metrics = await c.train_group.train(rollout_id, rollout)
        stepped = await c.controller.mark_batch_trained.remote(rollout_id)
        with timer("save"):
            await c.train_group.save_model(rollout_id)
        progress.record(rollout_id, rollout, train_metrics, stepped, timer.pop_metrics())
        rollout_id += 1


async def main(cfg: MilesConfig) -> int:
    async with trainer_run(cfg) as run:
        await register_initial_adapters(cfg, run.components.controller)
        await run_loop(cfg, run.components, run.stop, run.progress)
    return 0


def cli(argv: list[str] | None = None) -> int:
    configure_logging()
    cfg = parse_args(argv)
    if cfg.multi_lora_n_adapters <= 0:
        print("miles: error: --multi-lora-n-adapters must be > 0 for the multi-LoRA trainer "
              "(use miles.main.train_async for a single policy)", file=sys.stderr)
        return 2
    return asyncio.run(main(cfg))


if __name__ == "__main__":
    sys.exit(cli())
