"""Weight pushes from the training backend to every engine, in either `--engine-lora-update` mode.

    pusher = EnginePusher(backend, engines, rollout_manager, mode="in_place")
    stats = await pusher.push([(slot, version, export), ...])   # export: backend.export_adapter(name)
    await pusher.unload(slot)                                    # the adapter left its slot
    await pusher.close()

`in_place`: the exporting train rank forms a weights-update group with each engine
(joined at the first push, and again whenever the engine is out of it, e.g. after its
server restarted); each push sends names, dtypes and shapes to the engines and the
tensors by broadcast from the train rank, group after group. One group per engine
rather than one for all: a server that dies mid-push breaks only its own group (the
others finish at once) and is rejoined alone. The slot keeps its engine-side name; an engine
swaps the weights between two decode steps, so a request decoding across a push
produces its earlier tokens with the old weights and its later ones with the new (its
group is stamped with the old version, so staleness counts it as the older policy).

`versioned`: each engine writes the tensors (read from the object store) to a PEFT
directory and loads `__miles_slot_{i}_v{version}` beside the version requests use now,
unloading any older one. Groups name the version they were stamped with on every turn,
so before a push the pusher waits until no group in flight is stamped older than the
version served now (the rollout manager's `versions_in_flight`).

Engines keep the object-store reference of every push, so one whose server restarts
reloads each live slot at its current version before it takes requests. Each push is also
recorded with the rollout manager's engine fleet before it is sent (`record_push`; an
unload calls `forget_slot` first): an engine actor that Ray restarted comes back empty,
and the fleet loads every recorded slot into it before it goes back behind the router. An
engine that is down when a push reaches it (`engine_down`) is skipped for that push, since
the fleet loads the recorded push into it before it serves again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError

from miles.backends.base import LoraExport, TrainingBackend
from miles.lora.weight_sync import UpdateGroupSpec
from miles.rollout.engines.engine_actor import EngineNotReadyError
from miles.utils.types import LoraUpdateMode, SlotPush, UpdateGroupLayout

logger = logging.getLogger(__name__)

UPDATE_GROUP_TIMEOUT_S = 120.0
IN_PLACE_ATTEMPTS = 3
DRAIN_POLL_S = 0.05


def engine_down(exc: BaseException) -> bool:
    """The engine actor is dead or being restarted by Ray, or has no server yet."""
    return isinstance(exc, (RayActorError, EngineNotReadyError))


@dataclass(frozen=True)
class PushStats:
    """One push stage: every stale adapter to every engine."""

    adapters: int
    bytes: int
    """LoRA bytes sent to each engine (the sum over the pushed adapters)."""
    seconds: float
    joins: int = 0
    """Weights-update groups (one per engine) built or rebuilt during the stage (in_place)."""


class EnginePusher:
    def __init__(self, backend: TrainingBackend, engines: Sequence[Any], rollout_manager: Any, *,
                 mode: LoraUpdateMode = "in_place", drain_timeout_s: float = 300.0) -> None:
        """`engines`: engine actor handles (`miles.rollout.engines.engine_actor.EngineActor`);
        `rollout_manager`: its `update_group_layout`, `versions_in_flight`, `record_push` and
        `forget_slot` are used."""
        if mode not in ("in_place", "versioned"):
            raise ValueError(f"unknown --engine-lora-update {mode!r}: use in_place or versioned")
        self.backend = backend
        self.engines = list(engines)
        self.rollout_manager = rollout_manager
        self.mode = mode
        self.drain_timeout_s = drain_timeout_s
        self._groups: dict[int, UpdateGroupSpec] = {}
        """Engine index -> the weights-update group it shares with the exporting train rank."""
        self._broken: set[int] = set()
        """Engines whose group failed a push (rebuilt before their next push)."""
        self._layout: UpdateGroupLayout | None = None
        """Asked of the rollout manager once."""
        self._down: set[int] = set()
        """Engines found down (dead, restarting, or without a server) since they last answered."""

    async def push(self, pushes: Sequence[tuple[int, int, LoraExport]]) -> PushStats:
        """Load each (slot, version, export) into every engine; returns once every engine serves them."""
        start, joins = time.perf_counter(), 0
        # One call each for the stage, not per adapter: the rollout manager and the engine
        # actors share their cores with generation, and every round trip waits for them.
        if not pushes:
            return PushStats(adapters=0, bytes=0, seconds=0.0)
        await self.rollout_manager.record_push.remote(*(SlotPush(slot, version, export.peft_config, export.tensors)
                                                        for slot, version, export in pushes))
        up = None
        if self.mode == "in_place":
            up, joins = await self._join_missing(list(range(len(self.engines))), f"{len(pushes)} adapter(s)")
        for slot, version, export in pushes:
            if self.mode == "versioned":
                await self._wait_drained(slot, version)
                results = await asyncio.gather(*(e.push_lora.remote(slot, version, export.peft_config, export.tensors)
                                                 for e in self.engines), return_exceptions=True)
                self._raise_unless_down(enumerate(results), f"slot {slot} v{version}")
            else:
                joins += await self._push_in_place(slot, version, export, up)
        return PushStats(adapters=len(pushes), bytes=sum(export.nbytes for _, _, export in pushes),
                         seconds=time.perf_counter() - start, joins=joins)

    async def unload(self, slot: int) -> None:
        """Unload every version of `slot` from every engine."""
        await self.rollout_manager.forget_slot.remote(slot)
        results = await asyncio.gather(*(e.unload_slot.remote(slot) for e in self.engines), return_exceptions=True)
        self._raise_unless_down(enumerate(results), f"the unload of slot {slot}")

    def _raise_unless_down(self, results: Iterable[tuple[int, Any]], what: str) -> None:
        """Raise the first failure of an engine that is up; an engine that is down misses `what`
        (the fleet loads the live slots into it before it serves again)."""
        for i, result in results:
            if not isinstance(result, BaseException):
                self._down.discard(i)
            elif not engine_down(result):
                raise result
            else:
                self._log_down(i, what, result)

    def _log_down(self, i: int, what: str, cause: BaseException) -> None:
        level = logging.DEBUG if i in self._down else logging.WARNING  # once per outage
        self._down.add(i)
        logger.log(level, "Engine %d is down (%s) and misses %s; the fleet loads every live slot into it "
                   "before it serves again", i, type(cause).__name__, what)

    async def close(self) -> None:
        """Leave the weights-update group (the engines leave theirs when they shut down)."""
        if self._groups:
            self._groups.clear()
            await self.backend.leave_update_group(None)

    # ---- in_place ----------------------------------------------------------------------

    async def _push_in_place(self, slot: int, version: int, export: LoraExport, up: list[int] | None = None) -> int:
        """Broadcast to every engine; an engine whose push fails (its server died) is rejoined and
        pushed again, the others are not held up by it. `up`: the engines the stage found up
        and in their groups (checked again only for a retry)."""
        joins, pending = 0, list(range(len(self.engines)))
        for attempt in range(1, IN_PLACE_ATTEMPTS + 1):
            if attempt == 1 and up is not None and all(i in self._groups and i not in self._broken for i in up):
                pending = list(up)
            else:
                pending, joined = await self._join_missing(pending, f"slot {slot} v{version}")
                joins += joined
            unjoined = [i for i in pending if i not in self._groups]
            if unjoined and attempt == IN_PLACE_ATTEMPTS:
                raise RuntimeError(f"engines {unjoined} could not join a weights-update group for slot {slot} "
                                   f"v{version} after {IN_PLACE_ATTEMPTS} attempts (see the warnings above)")
            pending = [i for i in pending if i in self._groups]
            names = [self._groups[i].group_name for i in pending]
            bucketed = self._layout is not None and self._layout.bucketed
            sent, *loaded = await asyncio.gather(
                self.backend.broadcast_adapter(export, names, bucketed=bucketed),
                *(self.engines[i].push_lora_from_distributed.remote(
                    slot, version, export.peft_config, export.names, export.dtypes, export.shapes,
                    self._groups[i].group_name, weights_ref=[export.tensors], bucketed=bucketed) for i in pending),
                return_exceptions=True)
            if isinstance(sent, BaseException):
                raise sent
            failed = []
            for i, name, result in zip(pending, names, loaded):
                if name in sent:  # the engine's server died mid-push: its group is broken
                    self._broken.add(i)
                if isinstance(result, BaseException) and engine_down(result):
                    self._broken.add(i)
                    self._log_down(i, f"slot {slot} v{version}", result)
                elif isinstance(result, BaseException):
                    failed.append(i)
                    self._broken.add(i)
                    logger.warning("In-place push of slot %d v%d to engine %d failed (attempt %d/%d): %s", slot,
                                   version, i, attempt, IN_PLACE_ATTEMPTS, result)
                # else: it serves the version (a restarted one reloaded it from the object store)
            if not failed and not unjoined:
                return joins
            if attempt == IN_PLACE_ATTEMPTS:
                raise loaded[pending.index(failed[0])]
            pending = failed + unjoined
        raise AssertionError("unreachable")

    async def _join_missing(self, engines: list[int], what: str) -> tuple[list[int], int]:
        """(Re)build the weights-update group of every listed engine that is out of its group.
        Returns the engines that are up (those down miss `what`) and the number of joins tried."""
        answers = await asyncio.gather(*(self.engines[i].update_group_joined.remote() for i in engines),
                                       return_exceptions=True)
        self._raise_unless_down(zip(engines, answers), what)
        joined = {i: ok for i, ok in zip(engines, answers) if not isinstance(ok, BaseException)}
        engines = list(joined)
        missing = [i for i, ok in joined.items() if not ok or i not in self._groups or i in self._broken]
        if missing:
            if self._layout is None:
                self._layout = await self.rollout_manager.update_group_layout.remote()
            results = await asyncio.gather(*(self._join(i) for i in missing), return_exceptions=True)
            for i, result in zip(missing, results):
                if isinstance(result, BaseException):
                    logger.warning("Engine %d could not join a weights-update group: %s", i, result)
        return engines, len(missing)

    async def _join(self, i: int) -> None:
        """One group per engine: the exporting train rank at 0, the engine's ranks after it, so a
        dead engine breaks only its own group."""
        engine, old = self.engines[i], self._groups.pop(i, None)
        self._broken.discard(i)
        if old is not None:
            await asyncio.gather(self.backend.leave_update_group(old.group_name),
                                 engine.destroy_weights_update_group.remote(old.group_name))
        layout = self._layout
        assert layout is not None, "the layout is asked for before the first join"
        host, port = await self.backend.update_group_endpoint()
        spec = UpdateGroupSpec(master_address=host, master_port=port, world_size=1 + layout.ranks_per_engine,
                               group_name=f"miles_lora_update_{i}_{uuid.uuid4().hex[:8]}", backend=layout.backend,
                               timeout_s=UPDATE_GROUP_TIMEOUT_S)
        await asyncio.gather(self.backend.join_update_group(spec),
                             engine.init_weights_update_group.remote(**spec.init_request(rank_offset=1)))
        self._groups[i] = spec
        logger.info("Weights-update group %s: the exporting train rank and engine %d at %s:%d (%s)",
                    spec.group_name, i, host, port, layout.backend)

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
