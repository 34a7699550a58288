"""The adapter lifecycle, orchestrated once for any training backend (DESIGN §1, §6).

`AdapterSync` is the only component that moves adapters between the registry (the
controller actor), the training backend (`miles.backends.base.TrainingBackend`) and the
engines. Each stage works on the iteration's snapshot and returns the snapshot as it is
after the stage's own calls, so the driver passes one snapshot down the loop:

    snapshot = await controller.snapshot.remote()
    snapshot = await sync.reconcile(snapshot)       # retire -> clean up -> load (resume)
    snapshot = await sync.update_weights(snapshot)  # push stale adapters, record versions
    async with sync.activating():                   # new registrations reach the engines meanwhile
        batch = await rollout_manager.generate.remote(rollout_id, snapshot)
        await sync.exports_taken()                  # overlap_push: the stepped adapters' weights are exported
        trained = await sync.train(rollout_id, batch)  # backend train + step (None: failed, not committed)
    snapshot = await sync.commit(rollout_id)        # registry steps; re-read
    await sync.save(snapshot)                       # on each adapter's save_interval
    snapshot = await sync.settle(snapshot)          # overlap_push: the stepped adapters' push has landed
    ...
    await sync.save_all()                           # at shutdown

Who owns what: an adapter's step and a slot's version live in the registry and are read
from snapshots; the backend holds weights and optimizer state and counts nothing for
the lifecycle; the rollout manager owns each adapter's data position, which a save
records in `trainer_state.json` and a resume hands back.

`controller` is the controller actor handle (`snapshot`, `retire_adapters`,
`free_slot`, `set_adapter_step`, `record_weight_update`, `mark_batch_trained`);
`rollout_manager` the rollout manager's (`data_positions`, `restore_data_position`).
Every call is `await handle.method.remote(...)`. `pusher` moves exported weights to the
engines in the `--engine-lora-update` mode (`miles.main.engine_push.EnginePusher`) and
unloads the slot of an adapter that left.

With `overlap_push`, the push of adapters that stepped runs behind the loop: the stage
starts their export and push and returns at once, so the export overlaps generate and the
push overlaps generate, train, commit and save. `exports_taken` (awaited by `train` too)
holds the next train call until the export is done, so the weights pushed are the ones
the snapshot names; `settle` waits for the push (the loop calls it at the end of each
iteration; the next push, any cleanup and shutdown settle first). The snapshot the stage returns already names the exported
versions, so staleness is counted against the weights the trainer holds. A new
adapter's first push is never overlapped: it becomes ACTIVE when the stage returns.

A registration need not wait for the loop's next iteration to become ACTIVE: while
`activating()` is open (generate and train), the controller is long-polled for
registrations (`wait_for_registration`), and each new adapter that would load fresh is
pushed to the engines at once with the weights the backend will give it (`fresh_export`:
the same seeded draws, computed without touching a slot, so it runs beside a train call)
and recorded: it is ACTIVE within a push's time. The trainer loads it at the next
reconcile, as any other, and does not push it again; the batch being collected never
holds it (the collector samples the adapters of the iteration's snapshot). An adapter
that would resume from a checkpoint waits for the reconcile. One that leaves before its
load is unloaded from the engines there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles.backends.base import (
    AdapterSpec,
    AdapterStepStats,
    LoraExport,
    SaveRequest,
    TrainingBackend,
    TrainRankLostError,
    TrainResult,
)
from miles.main.engine_push import PushStats
from miles.utils.types import AdapterRun, DataPosition, MultiLoRASnapshot, RolloutBatch, next_slot_version

logger = logging.getLogger(__name__)

LONG_POLL_S = 1.0
"""How long one `wait_for_registration` call waits on the controller before it answers."""


@dataclass
class _Loaded:
    """An adapter the backend holds."""

    registration_id: str
    slot: int
    saves: bool
    """It has a save directory."""
    step: int
    """The registry's step as of the latest snapshot (a copy, never counted here)."""
    saved_step: int
    """Step of the checkpoint last written or resumed from (no second save of a step)."""
    stale: bool = True
    """The engines do not serve its current weights (newly loaded, or stepped since)."""
    samples_per_group: int = 1
    """Its `n_samples_per_prompt`."""
    accumulated_groups: int = 0
    """The registry's groups toward the next step as of the latest snapshot (a copy)."""
    saved_groups: int = 0
    """Accumulated groups in the checkpoint last written or resumed from."""


