"""The adapter lifecycle's operations as typed values: one per registry transition the driver,
the rollout side or the Tinker gateway asks for. The registry holds the transitions; the
backend (`MultiLoRABackend.apply`), the controller actor (`MultiLoRAController.apply`, which
answers the snapshot after it) and the driver's handle forward any of them unchanged:

    snapshot = await controller.apply.remote(RecordWeightUpdate(["math"]))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from miles.controller.registry import AdapterRegistry
from miles.utils.types import AdapterFailure, AdapterState

R = TypeVar("R")


class Transition(ABC, Generic[R]):
    """One lifecycle operation: `run` applies it to the registry and answers what the registry's
    transition answers; the backend writes the rows it changed through to the store."""

    persisted: ClassVar[bool] = True
    """False for a transition whose change is not stored (the backend writes nothing)."""

    @abstractmethod
    def run(self, registry: AdapterRegistry) -> R: ...


class AbortingTransition(Transition[R]):
    """A transition that also aborts adapters' in-flight requests on the engines (the backend
    awaits those aborts; see `MultiLoRABackend.apply`)."""

    def aborts_before(self, registry: AdapterRegistry) -> Sequence[str]:
        """Adapters whose in-flight requests are aborted before it runs."""
        return ()

    def aborts_after(self, result: R) -> Sequence[str]:
        """Adapters whose in-flight requests are aborted after it ran."""
        return ()


@dataclass(frozen=True)
class RetireAdapters(AbortingTransition[list[str]]):
    """RETIRING -> CLEANUP for every retiring adapter, then their requests aborted."""

    def run(self, registry: AdapterRegistry) -> list[str]:
        return registry.retire_adapters()

    def aborts_after(self, result: list[str]) -> Sequence[str]:
        return result


@dataclass(frozen=True)
class FailAdapter(AbortingTransition[bool]):
    """The producer gave up on this registration: ACTIVE/RETIRING -> CLEANUP with `failure` kept,
    then its requests aborted; it ends FAILED once freed. False for a registration no longer live."""

    name: str
    registration_id: str
    failure: AdapterFailure

    def run(self, registry: AdapterRegistry) -> bool:
        return registry.fail(self.name, self.registration_id, self.failure)

    def aborts_after(self, result: bool) -> Sequence[str]:
        return [self.name] if result else []


@dataclass(frozen=True)
class FreeSlots(AbortingTransition[list[int]]):
    """CLEANUP -> COMPLETED (FAILED if it failed) for each of `names` in CLEANUP, after one more
    abort round; the others are left as they are. Answers each one's freed slot, or -1."""

    names: Sequence[str]

    def run(self, registry: AdapterRegistry) -> list[int]:
        return [registry.free_slot(name) for name in self.names]

    def aborts_before(self, registry: AdapterRegistry) -> Sequence[str]:
        return [name for name in self.names if registry.state(name) is AdapterState.CLEANUP]


@dataclass(frozen=True)
class BeginWeightUpdate(Transition[dict[str, int]]):
    """A push of `names` starts: each shows the version it will become as `pushing_version`."""

    names: Sequence[str]
    persisted: ClassVar[bool] = False  # a restarted trainer pushes every adapter again

    def run(self, registry: AdapterRegistry) -> dict[str, int]:
        return registry.begin_weight_update(list(self.names))


@dataclass(frozen=True)
class RecordWeightUpdate(Transition[dict[str, int]]):
    """The push of `names` landed: new slot versions, PENDING -> ACTIVE."""

    names: Sequence[str]

    def run(self, registry: AdapterRegistry) -> dict[str, int]:
        return registry.record_weight_update(list(self.names))


@dataclass(frozen=True)
class RecordBatch(Transition[None]):
    """What a batch holds (groups per adapter, the adapters it steps); nothing advances yet."""

    rollout_id: int
    groups: dict[str, int]
    step_names: Sequence[str]

    def run(self, registry: AdapterRegistry) -> None:
        registry.record_batch_adapters(self.rollout_id, self.groups, list(self.step_names))


@dataclass(frozen=True)
class MarkBatchTrained(Transition[list[str]]):
    """The batch trained: its groups count, adapters step (and retire at `num_step`)."""

    rollout_id: int

    def run(self, registry: AdapterRegistry) -> list[str]:
        return registry.mark_batch_trained(self.rollout_id)


@dataclass(frozen=True)
class SetStep(Transition[None]):
    """A resume: the adapter continues at its checkpoint's step and accumulated groups."""

    name: str
    step: int
    accumulated_groups: int = 0

    def run(self, registry: AdapterRegistry) -> None:
        registry.set_step(self.name, self.step, self.accumulated_groups)


@dataclass(frozen=True)
class RequeueForNewTrainer(Transition[list[str]]):
    """A new trainer over a restored registry: live adapters wait for its first push, those the
    previous trainer was retiring are completed."""

    def run(self, registry: AdapterRegistry) -> list[str]:
        return registry.requeue_for_new_trainer()


@dataclass(frozen=True)
class ActivateClients(Transition[list[str]]):
    """The trainer loaded these client-driven models: PENDING -> ACTIVE (no engine push needed)."""

    names: Sequence[str]

    def run(self, registry: AdapterRegistry) -> list[str]:
        return registry.activate_clients(list(self.names))


@dataclass(frozen=True)
class PageOut(Transition[int]):
    """An idle client-driven model's whole state is in `directory` and its slot emptied: PAGED,
    the slot freed. Answers the slot, or -1 (nothing changed) unless it was ACTIVE."""

    name: str
    directory: str

    def run(self, registry: AdapterRegistry) -> int:
        return registry.page_out(self.name, self.directory)


@dataclass(frozen=True)
class PageIn(Transition[int]):
    """PAGED -> PENDING in a free slot (answered); `NoSlotToPageInError` when none is free."""

    name: str

    def run(self, registry: AdapterRegistry) -> int:
        return registry.page_in(self.name)


@dataclass(frozen=True)
class RecordClientStep(Transition[int | None]):
    """A client-driven model's optim_step ran: its new step (None if it is not live)."""

    name: str

    def run(self, registry: AdapterRegistry) -> int | None:
        return registry.record_client_step(self.name)


@dataclass(frozen=True)
class RecordClientCheckpoint(Transition[bool]):
    """A client-driven model saved or loaded `directory`: its resume point from now on."""

    name: str
    directory: str

    def run(self, registry: AdapterRegistry) -> bool:
        return registry.record_client_checkpoint(self.name, self.directory)
