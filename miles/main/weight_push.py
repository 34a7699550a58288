"""The weight push stage: which adapters the engines must get, at which version, and when.

    push = WeightPush(backend, controller, pusher, overlap=True)
    push.mark_stale(["math"])                         # newly loaded, or stepped
    snapshot = await push.update_weights(snapshot)    # new adapters now, stepped ones behind the loop
    await push.exports_taken()                        # before a train call changes the weights in flight
    snapshot = await push.settle(snapshot)            # the push behind the loop has landed

`WeightPush` owns the push: the set of *stale* adapters (the engines do not serve their
current weights: newly loaded, or stepped since their last push), the versions (the registry
assigns each push's version at `begin_weight_update`, shown in snapshots as
`pushing_version`, and records it at `record_weight_update`, PENDING -> ACTIVE), one push at a
time, and the push metrics. Moving the tensors to the engines is `EnginePusher`'s job
(`miles.main.engine_push`), in either `--engine-lora-update` mode.

Adapters waiting for their first push (PENDING) are pushed before the stage returns: a new
registration becomes ACTIVE without waiting for the stepped adapters' push. With `overlap`
(`--overlap-weight-push`) the stepped adapters' export and push run behind the loop: the stage
returns at once with the registry's snapshot naming the versions under way, so the batch
generated meanwhile counts its staleness against the weights the trainer has sent.
`exports_taken` (the train stage awaits it) holds the next train call until the export is
done, so the weights pushed are the ones the snapshot names; `settle` waits for the push (the
loop calls it at the end of each iteration; the next push, any cleanup and shutdown settle
first) and raises its error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, overload

from miles.backends.base import LoraExport, TrainingBackend
from miles.main.engine_push import PushStats
from miles.main.handles import ControllerHandle
from miles.utils.types import MultiLoRASnapshot
from miles.utils.types.lifecycle_ops import BeginWeightUpdate, RecordWeightUpdate

logger = logging.getLogger(__name__)


class Pusher(Protocol):
    """Moves exported LoRA weights to every engine (`miles.main.engine_push.EnginePusher`)."""

    async def push(self, pushes: Sequence[tuple[int, int, LoraExport]]) -> PushStats: ...

    async def unload(self, slot: int) -> None: ...


@dataclass
class _Behind:
    """A push running behind the loop."""

    task: asyncio.Task[MultiLoRASnapshot]
    """Export, push and record; answers the registry's snapshot after the record."""
    exported: asyncio.Event
    """Set once the export is done (a train call may change the weights from then on)."""


