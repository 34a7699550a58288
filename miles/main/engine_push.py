"""Weight pushes from the training backend to every engine, in either `--engine-lora-update` mode.

    pusher = EnginePusher(backend, engines, rollout_manager, mode="in_place")
    stats = await pusher.push([(slot, version, export), ...])   # export: backend.export_adapter(name)
    await pusher.unload(slot)                                    # the adapter left its slot
    await pusher.close()

`in_place`: the exporting train rank and every engine form a weights-update group
(joined at the first push, and again whenever an engine is out of it, e.g. after its
server restarted); each push sends names, dtypes and shapes to the engines and the
tensors by broadcast from the train rank. The slot keeps its engine-side name; an engine
swaps the weights between two decode steps, so a request decoding across a push
produces its earlier tokens with the old weights and its later ones with the new (its
group is stamped with the old version, so staleness counts it as the older policy).

`versioned`: each engine writes the tensors (read from the object store) to a PEFT
directory and loads `__miles_slot_{i}_v{version}` beside the version requests use now,
unloading any older one. Groups name the version they were stamped with on every turn,
so before a push the pusher waits until no group in flight is stamped older than the
version served now (the rollout manager's `versions_in_flight`).

Engines keep the object-store reference of every push, so one that restarts reloads
each live slot at its current version before it takes requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.backends.base import LoraExport, TrainingBackend
from miles.backends.weight_sync import UpdateGroupSpec
from miles.utils.types import LoraUpdateMode

logger = logging.getLogger(__name__)

UPDATE_GROUP_TIMEOUT_S = 120.0
IN_PLACE_ATTEMPTS = 3
DRAIN_POLL_S = 0.05


@dataclass(frozen=True)
class PushStats:
    """One push stage: every stale adapter to every engine."""

    adapters: int
    bytes: int
    """LoRA bytes sent to each engine (the sum over the pushed adapters)."""
    seconds: float
    joins: int = 0
    """Weights-update groups (re)built during the stage (in_place)."""


class EnginePusher:
    def __init__(self, backend: TrainingBackend, engines: Sequence[Any], rollout_manager: Any, *,
                 mode: LoraUpdateMode = "in_place", drain_timeout_s: float = 300.0) -> None:
        """`engines`: engine actor handles (`miles.rollout.engines.engine_actor.EngineActor`);
        `rollout_manager`: its `update_group_spec` and `versions_in_flight` are used."""
        if mode not in ("in_place", "versioned"):
            raise ValueError(f"unknown --engine-lora-update {mode!r}: use in_place or versioned")
        self.backend = backend
        self.engines = list(engines)
        self.rollout_manager = rollout_manager
        self.mode = mode
        self.drain_timeout_s = drain_timeout_s
        self._group: UpdateGroupSpec | None = None

    async def push(self, pushes: Sequence[tuple[int, int, LoraExport]]) -> PushStats:
        """Load each (slot, version, export) into every engine; returns once every engine serves them."""
        start, joins = time.perf_counter(), 0
        for slot, version, export in pushes:
            if self.mode == "versioned":
                await self._wait_drained(slot, version)
                await asyncio.gather(*(e.push_lora.remote(slot, version, export.peft_config, export.tensors)
                                       for e in self.engines))
            else:
                joins += await self._push_in_place(slot, version, export)
        return PushStats(adapters=len(pushes), bytes=sum(export.nbytes for _, _, export in pushes),
                         seconds=time.perf_counter() - start, joins=joins)

    async def unload(self, slot: int) -> None:
        """Unload every version of `slot` from every engine."""
        await asyncio.gather(*(e.unload_slot.remote(slot) for e in self.engines))

    async def close(self) -> None:
        """Leave the weights-update group (the engines leave theirs when they shut down)."""
        if self._group is not None:
            self._group = None
            await self.backend.leave_update_group()

    # ---- in_place ----------------------------------------------------------------------

    async def _push_in_place(self, slot: int, version: int, export: LoraExport) -> int:
        joins = 0
        for attempt in range(1, IN_PLACE_ATTEMPTS + 1):
            if not await self._group_ready():
                await self._join()
                joins += 1
            assert self._group is not None
            results = await asyncio.gather(
                self.backend.broadcast_adapter(export),
                *(e.push_lora_from_distributed.remote(slot, version, export.peft_config, export.names, export.dtypes,
                                                      export.shapes, self._group.group_name,
                                                      weights_ref=[export.tensors])
                  for e in self.engines),
                return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if not errors:
                return joins
            if not any(isinstance(r, BaseException) for r in results[1:]):
                # The sender failed but every engine holds the version (one that died meanwhile
                # reloaded it from the object store on restart): only the group is broken.
                logger.warning("Broadcast of slot %d v%d failed (%s); every engine loaded it, rejoining the "
                               "weights-update group before the next push", slot, version, errors[0])
                self._group = None
                return joins
            logger.warning("In-place push of slot %d v%d failed (attempt %d/%d): %s", slot, version, attempt,
                           IN_PLACE_ATTEMPTS, errors[0])
            self._group = None  # rejoin: an engine may have restarted, or the group is broken
            if attempt == IN_PLACE_ATTEMPTS:
                raise errors[0]
        raise AssertionError("unreachable")

    async def _group_ready(self) -> bool:
        if self._group is None:
            return False
        return all(await asyncio.gather(*(e.update_group_joined.remote() for e in self.engines)))

    async def _join(self) -> None:
        """(Re)build the weights-update group: the exporting rank at 0, every engine at its offset."""
        old, self._group = self._group, None
        await asyncio.gather(self.backend.leave_update_group(),
                             *(e.destroy_weights_update_group.remote(old.group_name) for e in self.engines
                               if old is not None))
        host, port = await self.backend.update_group_endpoint()
        spec: UpdateGroupSpec = await self.rollout_manager.update_group_spec.remote(
            host, port, f"miles_lora_update_{uuid.uuid4().hex[:12]}", UPDATE_GROUP_TIMEOUT_S)
        ranks_per_engine = (spec.world_size - 1) // len(self.engines)
        await asyncio.gather(
            self.backend.join_update_group(spec),
            *(e.init_weights_update_group.remote(**spec.init_request(rank_offset=1 + i * ranks_per_engine))
              for i, e in enumerate(self.engines)))
        self._group = spec
        logger.info("Weights-update group %s: the exporting train rank and %d engine(s) at %s:%d (%s)",
                    spec.group_name, len(self.engines), host, port, spec.backend)

    # ---- versioned ---------------------------------------------------------------------

    async def _wait_drained(self, slot: int, version: int) -> None:
        """Wait until no group in flight names a version of `slot` older than `version - 1` (the
        engines keep the served version and load `version` beside it, unloading older ones)."""
        deadline = time.monotonic() + self.drain_timeout_s
        while True:
            oldest = (await self.rollout_manager.versions_in_flight.remote()).get(slot)
            if oldest is None or oldest >= version - 1:
                return
            if time.monotonic() >= deadline:
                logger.warning("Slot %d: groups stamped v%d are still in flight after %.0fs; pushing v%d "
                               "unloads that version (their later requests fail and the groups are "
                               "regenerated)", slot, oldest, self.drain_timeout_s, version)
                return
            await asyncio.sleep(DRAIN_POLL_S)
