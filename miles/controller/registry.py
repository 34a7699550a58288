"""The adapter lifecycle state machine (DESIGN §2): plain Python, no Ray, no HTTP.

`AdapterRegistry` owns the slots, the adapters' states (QUEUED, PENDING ... COMPLETED or
FAILED, PAGED for idle client-driven ones) and their batch accounting. Each transition is a
`@transition` method whose body answers `Changed(result, names)`: callers get the result, and
the names are the rows the store writes next. The typed ops of `lifecycle.py` name them.

    registry = AdapterRegistry(n_slots=4)
    slot = registry.register("math", resolved_config)     # PENDING, lowest free slot
    registry.record_weight_update(["math"])               # pushed: ACTIVE
    registry.record_batch_adapters(0, {"math": 8}, ["math"]); registry.mark_batch_trained(0)   # step 1
    registry.deregister("math"); registry.retire_adapters(); registry.free_slot("math")       # COMPLETED
"""

from __future__ import annotations

import functools
import itertools
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from miles.controller.registry_listing import Listed, StatusListing, listed, queued_status, record_status
from miles.controller.registry_records import (
    AnyAdapterConfig,
    BatchRecord,
    Changed,
    Queued,
    Record,
    RegistryChanges,
    RegistryState,
    batch_from_json,
    batch_to_json,
    queued_from_json,
    record_from_json,
    record_to_json,
)
from miles.utils.adapter_config import AdapterConfigError, AdapterRunConfig, resolved_field, validate_adapter_name
from miles.utils.arguments import DEFAULT_QUEUE_SIZE
from miles.utils.types import (
    AdapterFailure,
    AdapterKind,
    AdapterRun,
    AdapterState,
    AdapterStatus,
    ClientAdapterRun,
    ClientModelConfig,
    MultiLoRASnapshot,
    next_slot_version,
)

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

COMPLETED_RETENTION = 1024
"""Terminal (COMPLETED and FAILED) records kept for status queries; the oldest go first."""
BATCH_RECORD_RETENTION = 16


class AdapterRegistryError(Exception):
    """Base of every error the registry raises."""


class AdapterValidationError(AdapterRegistryError, ValueError):
    """A registration that cannot be accepted as given (HTTP 400); the message says why."""


class AdapterConflictError(AdapterValidationError):
    """The name is taken: already registered, or its previous run is still cleaning up."""


class AdapterAlreadyRegisteredError(AdapterConflictError):
    """The name is live (PENDING or ACTIVE): a client re-sending its registration after a
    restart may treat this as success (`register(..., exist_ok=True)` does)."""


