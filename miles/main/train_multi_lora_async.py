"""The multi-LoRA asynchronous RL trainer: many adapters, one frozen base, one loop.

    python -m miles.main.train_multi_lora_async --config configs/tiny-multi-lora.yaml
    curl -X POST localhost:8068/adapter_runs -d '{"name": "a", "yaml_path": "a.yaml"}'

Every iteration acts on one snapshot of the controller's registry (DESIGN §1), handed
from stage to stage (`miles.main.stages`: one owner per stage):
snapshot -> reconcile adapters with slots -> push changed LoRA weights -> generate a
batch of whole prompt groups -> train (per-adapter accumulation and steps) -> commit
the batch -> save on each adapter's cadence. With `--overlap-weight-push` (the default)
the export of the adapters that stepped runs behind generate (train waits for it) and
their push behind generate and train; the loop waits for the push at the end of the
iteration. A registration that arrives during generate or train is pushed to the engines
then (ACTIVE at once) and loaded by the trainer at the next reconcile. In service mode
(the default) it idles while no adapter is registered; SIGINT/SIGTERM save every loaded
adapter and exit 0.

Tinker clients (`/api/v1`, DESIGN §11) drive adapters of their own on the same slots: their
pending `forward`/`forward_backward` datums go into the iteration's train call beside the RL
batch, and their barriers (`optim_step`, saves, loads) run after it (`ClientCommands`). With
no sampleable RL adapter the loop skips generate and runs the clients' work alone.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from miles.backends.base import TrainResult
from miles.main.client_commands import TakenCommands
from miles.main.launch import (
    Components,
    configure_logging,
    register_initial_adapters,
    sleep_unless,
    trainer_run,
    unless_stopped,
)
from miles.main.progress import RunProgress
from miles.main.train_step import TrainedBatch
from miles.rollout.collection import EmptyBatchTimeoutError
from miles.utils.arguments import MilesConfig, parse_args
from miles.utils.tracking import StageTimer
from miles.utils.types import MultiLoRASnapshot, RolloutBatch

logger = logging.getLogger(__name__)


def is_empty_batch_timeout(exc: BaseException) -> bool:
    """Through Ray the error arrives as a RayTaskError whose cause is the real class."""
    return isinstance(exc, EmptyBatchTimeoutError) or isinstance(
        getattr(exc, "cause", None), EmptyBatchTimeoutError
    )


async def run_loop(cfg: MilesConfig, c: Components, stop: asyncio.Event, progress: RunProgress) -> None:
    s = c.stages
    timer = StageTimer()
    rollout_id = 0
    # Iterations tile the wall clock between two records (idle waits excluded), so
    # iteration - generate - train is everything the loop itself costs.
    iteration_start = time.perf_counter()
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
            timer.pop_metrics()
            iteration_start = time.perf_counter()
            continue
        with timer("reconcile"):
            snapshot = await s.slots.reconcile(snapshot)
        with timer("update_weights"):
            snapshot = await s.push.update_weights(snapshot)
        if not snapshot.sampleable:  # client-driven models alone: no generate phase to wait for
            with timer("client"):
                ran = await s.clients.run_alone(rollout_id, s.train) if snapshot.clients else []
            # No loop record: its times go on its own line, never into the next batch's record.
            await progress.record_clients(ran, timer.pop_metrics())
            iteration_start = time.perf_counter()
            continue
        async with s.activation.activating():  # registrations arriving meanwhile go to the engines at once
            with timer("generate"):  # a stop ends it at once, not when its wait for groups ends
                rollout = await generate_or_none(c, rollout_id, snapshot, stop)
            if rollout is None:
                continue
            with timer("export_wait"):  # the push behind the loop takes its weights before train changes them
                await s.push.exports_taken()
            with timer("train"):  # the clients' pending work goes into the same call
                taken = await s.clients.take() if snapshot.clients else TakenCommands()
                trained = await s.train.train(rollout_id, rollout, client=taken.work)
        if not taken.empty:
            with timer("client"):
                ran = await s.clients.finish(taken, *finished_work(trained))
            await progress.record_clients(ran)
        if trained is None:  # dropped: the registry never counts it, the backend took it back
            rollout_id += 1
            continue
        with timer("commit"):
            snapshot = await s.train.commit(rollout_id)
        with timer("save"):
            await s.slots.save(snapshot)
        with timer("push_wait"):  # the push that ran behind generate and train (--overlap-weight-push)
            snapshot = await s.push.settle(snapshot)
        now = time.perf_counter()
        perf = {**timer.pop_metrics(), **s.push.pop_push_metrics(), "perf/iteration_time": now - iteration_start,
                "perf/stepped_adapters": float(len(trained.steps))}
        iteration_start = now
        await progress.record(rollout_id, rollout, trained, snapshot, perf)
        rollout_id += 1


def finished_work(trained: TrainedBatch | None) -> tuple[TrainResult | None, str | None]:
    """The client work's share of a train call: its result, or why it failed."""
    if trained is None:
        return None, "the train call failed; see the trainer's log"
    if trained.client_error is not None:
        return None, trained.client_error
    return trained.result, None


async def generate_or_none(c: Components, rollout_id: int, snapshot: MultiLoRASnapshot,
                           stop: asyncio.Event) -> RolloutBatch | None:
    """One batch, or None when nothing arrived in time (the loop goes round again) or a stop
    was requested meanwhile (the collection is cancelled; its groups were never trained)."""
    try:
        return await unless_stopped(c.rollout_manager.generate.remote(rollout_id, snapshot), stop)
    except Exception as exc:
        if not is_empty_batch_timeout(exc):
            raise
        logger.warning("No batch this round (%s); retrying", exc)
        return None


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
