"""Early activation: an adapter registered while the loop generates or trains is pushed at once.

    async with activation.activating():   # around generate and train
        ...

A registration need not wait for the loop's next iteration to become ACTIVE. While
`activating()` is open, the controller is long-polled for registrations
(`wait_for_registration`); each new adapter that would load fresh is pushed to the engines
at once with the weights the backend will give it (`fresh_export`: the same seeded draws,
computed without touching a slot, so it runs beside a train call) and recorded, so it is
ACTIVE within a push's time. The trainer loads it at the next reconcile like any other
adapter and does not push it again (`claim`); the batch being collected never holds it (the
collector samples the adapters of the iteration's snapshot). An adapter that would resume
from a checkpoint waits for the reconcile. One that leaves before its load is unloaded from
the engines there (`left`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Collection

from miles.backends.base import AdapterSpec, TrainingBackend
from miles.main.handles import ControllerHandle
from miles.main.weight_push import WeightPush
from miles.utils.types import AdapterRun, MultiLoRASnapshot

logger = logging.getLogger(__name__)

LONG_POLL_S = 1.0
"""How long one `wait_for_registration` call waits on the controller before it answers."""


class EarlyActivation:
    def __init__(self, backend: TrainingBackend, controller: ControllerHandle, push: WeightPush,
                 loaded: Callable[[], Collection[str]]) -> None:
        self.backend = backend
        self.controller = controller
        self.push = push
        self._loaded = loaded
        """The names the trainer holds (`AdapterSlots.loaded`)."""
        self.pushed: dict[str, tuple[str, int]] = {}
        """Adapters pushed early and not loaded yet: name -> (registration id, slot)."""
        self._resumes: set[str] = set()
        """Registration ids left to the reconcile (they resume from a checkpoint)."""
        self._seen = -1
        """The controller's registration count at the last look (-1: look at once)."""

    @contextlib.asynccontextmanager
    async def activating(self) -> AsyncIterator[None]:
        """While the block runs, push new registrations to the engines as they arrive. On
        exit an activation under way finishes; its error is raised."""
        stop = asyncio.Event()
        task = asyncio.create_task(self._activate_until(stop), name="early-activation")
        try:
            yield
        except BaseException:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)  # the block's own error wins
            raise
        stop.set()
        await task

    def claim(self, run: AdapterRun) -> bool:
        """At its load: whether the engines already serve this registration's fresh weights
        (pushed early into the same slot). Forgets the adapter either way."""
        self._resumes.discard(run.registration_id)
        return self.pushed.pop(run.name, None) == (run.registration_id, run.slot)

    def left(self, snapshot: MultiLoRASnapshot) -> list[int]:
        """Forget the adapters pushed early that left before their load; returns their slots
        (the engines must stop serving them)."""
        live = snapshot.live
        slots = []
        for name, (registration_id, slot) in sorted(self.pushed.items()):
            run = live.get(name)
            if run is None or run.registration_id != registration_id:
                del self.pushed[name]
                slots.append(slot)
                logger.info("Adapter '%s' left before the trainer loaded it; unloaded from the engines", name)
        self._resumes &= {run.registration_id for run in live.values()}
        return slots

    async def _activate_until(self, stop: asyncio.Event) -> None:
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while True:
                seen = self._seen
                registered = asyncio.ensure_future(self.controller.wait_for_registration.remote(seen, LONG_POLL_S))
                await asyncio.wait({registered, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if stopped.done():  # the poll's answer (at most LONG_POLL_S away) is not needed
                    registered.cancel()
                    return
                total = registered.result()
                if total == seen:
                    continue
                self._seen = total
                snapshot = await self.controller.snapshot.remote()
                loaded = self._loaded()
                new = [run for name, run in sorted(snapshot.pending.items()) if name not in loaded
                       and name not in self.pushed and run.registration_id not in self._resumes]
                if new:
                    await self._activate(new)
        finally:
            stopped.cancel()

    async def _activate(self, runs: list[AdapterRun]) -> None:
        exports = await asyncio.gather(*(self.backend.fresh_export(AdapterSpec.from_run(run)) for run in runs))
        fresh = [(run, export) for run, export in zip(runs, exports) if export is not None]
        self._resumes.update(run.registration_id for run, export in zip(runs, exports) if export is None)
        if not fresh:
            return
        await self.push.push_now([run.name for run, _ in fresh], [export for _, export in fresh])
        for run, _ in fresh:
            self.pushed[run.name] = (run.registration_id, run.slot)
            logger.info("Adapter '%s' pushed to the engines during the iteration; the trainer loads it at the next",
                        run.name)
