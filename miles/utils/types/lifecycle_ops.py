"""The adapter lifecycle's operations as typed values: one per registry transition that the
driver, the rollout side or the Tinker gateway asks for. Plain data, so any layer may send
them; `miles.controller.lifecycle` runs each on the registry, and the controller actor
(`MultiLoRAController.apply`, which answers the snapshot after it) forwards any of them:

    snapshot = await controller.apply.remote(RecordWeightUpdate(["math"]))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from miles.utils.types.control_plane import AdapterFailure

R = TypeVar("R")


class Transition(Generic[R]):
    """One lifecycle operation, answered with what the registry's transition answers (`R`);
    the backend writes the rows it changed through to the store."""

    persisted: ClassVar[bool] = True
    """False for a transition whose change is not stored (the backend writes nothing)."""


class AbortingTransition(Transition[R]):
    """A transition that also aborts adapters' in-flight requests on the engines (the backend
    awaits those aborts; see `MultiLoRABackend.apply`)."""

    aborting: ClassVar[bool] = True


@dataclass(frozen=True)
class RetireAdapters(AbortingTransition[list[str]]):
    """RETIRING -> CLEANUP for every retiring adapter, then their requests aborted."""


@dataclass(frozen=True)
class FailAdapter(AbortingTransition[bool]):
    """The producer gave up on this registration: ACTIVE/RETIRING -> CLEANUP with `failure` kept,
    then its requests aborted; it ends FAILED once freed. False for a registration no longer live."""

    name: str
    registration_id: str
    failure: AdapterFailure


@dataclass(frozen=True)
class FreeSlots(AbortingTransition[list[int]]):
    """CLEANUP -> COMPLETED (FAILED if it failed) for each of `names` in CLEANUP, after one more
    abort round; the others are left as they are. Answers each one's freed slot, or -1."""

    names: Sequence[str]


@dataclass(frozen=True)
class BeginWeightUpdate(Transition[dict[str, int]]):
    """A push of `names` starts: each shows the version it will become as `pushing_version`."""

    names: Sequence[str]
    persisted: ClassVar[bool] = False  # a restarted trainer pushes every adapter again


@dataclass(frozen=True)
class RecordWeightUpdate(Transition[dict[str, int]]):
    """The push of `names` landed: new slot versions, PENDING -> ACTIVE."""

    names: Sequence[str]


@dataclass(frozen=True)
class RecordBatch(Transition[None]):
    """What a batch holds (groups per adapter, the adapters it steps); nothing advances yet."""

    rollout_id: int
    groups: dict[str, int]
    step_names: Sequence[str]


@dataclass(frozen=True)
class MarkBatchTrained(Transition[list[str]]):
    """The batch trained: its groups count, adapters step (and retire at `num_step`)."""

    rollout_id: int


@dataclass(frozen=True)
class SetStep(Transition[None]):
    """A resume: the adapter continues at its checkpoint's step and accumulated groups."""

    name: str
    step: int
    accumulated_groups: int = 0


@dataclass(frozen=True)
class RequeueForNewTrainer(Transition[list[str]]):
    """A new trainer over a restored registry: live adapters wait for its first push, those the
    previous trainer was retiring are completed."""


@dataclass(frozen=True)
class ActivateClients(Transition[list[str]]):
    """The trainer loaded these client-driven models: PENDING -> ACTIVE (no engine push needed)."""

    names: Sequence[str]


@dataclass(frozen=True)
class PageOut(Transition[int]):
    """An idle client-driven model's whole state is in `directory` and its slot emptied: PAGED,
    the slot freed. Answers the slot, or -1 (nothing changed) unless it was ACTIVE."""

    name: str
    directory: str


@dataclass(frozen=True)
class PageIn(Transition[int]):
    """PAGED -> PENDING in a free slot (answered); `NoSlotToPageInError` when none is free."""

    name: str


@dataclass(frozen=True)
class RecordClientStep(Transition[int | None]):
    """A client-driven model's optim_step ran: its new step (None if it is not live)."""

    name: str


@dataclass(frozen=True)
class RecordClientCheckpoint(Transition[bool]):
    """A client-driven model saved or loaded `directory`: its resume point from now on."""

    name: str
    directory: str

