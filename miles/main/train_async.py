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
import contextlib
import logging
import sys
from typing import Any

from miles.main.launch import Components, configure_logging, trainer_run, unless_stopped
from miles.main.progress import RunProgress
from miles.main.train_multi_lora_async import is_empty_batch_timeout
from miles.utils.arguments import MilesConfig, parse_args
from miles.utils.tracking import StageTimer
from miles.utils.types import RolloutBatch

logger = logging.getLogger(__name__)

POLICY = "policy"
NEVER_RETIRE = 10**9


async def generate(c: Components, rollout_id: int, stop: asyncio.Event) -> RolloutBatch | None:
    """One rollout; an empty-batch timeout is retried (the engines may still be warming up).
    None once a stop is requested (the collection under way is cancelled at once).

    No snapshot is handed over: this runs one rollout ahead of the loop, so the batch is
    collected against the registry as it is when collection starts.
    """
    while not stop.is_set():
        try:
            return await unless_stopped(c.rollout_manager.generate.remote(rollout_id), stop)
        except Exception as exc:
            if not is_empty_batch_timeout(exc):
                raise
            logger.warning("No batch for rollout %d yet (%s); retrying", rollout_id, exc)
    return None


async def run_loop(cfg: MilesConfig, c: Components, stop: asyncio.Event, progress: RunProgress) -> None:
    s = c.stages
    timer = StageTimer()
    snapshot = await c.controller.snapshot.remote()
    snapshot = await s.slots.reconcile(snapshot)  # loads the policy (resuming from its checkpoint)
    snapshot = await s.push.settle(await s.push.update_weights(snapshot))
    next_rollout = asyncio.ensure_future(generate(c, cfg.start_rollout_id, stop))
    try:
        for rollout_id in range(cfg.start_rollout_id, cfg.num_rollout):
            with timer("generate"):
                rollout = await next_rollout
            if rollout is None:  # stopped while it was collected
                break
            if rollout_id + 1 < cfg.num_rollout and not stop.is_set():
                next_rollout = asyncio.ensure_future(generate(c, rollout_id + 1, stop))
            with timer("train"):
                trained = await s.train.train(rollout_id, rollout, drop_failed=False)
            with timer("commit"):
                snapshot = await s.train.commit(rollout_id)
            if (rollout_id + 1) % cfg.update_weights_interval == 0:
                with timer("update_weights"):  # synchronous, as in Miles' train_async
                    snapshot = await s.push.settle(await s.push.update_weights(snapshot))
            with timer("save"):
                await s.slots.save(snapshot)
            assert trained is not None, "drop_failed=False: a failed train call raises"
            await progress.record(rollout_id, rollout, trained, snapshot, timer.pop_metrics())
            if stop.is_set():
                break
    finally:
        await cancel_and_wait(next_rollout)


async def cancel_and_wait(task: asyncio.Future) -> None:
    """Stop a prefetch that is still running and wait until it has stopped."""
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved: an error here is secondary to the one ending the loop
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


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