@dataclass(frozen=True)
class TrainedBatch:
    """What one train stage did."""

    result: TrainResult
    steps: dict[str, AdapterStepStats] = field(default_factory=dict)
    """Adapters that took an optimizer step with this batch."""


class Pusher(Protocol):
    """Moves exported LoRA weights to every engine (`miles.main.engine_push.EnginePusher`)."""

    async def push(self, pushes: Sequence[tuple[int, int, LoraExport]]) -> PushStats: ...

    async def unload(self, slot: int) -> None: ...


class AdapterSync:
    def __init__(self, backend: TrainingBackend, controller: Any, rollout_manager: Any, *,
                 save_interval: int | None = None, pusher: Pusher | None = None,
                 max_train_failures: int = 3, overlap_push: bool = False) -> None:
        self.backend = backend
        self.controller = controller
        self.rollout_manager = rollout_manager
        self.save_interval = save_interval
        self.pusher = pusher
        self.last_push: PushStats | None = None
        """The latest push stage that sent anything (time and bytes per engine)."""
        self._pushes: list[PushStats] = []
        """Pushes since the last `pop_push_metrics`."""
        self.overlap_push = overlap_push
        self._behind: asyncio.Task[dict[str, int]] | None = None
        """The stepped adapters' push running behind the loop (`overlap_push`); its result is
        the versions the registry recorded."""
        self._exported: asyncio.Event | None = None
        """Set once the push behind the loop has its exports (the next train may change the weights)."""
        self._loaded: dict[str, _Loaded] = {}
        self._early: dict[str, tuple[str, int]] = {}
        """Adapters pushed by `activating()` and not loaded yet: name -> (registration id, slot)."""
        self._resumes: set[str] = set()
        """Registration ids `activating()` leaves to the reconcile (they resume from a checkpoint)."""
        self._registrations_seen = -1
        """The controller's registration count at the last look (-1: look at once)."""
        self._push_lock = asyncio.Lock()
        """One push at a time: the one behind the loop and an early activation share the engines' groups."""
        self.max_train_failures = max_train_failures
        self.train_failures = 0
        """Train calls failed in a row."""

    @property
    def loaded(self) -> list[str]:
        return sorted(self._loaded)

    def _observe(self, snapshot: MultiLoRASnapshot) -> None:
        live = snapshot.live
        for name, entry in self._loaded.items():
            run = live.get(name)
            if run is not None and run.registration_id == entry.registration_id:
                entry.step = run.step
                entry.accumulated_groups = run.accumulated_groups

    # ---- reconcile --------------------------------------------------------------------

    async def reconcile(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        """Retire RETIRING adapters, clean up those that left, load the new ones."""
        snapshot = await self.settle(snapshot)
        self._observe(snapshot)
        retired = await self.controller.retire_adapters.remote()
        snapshot = snapshot.after_retire(retired)
        snapshot = await self._cleanup(snapshot)
        return await self._load(snapshot)

    async def _cleanup(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        live = snapshot.live
        gone = [name for name, entry in sorted(self._loaded.items())
                if name not in live or live[name].registration_id != entry.registration_id]
        positions = await self._data_positions() if gone else {}
        freed = []
        for name in gone:
            await self._save(name, positions.get(name))
            await self.backend.cleanup_adapter(name)
            if self.pusher is not None:  # the engines stop serving the slot before another adapter takes it
                await self.pusher.unload(self._loaded[name].slot)
            del self._loaded[name]
            logger.info("Adapter '%s' cleaned up", name)
        for name, (registration_id, slot) in sorted(self._early.items()):
            run = live.get(name)
            if run is None or run.registration_id != registration_id:  # left before its load
                del self._early[name]
                if self.pusher is not None:
                    await self.pusher.unload(slot)
                logger.info("Adapter '%s' left before the trainer loaded it; unloaded from the engines", name)
        self._resumes &= {run.registration_id for run in live.values()}
        for name in sorted(snapshot.cleanup):  # also those never loaded here: nothing to save
            if await self.controller.free_slot.remote(name) >= 0:
                freed.append(name)
        return snapshot.after_free(freed)

    async def _load(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        for name, run in sorted(snapshot.live.items()):
            if name in self._loaded:
                continue
            spec = AdapterSpec.from_run(run)
            loaded = await self.backend.load_adapter(spec)
            # A restored registry may be ahead of the weights (no checkpoint, or an older one):
            # the weights win, so the step and the groups accumulated toward the next one
            # always match what the backend holds.
            if loaded.checkpoint is not None or (loaded.step, loaded.accumulated_groups) != (run.step, run.accumulated_groups):
                await self.controller.set_adapter_step.remote(name, loaded.step, loaded.accumulated_groups)
                snapshot = snapshot.with_step(name, loaded.step, loaded.accumulated_groups)
            if loaded.checkpoint is not None:
                logger.info("Adapter '%s' resumed from %s (step %d)", name, loaded.checkpoint, loaded.step)
            elif loaded.step != run.step:
                logger.warning("Adapter '%s' had step %d but no checkpoint: it starts again from step %d",
                               name, run.step, loaded.step)
            if loaded.data_position is not None:
                # Before its first push: the adapter is PENDING, so nothing was sampled yet.
                await self.rollout_manager.restore_data_position.remote(name, run.registration_id,
                                                                        loaded.data_position)
            early = self._early.pop(name, None)
            self._resumes.discard(run.registration_id)
            self._loaded[name] = _Loaded(registration_id=run.registration_id, slot=run.slot,
                                         stale=early != (run.registration_id, run.slot) or loaded.checkpoint is not None,
                                         saves=spec.save_dir is not None,
                                         step=loaded.step, saved_step=loaded.step,
                                         samples_per_group=run.config.n_samples_per_prompt,
                                         accumulated_groups=loaded.accumulated_groups,
                                         saved_groups=loaded.accumulated_groups)
        return snapshot

    # ---- weight push ------------------------------------------------------------------

    async def update_weights(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        """Push the stale adapters to every engine, then record the new slot versions.

        Adapters waiting for their first push (PENDING) go first and are recorded at once:
        a new registration becomes ACTIVE without waiting for the stepped adapters' pushes.
        With `overlap_push` the stepped adapters' push runs behind the loop (see `settle`).
        """
        snapshot = await self.settle(snapshot)
        live = snapshot.live
        stale = [name for name, entry in sorted(self._loaded.items()) if entry.stale and name in live]
        new = [name for name in stale if name in snapshot.pending]
        stepped = [name for name in stale if name not in snapshot.pending]
        if new:
            snapshot = await self._push(snapshot, new)
        if stepped and self.overlap_push:
            pushed = self._next_versions(snapshot, stepped)
            self._exported = asyncio.Event()
            self._behind = asyncio.create_task(self._export_and_send(snapshot, stepped, pushed, self._exported))
            return snapshot.after_push(pushed)
        if stepped:
            snapshot = await self._push(snapshot, stepped)
        return snapshot

    async def exports_taken(self) -> None:
        """Wait until the push behind the loop has exported its adapters (or failed: `settle`
        raises its error), so that a train call may change their weights."""
        exported, task = self._exported, self._behind
        self._exported = None
        if exported is None or task is None or exported.is_set():
            return
        waiter = asyncio.ensure_future(exported.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()

    async def _export_and_send(self, snapshot: MultiLoRASnapshot, names: list[str], pushed: dict[str, int],
                               exported: asyncio.Event) -> dict[str, int]:
        exports = await asyncio.gather(*(self.backend.export_adapter(name) for name in names))
        exported.set()
        return await self._send(snapshot, list(exports), pushed)

    async def settle(self, snapshot: MultiLoRASnapshot | None = None) -> MultiLoRASnapshot | None:
        """Wait for the push running behind the loop, if any (its failure is raised here);
        returns `snapshot` with the versions it recorded."""
        task, self._behind = self._behind, None
        self._exported = None
        if task is None:
            return snapshot
        versions = await task
        return None if snapshot is None else snapshot.after_push(versions)

    async def _push(self, snapshot: MultiLoRASnapshot, names: list[str]) -> MultiLoRASnapshot:
        exports, pushed = await self._export(snapshot, names)
        return snapshot.after_push(await self._send(snapshot, exports, pushed))

    async def _export(self, snapshot: MultiLoRASnapshot, names: list[str]) -> tuple[list[LoraExport], dict[str, int]]:
        """The adapters' current weights, and the version each push will be."""
        exports = await asyncio.gather(*(self.backend.export_adapter(name) for name in names))
        return list(exports), self._next_versions(snapshot, names)

    def _next_versions(self, snapshot: MultiLoRASnapshot, names: list[str]) -> dict[str, int]:
        """The version each adapter's push will be; from now on the engines are catching up."""
        live = snapshot.live
        for name in names:
            self._loaded[name].stale = False
        return {name: next_slot_version(live[name].version) for name in names}

    async def _send(self, snapshot: MultiLoRASnapshot, exports: list[LoraExport],
                    pushed: dict[str, int]) -> dict[str, int]:
        """Push the exports to every engine and record the new versions; returns the registry's."""
        live, names = snapshot.live, list(pushed)
        if self.pusher is not None:
            async with self._push_lock:
                stats = await self.pusher.push([(live[name].slot, pushed[name], export)
                                                for name, export in zip(names, exports)])
            self.last_push = stats
            self._pushes.append(stats)
            logger.info("Pushed %d adapter(s), %d bytes per engine, in %.3fs", stats.adapters, stats.bytes,
                        stats.seconds)
        versions = await self.controller.record_weight_update.remote(names)
        for name in names:
            if versions.get(name) != pushed[name]:
                logger.warning("Adapter '%s' was pushed as version %s but the registry recorded %s",
                               name, pushed[name], versions.get(name))
        return versions

    # ---- early activation ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def activating(self) -> AsyncIterator[None]:
        """While the block runs, push new registrations to the engines as they arrive (see the
        module docstring). On exit an activation under way finishes; its error is raised."""
        stop = asyncio.Event()
        task = asyncio.create_task(self._activate_until(stop))
        try:
            yield
        except BaseException:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)  # the block's own error wins
            raise
        stop.set()
        await task

    async def _activate_until(self, stop: asyncio.Event) -> None:
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while True:
                seen = self._registrations_seen
                registered = asyncio.ensure_future(self.controller.wait_for_registration.remote(seen, LONG_POLL_S))
                await asyncio.wait({registered, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if stopped.done():  # the poll's answer (at most LONG_POLL_S away) is not needed
                    registered.cancel()
                    return
                total = registered.result()
                if total == seen:
                    continue
                self._registrations_seen = total
                snapshot = await self.controller.snapshot.remote()
                new = [run for name, run in sorted(snapshot.pending.items()) if name not in self._loaded
                       and name not in self._early and run.registration_id not in self._resumes]
                if new:
                    await self._activate(snapshot, new)
        finally:
            stopped.cancel()

    async def _activate(self, snapshot: MultiLoRASnapshot, runs: list[AdapterRun]) -> None:
        exports = await asyncio.gather(*(self.backend.fresh_export(AdapterSpec.from_run(run)) for run in runs))
        fresh = [(run, export) for run, export in zip(runs, exports) if export is not None]
        self._resumes.update(run.registration_id for run, export in zip(runs, exports) if export is None)
        if not fresh:
            return
        pushed = {run.name: next_slot_version(run.version) for run, _ in fresh}
        await self._send(snapshot, [export for _, export in fresh], pushed)
        for run, _ in fresh:
            self._early[run.name] = (run.registration_id, run.slot)
            logger.info("Adapter '%s' pushed to the engines during the iteration; the trainer loads it at the next",
                        run.name)

    def pop_push_metrics(self) -> dict[str, float]:
        """The pushes since the last call, summed, for the loop's record (nothing if none):
        engine push seconds, LoRA bytes sent to each engine, adapters pushed."""
        pushes, self._pushes = self._pushes, []
        if not pushes:
            return {}
        return {"perf/push_time": sum(p.seconds for p in pushes),
                "perf/push_bytes": float(sum(p.bytes for p in pushes)),
                "perf/push_adapters": float(sum(p.adapters for p in pushes))}

    # ---- train and commit ---------------------------------------------------------------

    async def train(self, rollout_id: int, batch: RolloutBatch, *, drop_failed: bool = True) -> TrainedBatch | None:
        """Forward and backward of the batch, then the optimizer step of `step_names`.

        None when the backend failed on this batch: it took the batch's gradients back on
        every rank, nothing stepped, and the caller must not commit it; the next batch
        trains as usual. `max_train_failures` failures in a row, a dead rank
        (`TrainRankLostError`), or any failure with `drop_failed=False` are raised: the
        run stops and every adapter is saved on the way out.
        """
        await self.exports_taken()
        try:
            result = await self.backend.train(rollout_id, batch)
        except TrainRankLostError as exc:
            logger.error("%s. Stopping: every adapter is saved from the surviving ranks; start the trainer again "
                         "with the same --save to resume from those checkpoints", exc)
            raise
        except Exception as exc:
            self.train_failures += 1
            if not drop_failed:
                raise
            if self.train_failures >= self.max_train_failures:
                logger.error("Training failed %d times in a row; stopping", self.train_failures)
                raise
            cause = getattr(exc, "cause", None) or exc  # through Ray: the rank's own error, without its traceback
            logger.error("Training rollout %d failed (%s: %s); its batch is dropped and counts for no adapter "
                         "(%d failure(s) in a row, the run stops at %d)", rollout_id, type(cause).__name__, cause,
                         self.train_failures, self.max_train_failures)
            return None
        self.train_failures = 0
        steps = await self.backend.step_adapters(sorted(set(batch.step_names)))
        for name in steps:
            self._loaded[name].stale = True
        return TrainedBatch(result, steps)

    async def commit(self, rollout_id: int) -> MultiLoRASnapshot:
        """The batch trained: the registry adds its groups and steps; returns a fresh snapshot.

        Re-read rather than derived: the commit applies rules the driver does not mirror
        (accumulation, retirement at `num_step`), and saves are named by committed steps.
        """
        await self.controller.mark_batch_trained.remote(rollout_id)
        snapshot = await self.controller.snapshot.remote()
        self._observe(snapshot)
        return snapshot

    # ---- checkpoints --------------------------------------------------------------------

    async def save(self, snapshot: MultiLoRASnapshot) -> list[str]:
        """Save every loaded adapter whose step is a positive multiple of `save_interval`."""
        self._observe(snapshot)
        interval = self.save_interval
        if interval is None:
            return []
        due = [name for name, e in sorted(self._loaded.items())
               if e.saves and e.step > 0 and e.step % interval == 0 and e.step != e.saved_step]
        if not due:
            return []
        positions = await self._data_positions()
        return [name for name in due if await self._save(name, positions.get(name))]

    async def save_all(self) -> list[str]:
        """Shutdown: save every loaded adapter that stepped or trained groups since its last
        checkpoint (the gradient of a step's unfinished window is saved with it)."""
        try:
            await self.settle()
        except Exception as exc:  # a failed push must not cost the adapters' weights
            logger.warning("The last weight push failed (%s); saving anyway", exc)
        if not self._loaded:
            return []
        # Re-read: shutdown may come at any stage of an iteration.
        self._observe(await self.controller.snapshot.remote())
        try:
            positions = await self._data_positions()
        except Exception as exc:  # a dead rollout manager must not cost the adapters' weights
            logger.warning("Data positions unavailable (%s); saving without them", exc)
            positions = {}
        return [name for name in sorted(self._loaded) if await self._save(name, positions.get(name))]

    async def _save(self, name: str, data_position: DataPosition | None) -> bool:
        entry = self._loaded[name]
        state = (entry.step, entry.accumulated_groups)
        if state == (entry.saved_step, entry.saved_groups) or state == (0, 0):
            return False
        if not entry.saves:
            logger.warning("Adapter '%s' has no save directory; its step %d is not saved", name, entry.step)
            return False
        path = await self.backend.save_adapter(SaveRequest(
            name, entry.step, data_position, accumulated_groups=entry.accumulated_groups,
            accumulated_samples=entry.accumulated_groups * entry.samples_per_group,
        ))
        entry.saved_step, entry.saved_groups = state
        logger.info("Adapter '%s' saved at step %d (%d group(s) toward the next) to %s", name, entry.step,
                    entry.accumulated_groups, path)
        return True

    async def _data_positions(self) -> dict[str, DataPosition]:
        return await self.rollout_manager.data_positions.remote()
