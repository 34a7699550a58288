"""The standard asynchronous trainer: one policy LoRA, a finite number of rollouts.

    python -m miles.main.train_async --hf-checkpoint DIR --prompt-data train.jsonl \\
        --rm-type math --num-rollout 50 --save runs/policy

While the trainer trains on rollout i, the engines already generate rollout i+1 (one
rollout of prefetch, so the batch trained on is at most one push stale). Weights are
pushed every `--update-weights-interval` rollouts and the policy is saved every
`--save-interval` steps and at exit. It shares the multi-LoRA machinery (one slot, one
adapter named "policy"); the loop is what differs: finite and prefetching, instead of
a service driven by the controller's snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from miles.main.launch import Components, configure_logging, trainer_run
from miles.main.progress import RunProgress
from miles.main.train_multi_lora_async import is_empty_batch_timeout
from miles.utils.arguments import MilesConfig, parse_args
from miles.utils.tracking import StageTimer

logger = logging.getLogger(__name__)

POLICY = "policy"
NEVER_RETIRE = 10**9


async def generate(c: Components, rollout_id: int) -> Any:
    """One rollout; an empty-batch timeout is retried (the engines may still be warming up)."""
    while True:
        try:
            return await c.rollout_manager.generate.remote(rollout_id)
        except Exception as exc:
            if not is_empty_batch_timeout(exc):
                raise
            logger.warning("No batch for rollout %d yet (%s); retrying", rollout_id, exc)


async def push_weights(c: Components) -> None:
    pushed = await c.train_group.update_weights()
    if pushed:
        await c.controller.record_weight_update.remote(pushed)


async def run_loop(cfg: MilesConfig, c: Components, stop: asyncio.Event, progress: RunProgress) -> None:
    timer = StageTimer()
    await c.train_group.reconcile_adapters()  # loads the policy (resuming from its checkpoint)
    await push_weights(c)
    next_rollout = asyncio.ensure_future(generate(c, cfg.start_rollout_id))
    for rollout_id in range(cfg.start_rollout_id, cfg.num_rollout):
        with timer("generate"):
            rollout = await next_rollout
        if rollout_id + 1 < cfg.num_rollout and not stop.is_set():
            next_rollout = asyncio.ensure_future(generate(c, rollout_id + 1))
        with timer("train"):
            train_metrics = await c.train_group.train(rollout_id, rollout)
        stepped = await c.controller.mark_batch_trained.remote(rollout_id)
        if (rollout_id + 1) % cfg.update_weights_interval == 0:
            with timer("update_weights"):
                await push_weights(c)
        with timer("save"):
            await c.train_group.save_model(rollout_id)
        progress.record(rollout_id, rollout, train_metrics, stepped, timer.pop_metrics())
        if stop.is_set():
            break
    if not next_rollout.done():
        next_rollout.cancel()


def policy_config(cfg: MilesConfig) -> dict[str, Any]:
    return {"data": cfg.prompt_data, "num_step": NEVER_RETIRE}


async def main(cfg: MilesConfig) -> int:
    cfg = cfg.replace(multi_lora_n_adapters=1, multi_lora_disable_service_mode=True)
    async with trainer_run(cfg) as run:
        await run.components.controller.register_adapter.remote(POLICY, config=policy_config(cfg))
        run.progress.declare(await run.components.controller.snapshot.remote())
        await run_loop(cfg, run.components, run.stop, run.progress)
    return 0


def cli(argv: list[str] | None = None) -> int:
    configure_logging()
    cfg = parse_args(argv)
    if not cfg.prompt_data:
        print("miles: error: --prompt-data is required (the policy's dataset)", file=sys.stderr)
        return 2
    return asyncio.run(main(cfg))


if __name__ == "__main__":
    sys.exit(cli())