class AdapterNotFoundError(AdapterRegistryError, LookupError):
    """No adapter of that name is known (HTTP 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "adapter not registered"


class NoFreeSlotError(AdapterRegistryError, RuntimeError):
    """Every slot is held and the registration cannot wait for one (the queue is off, or it is
    a client-driven adapter); retry after an adapter completes (HTTP 409). A `RuntimeError`,
    as in Miles, whose callers catch it as one."""


@functools.lru_cache(maxsize=8192)
def _resolved(path: str) -> Path:
    """`Path(path).resolve()`, once per path: every registration compares its save directory
    with those of every live and queued adapter."""
    return Path(path).resolve()


class NoSlotToPageInError(NoFreeSlotError):
    """A PAGED client-driven adapter got a command while every slot is held: retry shortly (a
    slot frees when an adapter completes or another idle model is paged out)."""


class QueueFullError(NoFreeSlotError):
    """Every slot is held and the registration queue is full (HTTP 409, as `NoFreeSlotError`)."""


def transition(method: Callable[Concatenate[AdapterRegistry, P], Changed[R]]
               ) -> Callable[Concatenate[AdapterRegistry, P], R]:
    """A registry method that changes adapters: it answers `Changed(result, names)`; the caller
    gets `result`, and the names are the rows the store writes next (`take_changes`)."""

    @functools.wraps(method)
    def run(registry: AdapterRegistry, /, *args: P.args, **kwargs: P.kwargs) -> R:
        changed = method(registry, *args, **kwargs)
        registry._note(changed.names)
        return changed.result

    return run


@dataclass
class AdapterRegistry:
    n_slots: int
    completed_retention: int = COMPLETED_RETENTION
    batch_retention: int = BATCH_RECORD_RETENTION
    queue_size: int = DEFAULT_QUEUE_SIZE
    """Registrations that may wait for a slot when all are held; 0: none (NoFreeSlotError)."""
    _live: dict[str, Record] = field(default_factory=dict, init=False)
    _finished: OrderedDict[str, Record] = field(default_factory=OrderedDict, init=False)
    """Terminal records (COMPLETED and FAILED), least recently used first; at most
    `completed_retention` of them."""
    _queue: list[Queued] = field(default_factory=list, init=False)
    """QUEUED registrations, head first: higher priority first, equal ones in arrival order."""
    _free_slots: set[int] = field(init=False)
    _slot_versions: list[int] = field(init=False)
    _batches: OrderedDict[int, BatchRecord] = field(default_factory=OrderedDict, init=False)
    _json_cache: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict, init=False)
    _listing: StatusListing = field(default_factory=StatusListing, init=False)
    _changes: set[str] = field(default_factory=set, init=False)
    """Names whose stored row changed since `take_changes`: those each transition answered
    with (a field of the record, its place, or it was forgotten), and finished ones read (so
    kept longer)."""

    def __post_init__(self) -> None:
        if self.n_slots <= 0:
            raise ValueError(f"n_slots must be > 0 (--multi-lora-n-adapters), got {self.n_slots}")
        if self.queue_size < 0:
            raise ValueError(f"queue_size must be >= 0 (--multi-lora-queue-size; 0 turns the queue off), "
                             f"got {self.queue_size}")
        self._free_slots = set(range(self.n_slots))
        self._slot_versions = [0] * self.n_slots

    def _note(self, names: Iterable[str]) -> None:
        """The rows of `names` changed: the store writes them next, and each record's revision
        (what its cached stored form and status text are checked against) counts the change."""
        for name in names:
            self._changes.add(name)
            record = self._live.get(name) or self._finished.get(name)
            if record is not None:
                record.revision += 1

    # ---- registration ------------------------------------------------------------

    @transition
    def register(self, name: str, config: AnyAdapterConfig, priority: int = 0) -> Changed[int | None]:
        """Give a new adapter (either kind) the lowest free slot in PENDING; returns the slot.

        With every slot held, a server-driven adapter is QUEUED instead (returns None): behind
        the queued ones of its priority or higher, ahead of lower ones. `free_slot` promotes it.
        """
        self.check_can_register(name, config)
        self._finished.pop(name, None)  # a COMPLETED or FAILED run of the name is replaced
        registration_id = uuid.uuid4().hex
        if self._free_slots and not self._queue:
            slot = self._take_slot(name, config, registration_id, priority)
            logger.info("Adapter '%s' registered in slot %d", name, slot)
            return Changed(slot, {name})
        assert isinstance(config, AdapterRunConfig)  # check_can_register refuses to queue a client-driven one
        entry = Queued(name, config, registration_id, priority)
        index = next((i for i, q in enumerate(self._queue) if q.priority < priority), len(self._queue))
        self._queue.insert(index, entry)
        logger.info("Adapter '%s' queued at position %d of %d (priority %d): all %d slots are held",
                    name, index + 1, len(self._queue), priority, self.n_slots)
        return Changed(None, {name})

    def _take_slot(self, name: str, config: AnyAdapterConfig, registration_id: str, priority: int) -> int:
        slot = min(self._free_slots)
        self._free_slots.remove(slot)
        self._live[name] = Record(name=name, config=config, slot=slot, registration_id=registration_id,
                                  priority=priority)
        return slot

    def _promote(self) -> list[str]:
        """QUEUED → PENDING for the head of the queue while a slot is free (lowest slot first);
        returns the names promoted (each a new live row)."""
        promoted = []
        while self._free_slots and self._queue:
            head = self._queue.pop(0)
            slot = self._take_slot(head.name, head.config, head.registration_id, head.priority)
            logger.info("Adapter '%s' left the registration queue for slot %d: PENDING (%d still queued)",
                        head.name, slot, len(self._queue))
            promoted.append(head.name)
        return promoted

    def check_can_register(self, name: str, config: AnyAdapterConfig) -> None:
        """Raise what `register` would raise now (bad or taken name, shared save directory, no
        free slot and no room in the queue); lets callers fail fast before slow checks."""
        try:
            validate_adapter_name(name)
        except AdapterConfigError as exc:
            raise AdapterValidationError(str(exc)) from None
        self._check_name_free(name)
        self._check_save_free(name, config)
        if self._free_slots and not self._queue:
            return
        if isinstance(config, ClientModelConfig):
            raise NoFreeSlotError(
                f"No free slot for client-driven adapter '{name}': all {self.n_slots} slots are in use "
                f"({len(self._queue)} registrations queued) and client models are not queued; retry after an "
                "adapter completes (delete one, or unload a model) or raise --multi-lora-n-adapters"
            )
        if self.queue_size == 0:
            raise NoFreeSlotError(
                f"No free slot for adapter '{name}': all {self.n_slots} slots are in use; "
                "retry after an adapter completes, raise --multi-lora-n-adapters, or let registrations wait "
                "with --multi-lora-queue-size"
            )
        if len(self._queue) >= self.queue_size:
            raise QueueFullError(
                f"No free slot for adapter '{name}' and the registration queue is full ({len(self._queue)} "
                f"waiting for {self.n_slots} slots); retry after queued adapters have started, delete some, "
                "or raise --multi-lora-queue-size or --multi-lora-n-adapters"
            )

    def _queued(self, name: str) -> tuple[int, Queued] | None:
        """The queue index and entry of a QUEUED registration of `name`, else None."""
        return next(((i, q) for i, q in enumerate(self._queue) if q.name == name), None)

    def _check_name_free(self, name: str) -> None:
        queued = self._queued(name)
        if queued is not None:
            raise AdapterAlreadyRegisteredError(
                f"Adapter '{name}' is already registered (QUEUED, position {queued[0] + 1}); pick another name"
            )
        record = self._live.get(name)
        if record is None:
            return
        if record.state is AdapterState.PAGED:
            raise AdapterAlreadyRegisteredError(f"Adapter '{name}' is already registered (PAGED); pick another name")
        if record.state in (AdapterState.PENDING, AdapterState.ACTIVE):
            raise AdapterAlreadyRegisteredError(
                f"Adapter '{name}' is already registered ({record.state.value}, slot {record.slot}); pick another name"
            )
        raise AdapterConflictError(f"Adapter '{name}' is still cleaning up; retry shortly (state {record.state.value})")

    def _check_save_free(self, name: str, config: AnyAdapterConfig) -> None:
        if config.save is None:
            return
        save = _resolved(str(config.save))
        others: list[tuple[str, str, AnyAdapterConfig]] = [("live", r.name, r.config) for r in self._live.values()]
        others += [("queued", q.name, q.config) for q in self._queue]
        for what, other, other_config in others:
            if other_config.save is not None and _resolved(str(other_config.save)) == save:
                raise AdapterValidationError(
                    f"Adapter '{name}': save directory {save} is already used by {what} adapter "
                    f"'{other}'; set a different 'save'"
                )

    @transition
    def deregister(self, name: str) -> Changed[AdapterState | None]:
        """PENDING/ACTIVE → RETIRING; a no-op in other states. Returns the state after.

        A QUEUED one is taken out of the queue and forgotten (None): it never held a slot, so
        nothing was trained or saved, no slot changes, and the name is free at once."""
        queued = self._queued(name)
        if queued is not None:
            del self._queue[queued[0]]
            logger.info("Adapter '%s' deregistered while QUEUED: removed from the queue", name)
            return Changed(None, {name})
        record = self._record(name)
        if record.state in (AdapterState.PENDING, AdapterState.ACTIVE):
            record.state = AdapterState.RETIRING
            logger.info("Adapter '%s' deregistered: RETIRING", name)
            return Changed(record.state, {name})
        if record.state is AdapterState.PAGED:  # no slot and nothing loaded: nothing to clean up
            changed = self._finish(record, AdapterState.COMPLETED)
            logger.info("Adapter '%s' deregistered while PAGED: COMPLETED at step %d", name, record.step)
            return Changed(record.state, changed)
        return Changed(record.state)

    @transition
    def retire_adapters(self) -> Changed[list[str]]:
        """RETIRING → CLEANUP for every retiring adapter; returns their names (sorted)."""
        names = sorted(n for n, r in self._live.items() if r.state is AdapterState.RETIRING)
        for name in names:
            self._live[name].state = AdapterState.CLEANUP
        return Changed(names, names)

    @transition
    def fail(self, name: str, registration_id: str, failure: AdapterFailure) -> Changed[bool]:
        """ACTIVE/RETIRING → CLEANUP with `failure` kept: the producer gave up on the adapter.

        It leaves as a retired adapter does (its requests aborted by the caller, the trainer
        saves it and frees the slot), and `free_slot` ends it FAILED instead of COMPLETED. False,
        and nothing changes, unless `name` is that live registration of a server-driven
        adapter in ACTIVE or RETIRING (a PENDING one was never sampled; one in CLEANUP is
        leaving already; a stale report about a previous registration is ignored).
        """
        record = self._live.get(name)
        if (record is None or record.registration_id != registration_id or record.kind is not AdapterKind.SERVER
                or record.state not in (AdapterState.ACTIVE, AdapterState.RETIRING)):
            return Changed(False)
        record.state = AdapterState.CLEANUP
        record.failure = failure
        # The producer has logged why (its one line per failure episode); this is the transition.
        logger.info("Adapter '%s' failed (%s): CLEANUP, then FAILED once the trainer saved it and freed its slot",
                    name, failure.summary())
        return Changed(True, {name})

    @transition
    def free_slot(self, name: str) -> Changed[int]:
        """CLEANUP → COMPLETED (FAILED if `fail` sent it there); returns the freed slot, or -1
        if not in CLEANUP. The head of the queue, if any, takes the slot (PENDING) in the same
        change, so the trainer's next reconcile loads it."""
        record = self._live.get(name)
        if record is None or record.state is not AdapterState.CLEANUP:
            return Changed(-1)
        changed = self._finish(record, AdapterState.COMPLETED if record.failure is None else AdapterState.FAILED)
        self._free_slots.add(record.slot)
        logger.info("Adapter '%s' %s at step %d; slot %d freed", name, record.state.value.lower(), record.step,
                    record.slot)
        return Changed(record.slot, changed | set(self._promote()))

    def _finish(self, record: Record, state: AdapterState) -> set[str]:
        """Live → `state` (terminal), kept among the finished ones; returns the names whose rows
        changed: it, and those dropped past the retention."""
        del self._live[record.name]
        record.state = state
        self._finished[record.name] = record
        changed = {record.name}
        while len(self._finished) > self.completed_retention:
            changed.add(self._finished.popitem(last=False)[0])
        return changed

    # ---- paging idle client-driven adapters ---------------------------------------

    @transition
    def page_out(self, name: str, directory: str) -> Changed[int]:
        """ACTIVE → PAGED for a client-driven adapter whose whole state the trainer has written
        to `directory` and taken out of its slot: `directory` becomes its resume point and the
        slot is freed (the head of the registration queue takes it). Returns the slot, or -1
        (nothing changes) unless it is a live, ACTIVE client-driven adapter."""
        record = self._live.get(name)
        if record is None or record.kind is not AdapterKind.CLIENT or record.state is not AdapterState.ACTIVE:
            return Changed(-1)
        record.state = AdapterState.PAGED
        record.resume_from, record.resume_step = directory, record.step
        self._free_slots.add(record.slot)
        logger.info("Client model '%s' paged out at step %d to %s; slot %d freed", name, record.step, directory,
                    record.slot)
        return Changed(record.slot, {name, *self._promote()})

    @transition
    def page_in(self, name: str) -> Changed[int]:
        """PAGED → PENDING in the lowest free slot (the trainer loads it from its resume point,
        the directory it was paged out to); returns the slot. `NoSlotToPageInError` when every
        slot is held or a registration is queued for the next free one."""
        record = self._live.get(name)
        if record is None or record.state is not AdapterState.PAGED:
            raise AdapterValidationError(f"Adapter '{name}' is not PAGED (state "
                                         f"{'unknown' if record is None else record.state.value})")
        if not self._free_slots or self._queue:
            raise NoSlotToPageInError(
                f"Client model '{name}' was paged out while idle and no slot is free to page it back in "
                f"(all {self.n_slots} slots held, {len(self._queue)} registrations queued); retry shortly, "
                "or raise --multi-lora-n-adapters")
        record.slot = min(self._free_slots)
        self._free_slots.remove(record.slot)
        record.state = AdapterState.PENDING
        logger.info("Client model '%s' paged in to slot %d (from %s)", name, record.slot, record.resume_from)
        return Changed(record.slot, {name})

    @property
    def paged_count(self) -> int:
        return sum(1 for r in self._live.values() if r.state is AdapterState.PAGED)

    # ---- weights and batches -----------------------------------------------------

    @transition
    def begin_weight_update(self, names: list[str]) -> Changed[dict[str, int]]:
        """Before a push: the version each adapter's push will become (its slot's next one).

        The engines go on serving the current version until `record_weight_update`; in the
        meantime snapshots show the coming one as `pushing_version` (the weights the trainer
        has sent), against which staleness counts. Names without a slot are skipped.
        """
        versions: dict[str, int] = {}
        for name in names:
            record = self._live.get(name)
            if record is None:
                logger.warning("Weight push begun for adapter '%s', which holds no slot; ignored", name)
                continue
            record.pushing_version = versions[name] = next_slot_version(self._slot_versions[record.slot])
        return Changed(versions, versions)

    @transition
    def record_weight_update(self, names: list[str]) -> Changed[dict[str, int]]:
        """After a successful push: bump each slot's version, PENDING → ACTIVE.

        Returns the new version of each adapter; names without a slot are skipped.
        """
        versions: dict[str, int] = {}
        for name in names:
            record = self._live.get(name)
            if record is None:
                logger.warning("Weight update recorded for adapter '%s', which holds no slot; ignored", name)
                continue
            self._slot_versions[record.slot] = next_slot_version(self._slot_versions[record.slot])
            versions[name] = self._slot_versions[record.slot]
            if record.pushing_version not in (None, versions[name]):
                logger.warning("Adapter '%s' was pushed as version %d but its slot is now at version %d",
                               name, record.pushing_version, versions[name])
            record.pushing_version = None
            if record.state is AdapterState.PENDING:
                record.state = AdapterState.ACTIVE
            record.pushed = True
        return Changed(versions, versions)

    @transition
    def requeue_for_new_trainer(self) -> Changed[list[str]]:
        """ACTIVE → PENDING for a trainer that starts over a restored registry, and the
        adapters the previous trainer left RETIRING or CLEANUP → COMPLETED, their slots free.

        Its engines hold no adapter yet, so nothing may be sampled before the trainer has
        loaded (resumed) and pushed it; the next push makes it ACTIVE again. Steps, slots,
        versions, registration ids and `start_step` are kept. A retiring adapter is never
        loaded by a new trainer (its first reconcile retires it before loading), so there is
        nothing to save or clean up: that reconcile would only free the slot, once the
        engines are up, and until then a registration or a Tinker `create_model` would find
        the slot taken (a model unloaded just before the previous trainer stopped holds it).
        A slot freed so goes to the head of the registration queue (PENDING); the others stay
        QUEUED in their order. Returns the names requeued.
        """
        self.retire_adapters()
        for name in sorted(n for n, r in self._live.items() if r.state is AdapterState.CLEANUP):
            self.free_slot(name)
        requeued = []
        for record in self._live.values():
            if record.state is AdapterState.ACTIVE:
                record.state = AdapterState.PENDING
                requeued.append(record.name)
        if requeued:
            logger.info("Restored adapters wait for this trainer's first push: %s", ", ".join(sorted(requeued)))
        return Changed(sorted(requeued), requeued)

    @transition
    def record_batch_adapters(self, rollout_id: int, groups: dict[str, int], step_names: list[str]) -> Changed[None]:
        """Remember what a batch holds; nothing advances until `mark_batch_trained` (no record
        changes: the recorded batches are stored whole)."""
        extra = set(step_names) - set(groups)
        if extra:
            raise ValueError(f"rollout {rollout_id}: step_names {sorted(extra)} are not in the batch's groups")
        if any(n < 0 for n in groups.values()):
            raise ValueError(f"rollout {rollout_id}: group counts must be >= 0, got {groups}")
        registrations = {n: self._live[n].registration_id for n in groups if n in self._live}
        self._batches.pop(rollout_id, None)
        self._batches[rollout_id] = BatchRecord(dict(groups), frozenset(step_names), registrations)
        while len(self._batches) > self.batch_retention:
            self._batches.popitem(last=False)
        return Changed(None)

    @transition
    def mark_batch_trained(self, rollout_id: int) -> Changed[list[str]]:
        """Commit a trained batch: add its groups, step the adapters that completed a
        batch, retire ACTIVE adapters that reached `num_step`. Returns the stepped names."""
        batch = self._batches.pop(rollout_id, None)
        if batch is None:
            logger.warning("mark_batch_trained(%d): no batch recorded for this rollout; nothing to commit", rollout_id)
            return Changed([])
        stepped, changed = [], []
        for name, n_groups in sorted(batch.groups.items()):
            record = self._live.get(name)
            if record is None or record.registration_id != batch.registrations.get(name):
                continue
            if record.kind is AdapterKind.CLIENT:
                logger.warning("Batch %d names client-driven adapter '%s'; its client steps it, not batches",
                               rollout_id, name)
                continue
            if record.state not in (AdapterState.ACTIVE, AdapterState.RETIRING, AdapterState.CLEANUP):
                continue
            record.accumulated_groups += n_groups
            changed.append(name)
            if name in batch.step_names:
                self._step(record)
                stepped.append(name)
        return Changed(stepped, changed)

    def _step(self, record: Record) -> None:
        assert isinstance(record.config, AdapterRunConfig)  # mark_batch_trained skips client-driven ones
        if record.accumulated_groups != record.config.rollout_batch_size:
            logger.warning("Adapter '%s' stepped with %d accumulated groups, expected rollout_batch_size=%s",
                           record.name, record.accumulated_groups, record.config.rollout_batch_size)
        record.step += 1
        record.accumulated_groups = 0
        num_step = record.config.num_step
        if record.state is AdapterState.ACTIVE and num_step is not None and record.step - record.start_step >= num_step:
            record.state = AdapterState.RETIRING
            logger.info("Adapter '%s' reached num_step=%d (step %d): RETIRING", record.name, num_step, record.step)

    @transition
    def record_client_step(self, name: str, registration_id: str | None = None) -> Changed[int | None]:
        """A client-driven adapter's `optim_step` ran: step + 1. Returns the new step, or None
        when the adapter is not that live client-driven registration any more (a stale report)."""
        record = self._live.get(name)
        if record is None or record.kind is not AdapterKind.CLIENT:
            return Changed(None)
        if registration_id is not None and record.registration_id != registration_id:
            return Changed(None)
        record.step += 1
        return Changed(record.step, {name})

    @transition
    def record_client_checkpoint(self, name: str, directory: str) -> Changed[bool]:
        """A live client-driven adapter's state is now `directory` (it saved or loaded it): the
        point a restarted trainer resumes it from. False if it is not a live client-driven one."""
        record = self._live.get(name)
        if record is None or record.kind is not AdapterKind.CLIENT:
            return Changed(False)
        record.resume_from, record.resume_step = directory, record.step
        return Changed(True, {name})

    @transition
    def activate_clients(self, names: list[str]) -> Changed[list[str]]:
        """PENDING -> ACTIVE for client-driven adapters the trainer has loaded (no engine push
        makes them ACTIVE: nothing samples from their slot). Returns the names activated."""
        activated = []
        for name in names:
            record = self._live.get(name)
            if record is not None and record.kind is AdapterKind.CLIENT and record.state is AdapterState.PENDING:
                record.state = AdapterState.ACTIVE
                activated.append(name)
        return Changed(activated, activated)

    @transition
    def set_step(self, name: str, step: int, accumulated_groups: int = 0) -> Changed[None]:
        """Resume: the adapter continues at `step` (its checkpoint's step), with the
        `accumulated_groups` toward the next step whose gradient the checkpoint held.

        Before its first push (PENDING) `num_step` counts from here. Later (a trainer
        that restarted reloads a live adapter from its checkpoint) the start stays where
        the registration began, and the groups accumulated since that checkpoint are dropped.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        record = self._record(name)
        window = (resolved_field(record.config.rollout_batch_size, "rollout_batch_size")
                  if isinstance(record.config, AdapterRunConfig) else 1)  # a client-driven one accumulates nothing
        if not 0 <= accumulated_groups < window:
            raise ValueError(f"adapter '{name}': accumulated groups must be in 0..{window - 1} "
                             f"(rollout_batch_size - 1), got {accumulated_groups}")
        record.step = step
        record.accumulated_groups = accumulated_groups
        if record.state is AdapterState.PENDING and not record.pushed:
            record.start_step = step
        return Changed(None, {record.name})

    # ---- reads ------------------------------------------------------------------

    def _record(self, name: str) -> Record:
        record = self._live.get(name)
        if record is not None:
            return record
        record = self._finished.get(name)
        if record is None:
            raise AdapterNotFoundError(f"Adapter '{name}' not registered")
        if next(reversed(self._finished)) != name:  # reading a finished record keeps it longer
            self._finished.move_to_end(name)
            self._changes.add(name)
        return record

    def state(self, name: str) -> AdapterState | None:
        if self._queued(name) is not None:
            return AdapterState.QUEUED
        try:
            return self._record(name).state
        except AdapterNotFoundError:
            return None

    def step(self, name: str) -> int:
        return 0 if self._queued(name) is not None else self._record(name).step

    def status(self, name: str) -> AdapterStatus:
        queued = self._queued(name)
        if queued is not None:
            return queued_status(*queued)
        return record_status(self._record(name), self._slot_versions)

    def statuses(self, offset: int = 0, limit: int | None = None) -> list[AdapterStatus]:
        """Every known adapter: live ones first (by slot), then QUEUED ones (head first), then
        finished (COMPLETED, FAILED) ones, least recently read first; with `offset` and `limit`,
        that list's page (only its statuses are built: a page costs the same whatever the
        registry holds)."""
        return self._listing.statuses(self._listed(), offset, limit)

    def status_texts(self, offset: int = 0, limit: int | None = None) -> list[str]:
        """`statuses(offset, limit)` as JSON texts, built once per change of an adapter's status
        (`StatusListing.texts`)."""
        return self._listing.texts(self._listed(), offset, limit, self.record_count, self._known_names)

    def _listed(self) -> Iterable[Listed]:
        return listed(self._live.values(), self._queue, self._finished.values(), self._slot_versions)

    def _known_names(self) -> set[str]:
        return self._live.keys() | self._finished.keys() | {q.name for q in self._queue}

    @property
    def record_count(self) -> int:
        """The adapters `statuses()` lists: live, QUEUED and kept finished ones."""
        return len(self._live) + len(self._queue) + len(self._finished)

    def state_counts(self) -> dict[AdapterState, int]:
        """How many adapters of each state the registry holds (every state, 0 where none)."""
        counts = dict.fromkeys(AdapterState, 0)
        for record in itertools.chain(self._live.values(), self._finished.values()):
            counts[record.state] += 1
        counts[AdapterState.QUEUED] += len(self._queue)
        return counts

    def slot_statuses(self) -> list[AdapterStatus]:
        """The statuses of the adapters holding a slot, by slot (at most `n_slots`)."""
        holding = sorted((r for r in self._live.values() if r.state.holds_slot), key=lambda r: r.slot)
        return [record_status(r, self._slot_versions) for r in holding]

    def queue_position(self, name: str) -> int | None:
        """1 for the head of the registration queue; None unless `name` is QUEUED."""
        queued = self._queued(name)
        return None if queued is None else queued[0] + 1

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def snapshot(self) -> MultiLoRASnapshot:
        views: dict[AdapterState, dict[str, AdapterRun]] = {s: {} for s in AdapterState}
        clients: dict[str, ClientAdapterRun] = {}
        cleanup = {r.name for r in self._live.values() if r.state is AdapterState.CLEANUP}
        for record in self._live.values():
            if isinstance(record.config, ClientModelConfig):
                if record.state.holds_slot and record.state is not AdapterState.CLEANUP:
                    clients[record.name] = ClientAdapterRun(
                        name=record.name, config=record.config, state=record.state, slot=record.slot,
                        version=self._slot_versions[record.slot], step=record.step,
                        registration_id=record.registration_id, resume_from=record.resume_from,
                        resume_step=record.resume_step)
                continue
            views[record.state][record.name] = AdapterRun(
                name=record.name, config=record.config, slot=record.slot,
                version=self._slot_versions[record.slot], step=record.step,
                accumulated_groups=record.accumulated_groups, registration_id=record.registration_id,
                start_step=record.start_step, pushed=record.pushed, pushing_version=record.pushing_version,
            )
        return MultiLoRASnapshot(
            pending=views[AdapterState.PENDING], active=views[AdapterState.ACTIVE],
            retiring=views[AdapterState.RETIRING], cleanup=frozenset(cleanup),
            completed=frozenset(n for n, r in self._finished.items() if r.state is AdapterState.COMPLETED),
            failed=frozenset(n for n, r in self._finished.items() if r.state is AdapterState.FAILED),
            clients=clients, queued=tuple(q.name for q in self._queue),
        )

    # ---- persistence (the store does the I/O; these only convert) ---------------------

    def export_state(self) -> RegistryState:
        """Everything needed to rebuild this registry, as JSON-ready values."""
        live = [self._json(r) for r in sorted(self._live.values(), key=lambda r: r.slot)]
        finished = [self._json(r) for r in self._finished.values()]
        if len(self._json_cache) > len(self._live) + len(self._finished):
            known = self._live.keys() | self._finished.keys()
            self._json_cache = {n: v for n, v in self._json_cache.items() if n in known}
        return RegistryState(
            n_slots=self.n_slots, slot_versions=list(self._slot_versions), live=live, finished=finished,
            batches=[(rollout_id, batch_to_json(b)) for rollout_id, b in self._batches.items()],
            queued=[q.as_json for q in self._queue],
        )

    def take_changes(self) -> RegistryChanges | None:
        """What changed since the last call (or since this registry was built): the rows a
        store must write to hold `export_state()`, without going over every record. None when
        a finished record changed in place rather than at the end of the retention order (the
        store then writes the whole state)."""
        changed = set(self._changes)
        self._changes.clear()
        finished = [name for name in changed if name in self._finished]
        tail = list(itertools.islice(reversed(self._finished), len(finished)))[::-1]
        if set(tail) != set(finished):
            return None
        queued = [q.as_json for q in self._queue]
        queued_names = {q["name"] for q in queued}
        removed = sorted(n for n in changed
                         if n not in self._live and n not in self._finished and n not in queued_names)
        return RegistryChanges(
            n_slots=self.n_slots, slot_versions=list(self._slot_versions),
            live=[self._json(self._live[name]) for name in changed if name in self._live],
            finished=[self._json(self._finished[name]) for name in tail],
            removed=removed, queued=queued,
            batches=[(rollout_id, batch_to_json(b)) for rollout_id, b in self._batches.items()],
        )

    def _json(self, record: Record) -> dict[str, Any]:
        """A record as JSON values; the same object while the record is unchanged, so the
        store can tell unchanged rows apart cheaply (a registry keeps ~1,000 records)."""
        key = (record.registration_id, record.revision)  # any field's change is a new revision
        cached = self._json_cache.get(record.name)
        if cached is None or cached[0] != key:
            cached = (key, record_to_json(record))
            self._json_cache[record.name] = cached
        return cached[1]

    @classmethod
    def from_state(cls, state: RegistryState, n_slots: int, **kwargs: Any) -> AdapterRegistry:
        """A registry holding what `state` recorded, with `n_slots` slots (the table may grow,
        but never drop a slot a live adapter holds). Queued registrations stay QUEUED in their
        order, all of them even beyond `queue_size`; slots a larger table adds go to them."""
        registry = cls(n_slots, **kwargs)
        live = [record_from_json(r) for r in state.live]
        holding = [r for r in live if r.state.holds_slot]
        too_high = sorted(r.name for r in holding if r.slot >= n_slots)
        if too_high:
            raise ValueError(
                f"The saved registry has adapters {too_high} in slots beyond --multi-lora-n-adapters={n_slots}; "
                f"start with at least {max(r.slot for r in holding) + 1} slots"
            )
        for index, version in enumerate(state.slot_versions[:n_slots]):
            registry._slot_versions[index] = version
        for record in live:
            registry._live[record.name] = record
            if record.state.holds_slot:
                registry._free_slots.discard(record.slot)
        for raw in state.finished:
            record = record_from_json(raw)
            registry._finished[record.name] = record
        for rollout_id, raw in state.batches:
            registry._batches[rollout_id] = batch_from_json(raw)
        registry._queue = [queued_from_json(raw) for raw in state.queued]
        registry._changes.update(registry._live.keys() | registry._finished.keys())
        if len(registry._queue) > registry.queue_size:
            logger.warning("The saved registry has %d queued registrations, over --multi-lora-queue-size=%d: "
                           "all are kept, and new ones are refused until the queue is shorter",
                           len(registry._queue), registry.queue_size)
        registry._changes.update(registry._promote())
        return registry

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free_slots)

    @property
    def slot_versions(self) -> list[int]:
        return list(self._slot_versions)

    def live_slots(self) -> dict[str, int]:
        return {name: record.slot for name, record in self._live.items() if record.state.holds_slot}

    def kind(self, name: str) -> AdapterKind | None:
        if self._queued(name) is not None:
            return AdapterKind.SERVER  # client-driven adapters are never queued
        try:
            return self._record(name).kind
        except AdapterNotFoundError:
            return None

    def client_config(self, name: str) -> ClientModelConfig | None:
        """The model config of a known client-driven adapter (live or finished), else None."""
        record = self._live.get(name) or self._finished.get(name)
        return record.config if record is not None and isinstance(record.config, ClientModelConfig) else None

    def registration_id(self, name: str) -> str | None:
        record = self._live.get(name)
        return None if record is None else record.registration_id