class WeightPush:
    def __init__(self, backend: TrainingBackend, controller: ControllerHandle, pusher: Pusher | None, *,
                 overlap: bool = False) -> None:
        self.backend = backend
        self.controller = controller
        self.pusher = pusher
        """None: no engines (the registry still records each push)."""
        self.overlap = overlap
        self.stale: set[str] = set()
        """Loaded adapters whose current weights the engines do not serve."""
        self._behind: _Behind | None = None
        self._lock = asyncio.Lock()
        """One push at a time: the one behind the loop and an early activation share the engines."""
        self._stats: list[PushStats] = []
        """Pushes since the last `pop_push_metrics`."""

    def mark_stale(self, names: Iterable[str]) -> None:
        """The engines must get these adapters' current weights (newly loaded, or stepped)."""
        self.stale.update(names)

    def forget(self, name: str) -> None:
        """The adapter left the trainer: nothing of it is pushed any more."""
        self.stale.discard(name)

    async def update_weights(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        """Push the stale adapters to every engine (see the module docstring)."""
        snapshot = await self.settle(snapshot)
        live = snapshot.live
        stale = sorted(name for name in self.stale if name in live)
        new = [name for name in stale if name in snapshot.pending]
        stepped = [name for name in stale if name not in snapshot.pending]
        if new:
            snapshot = await self._push(new)
        if stepped and self.overlap:
            snapshot = await self.controller.apply.remote(BeginWeightUpdate(stepped))
            self.stale.difference_update(stepped)
            exported = asyncio.Event()
            task = asyncio.create_task(self._export_and_send(stepped, snapshot, exported), name="weight-push")
            self._behind = _Behind(task, exported)
            return snapshot
        if stepped:
            snapshot = await self._push(stepped)
        return snapshot

    async def push_now(self, names: list[str], exports: list[LoraExport]) -> MultiLoRASnapshot:
        """Push weights exported elsewhere (a new adapter's fresh ones) and record them."""
        return await self._send(names, exports, await self.controller.apply.remote(BeginWeightUpdate(names)))

    async def exports_taken(self) -> None:
        """Wait until the push behind the loop has exported its adapters (or failed: `settle`
        raises its error), so that a train call may change their weights."""
        behind = self._behind
        if behind is None or behind.exported.is_set():
            return
        waiter = asyncio.ensure_future(behind.exported.wait())
        await asyncio.wait({waiter, behind.task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()

    @overload
    async def settle(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot: ...

    @overload
    async def settle(self, snapshot: None = None) -> None: ...

    async def settle(self, snapshot: MultiLoRASnapshot | None = None) -> MultiLoRASnapshot | None:
        """Wait for the push running behind the loop, if any (its failure is raised here).

        Returns `snapshot` when nothing was behind; else the registry's current snapshot
        (read again: the push recorded its versions at a time the loop does not know)."""
        behind, self._behind = self._behind, None
        if behind is None:
            return snapshot
        await behind.task
        return None if snapshot is None else await self.controller.snapshot.remote()

    async def unload(self, slot: int) -> None:
        """The engines stop serving `slot` (its adapter left) before another adapter takes it."""
        if self.pusher is not None:
            await self.pusher.unload(slot)

    def pop_push_metrics(self) -> dict[str, float]:
        """The pushes since the last call, summed, for the loop's record (nothing if none):
        engine push seconds, LoRA bytes sent to each engine, adapters pushed."""
        pushes, self._stats = self._stats, []
        if not pushes:
            return {}
        return {"perf/push_time": sum(p.seconds for p in pushes),
                "perf/push_bytes": float(sum(p.bytes for p in pushes)),
                "perf/push_adapters": float(sum(p.adapters for p in pushes))}

    async def _push(self, names: list[str]) -> MultiLoRASnapshot:
        began = await self.controller.apply.remote(BeginWeightUpdate(names))
        self.stale.difference_update(names)
        exports = await asyncio.gather(*(self.backend.export_adapter(name) for name in names))
        return await self._send(names, list(exports), began)

    async def _export_and_send(self, names: list[str], began: MultiLoRASnapshot,
                               exported: asyncio.Event) -> MultiLoRASnapshot:
        exports = await asyncio.gather(*(self.backend.export_adapter(name) for name in names))
        exported.set()
        return await self._send(names, list(exports), began)

    async def _send(self, names: list[str], exports: list[LoraExport], began: MultiLoRASnapshot) -> MultiLoRASnapshot:
        """Push each export at the version its push began with, then record the versions."""
        live = began.live
        # An adapter that left since (CLEANUP) is not pushed; the registry skips it too.
        kept = [(live[name], export) for name, export in zip(names, exports) if name in live]
        if self.pusher is not None and kept:
            pushes = []
            for run, export in kept:
                assert run.pushing_version is not None, f"no push of adapter '{run.name}' was begun"
                pushes.append((run.slot, run.pushing_version, export))
            async with self._lock:
                stats = await self.pusher.push(pushes)
            self._stats.append(stats)
            logger.info("Pushed %d adapter(s), %d bytes per engine, in %.3fs", stats.adapters, stats.bytes,
                        stats.seconds)
        return await self.controller.apply.remote(RecordWeightUpdate([run.name for run, _ in kept]))
