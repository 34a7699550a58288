"""The adapter lifecycle state machine (DESIGN §2): plain Python, no Ray, no HTTP.

`AdapterRegistry` owns the slots of the LoRA page table, the adapters' states and their
batch accounting. The controller actor and the HTTP server only delegate to it, so every
rule here is testable alone:

    registry = AdapterRegistry(n_slots=4)
    slot = registry.register("math", resolved_config)     # PENDING, lowest free slot
    registry.begin_weight_update(["math"])                # the push will be slot version + 1
    registry.record_weight_update(["math"])               # pushed: ACTIVE at that version
    registry.record_batch_adapters(0, {"math": 8}, ["math"])
    registry.mark_batch_trained(0)                        # step 1
    registry.deregister("math"); registry.retire_adapters(); registry.free_slot("math")  # COMPLETED

An adapter whose plug-ins fail group after group leaves the same way, and ends FAILED:

    registry.fail("math", registration_id, AdapterFailure(...))   # ACTIVE/RETIRING -> CLEANUP
    registry.free_slot("math")                                      # CLEANUP -> FAILED, last error kept

A client-driven adapter (a Tinker model, DESIGN §11) takes a `ClientModelConfig` instead:
the same slots, names and lifecycle, but no batches and no `num_step` (it never retires by
itself); its step advances with `record_client_step` when its client's `optim_step` ran.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.utils.adapter_config import AdapterConfigError, AdapterRunConfig, resolved_field, validate_adapter_name
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
    """Every slot is held; retry after an adapter completes (HTTP 409). A `RuntimeError`, as
    in Miles, whose callers catch it as one."""


AnyAdapterConfig = AdapterRunConfig | ClientModelConfig
"""A server-driven adapter's run config, or a client-driven one's model config."""


def adapter_kind(config: AnyAdapterConfig) -> AdapterKind:
    return AdapterKind.CLIENT if isinstance(config, ClientModelConfig) else AdapterKind.SERVER


@dataclass
class _Record:
    name: str
    config: AnyAdapterConfig
    slot: int
    registration_id: str
    state: AdapterState = AdapterState.PENDING
    step: int = 0
    start_step: int = 0
    """Step the adapter (re)started at; `num_step` counts from here."""
    accumulated_groups: int = 0
    pushed: bool = False
    """Its weights were pushed at least once (its `start_step` is fixed from then on)."""
    pushing_version: int | None = None
    """The version of a push under way (`begin_weight_update`), until it is recorded; not
    persisted: a restarted trainer pushes every adapter again."""
    resume_from: str | None = None
    """Client-driven only: the directory of its latest completed save_state (or load_state),
    which a trainer that restarts over the registry loads it from."""
    resume_step: int = 0
    """Client-driven only: its step when `resume_from` was saved or loaded (the step a
    restarted trainer resumes it at)."""
    failure: AdapterFailure | None = None
    """Set by `fail`: it leaves through CLEANUP and ends FAILED, with this as its last error."""

    @property
    def kind(self) -> AdapterKind:
        return adapter_kind(self.config)


@dataclass(frozen=True)
class _BatchRecord:
    groups: dict[str, int]
    step_names: frozenset[str]
    registrations: dict[str, str]
    """registration_id of each adapter when recorded; a re-registered name is skipped."""


@dataclass(frozen=True)
class RegistryState:
    """A registry as plain JSON-ready values (what the store writes and reads back)."""

    n_slots: int
    slot_versions: list[int]
    live: list[dict[str, Any]]
    """Live records by slot."""
    finished: list[dict[str, Any]]
    """Terminal (COMPLETED and FAILED) records, least recently used first."""
    batches: list[tuple[int, dict[str, Any]]]
    """Recorded, not yet trained batches, oldest first."""


def _record_to_json(record: _Record) -> dict[str, Any]:
    return {
        "name": record.name, "kind": record.kind.value, "config": record.config.model_dump(mode="json"),
        "slot": record.slot,
        "registration_id": record.registration_id, "state": record.state.value, "step": record.step,
        "start_step": record.start_step, "accumulated_groups": record.accumulated_groups,
        "pushed": record.pushed, "resume_from": record.resume_from, "resume_step": record.resume_step,
        "failure": None if record.failure is None else record.failure.model_dump(mode="json"),
    }


def _record_from_json(raw: dict[str, Any]) -> _Record:
    config_cls = ClientModelConfig if raw.get("kind") == AdapterKind.CLIENT.value else AdapterRunConfig
    return _Record(
        name=raw["name"], config=config_cls.model_validate_json(json.dumps(raw["config"])),
        slot=raw["slot"], registration_id=raw["registration_id"], state=AdapterState(raw["state"]),
        step=raw["step"], start_step=raw["start_step"], accumulated_groups=raw["accumulated_groups"],
        pushed=raw.get("pushed", raw["state"] != AdapterState.PENDING.value), resume_from=raw.get("resume_from"),
        resume_step=raw.get("resume_step", 0),
        failure=None if raw.get("failure") is None else AdapterFailure.model_validate(raw["failure"]),
    )


def _batch_to_json(batch: _BatchRecord) -> dict[str, Any]:
    return {"groups": batch.groups, "step_names": sorted(batch.step_names), "registrations": batch.registrations}


def _batch_from_json(raw: dict[str, Any]) -> _BatchRecord:
    return _BatchRecord(dict(raw["groups"]), frozenset(raw["step_names"]), dict(raw["registrations"]))


@dataclass
class AdapterRegistry:
    n_slots: int
    completed_retention: int = COMPLETED_RETENTION
    batch_retention: int = BATCH_RECORD_RETENTION
    _live: dict[str, _Record] = field(default_factory=dict, init=False)
    _finished: OrderedDict[str, _Record] = field(default_factory=OrderedDict, init=False)
    """Terminal records (COMPLETED and FAILED), least recently used first; at most
    `completed_retention` of them."""
    _free_slots: set[int] = field(init=False)
    _slot_versions: list[int] = field(init=False)
    _batches: OrderedDict[int, _BatchRecord] = field(default_factory=OrderedDict, init=False)
    _json_cache: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.n_slots <= 0:
            raise ValueError(f"n_slots must be > 0 (--multi-lora-n-adapters), got {self.n_slots}")
        self._free_slots = set(range(self.n_slots))
        self._slot_versions = [0] * self.n_slots

    # ---- registration ------------------------------------------------------------

    def register(self, name: str, config: AnyAdapterConfig) -> int:
        """Give a new adapter (either kind) the lowest free slot in PENDING; returns the slot."""
        self.check_can_register(name, config)
        slot = min(self._free_slots)
        self._free_slots.remove(slot)
        self._finished.pop(name, None)
        self._live[name] = _Record(name=name, config=config, slot=slot, registration_id=uuid.uuid4().hex)
        logger.info("Adapter '%s' registered in slot %d", name, slot)
        return slot

    def check_can_register(self, name: str, config: AnyAdapterConfig) -> None:
        """Raise what `register` would raise now (bad or taken name, shared save
        directory, no free slot); lets callers fail fast before slow checks."""
        try:
            validate_adapter_name(name)
        except AdapterConfigError as exc:
            raise AdapterValidationError(str(exc)) from None
        self._check_name_free(name)
        self._check_save_free(name, config)
        if not self._free_slots:
            raise NoFreeSlotError(
                f"No free slot for adapter '{name}': all {self.n_slots} slots are in use; "
                "retry after an adapter completes or raise --multi-lora-n-adapters"
            )

    def _check_name_free(self, name: str) -> None:
        record = self._live.get(name)
        if record is None:
            return
        if record.state in (AdapterState.PENDING, AdapterState.ACTIVE):
            raise AdapterAlreadyRegisteredError(
                f"Adapter '{name}' is already registered ({record.state.value}, slot {record.slot}); pick another name"
            )
        raise AdapterConflictError(f"Adapter '{name}' is still cleaning up; retry shortly (state {record.state.value})")

    def _check_save_free(self, name: str, config: AnyAdapterConfig) -> None:
        if config.save is None:
            return
        save = Path(config.save).resolve()
        for other in self._live.values():
            if other.config.save is not None and Path(other.config.save).resolve() == save:
                raise AdapterValidationError(
                    f"Adapter '{name}': save directory {save} is already used by live adapter "
                    f"'{other.name}'; set a different 'save'"
                )

    def deregister(self, name: str) -> AdapterState:
        """PENDING/ACTIVE → RETIRING; a no-op in other states. Returns the state after."""
        record = self._record(name)
        if record.state in (AdapterState.PENDING, AdapterState.ACTIVE):
            record.state = AdapterState.RETIRING
            logger.info("Adapter '%s' deregistered: RETIRING", name)
        return record.state

    def retire_adapters(self) -> list[str]:
        """RETIRING → CLEANUP for every retiring adapter; returns their names (sorted)."""
        names = sorted(n for n, r in self._live.items() if r.state is AdapterState.RETIRING)
        for name in names:
            self._live[name].state = AdapterState.CLEANUP
        return names

    def fail(self, name: str, registration_id: str, failure: AdapterFailure) -> bool:
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
            return False
        record.state = AdapterState.CLEANUP
        record.failure = failure
        return True

    def free_slot(self, name: str) -> int:
        """CLEANUP → COMPLETED (FAILED if `fail` sent it there); returns the freed slot, or -1
        if not in CLEANUP."""
        record = self._live.get(name)
        if record is None or record.state is not AdapterState.CLEANUP:
            return -1
        del self._live[name]
        record.state = AdapterState.COMPLETED if record.failure is None else AdapterState.FAILED
        self._free_slots.add(record.slot)
        self._finished[name] = record
        while len(self._finished) > self.completed_retention:
            self._finished.popitem(last=False)
        logger.info("Adapter '%s' %s at step %d; slot %d freed", name, record.state.value.lower(), record.step,
                    record.slot)
        return record.slot

    # ---- weights and batches -----------------------------------------------------

    def begin_weight_update(self, names: list[str]) -> dict[str, int]:
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
        return versions

    def record_weight_update(self, names: list[str]) -> dict[str, int]:
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
        return versions

    def requeue_for_new_trainer(self) -> list[str]:
        """ACTIVE → PENDING for a trainer that starts over a restored registry, and the
        adapters the previous trainer left RETIRING or CLEANUP → COMPLETED, their slots free.

        Its engines hold no adapter yet, so nothing may be sampled before the trainer has
        loaded (resumed) and pushed it; the next push makes it ACTIVE again. Steps, slots,
        versions, registration ids and `start_step` are kept. A retiring adapter is never
        loaded by a new trainer (its first reconcile retires it before loading), so there is
        nothing to save or clean up: that reconcile would only free the slot, once the
        engines are up, and until then a registration or a Tinker `create_model` would find
        the slot taken (a model unloaded just before the previous trainer stopped holds it).
        Returns the names requeued.
        """
        self.retire_adapters()
        for name in sorted(n for n, r in self._live.items() if r.state is AdapterState.CLEANUP):
            self.free_slot(name)
        requeued = []
        for record in self._live.values():
            if record.state is AdapterState.ACTIVE:
                record.state = AdapterState.PENDING
                requeued.append(record.name)
        return sorted(requeued)

    def record_batch_adapters(self, rollout_id: int, groups: dict[str, int], step_names: list[str]) -> None:
        """Remember what a batch holds; nothing advances until `mark_batch_trained`."""
        extra = set(step_names) - set(groups)
        if extra:
            raise ValueError(f"rollout {rollout_id}: step_names {sorted(extra)} are not in the batch's groups")
        if any(n < 0 for n in groups.values()):
            raise ValueError(f"rollout {rollout_id}: group counts must be >= 0, got {groups}")
        registrations = {n: self._live[n].registration_id for n in groups if n in self._live}
        self._batches.pop(rollout_id, None)
        self._batches[rollout_id] = _BatchRecord(dict(groups), frozenset(step_names), registrations)
        while len(self._batches) > self.batch_retention:
            self._batches.popitem(last=False)

    def mark_batch_trained(self, rollout_id: int) -> list[str]:
        """Commit a trained batch: add its groups, step the adapters that completed a
        batch, retire ACTIVE adapters that reached `num_step`. Returns the stepped names."""
        batch = self._batches.pop(rollout_id, None)
        if batch is None:
            logger.warning("mark_batch_trained(%d): no batch recorded for this rollout; nothing to commit", rollout_id)
            return []
        stepped = []
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
            if name in batch.step_names:
                self._step(record)
                stepped.append(name)
        return stepped

    def _step(self, record: _Record) -> None:
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

    def record_client_step(self, name: str, registration_id: str | None = None) -> int | None:
        """A client-driven adapter's `optim_step` ran: step + 1. Returns the new step, or None
        when the adapter is not that live client-driven registration any more (a stale report)."""
        record = self._live.get(name)
        if record is None or record.kind is not AdapterKind.CLIENT:
            return None
        if registration_id is not None and record.registration_id != registration_id:
            return None
        record.step += 1
        return record.step

    def record_client_checkpoint(self, name: str, directory: str) -> bool:
        """A live client-driven adapter's state is now `directory` (it saved or loaded it): the
        point a restarted trainer resumes it from. False if it is not a live client-driven one."""
        record = self._live.get(name)
        if record is None or record.kind is not AdapterKind.CLIENT:
            return False
        record.resume_from, record.resume_step = directory, record.step
        return True

    def activate_clients(self, names: list[str]) -> list[str]:
        """PENDING -> ACTIVE for client-driven adapters the trainer has loaded (no engine push
        makes them ACTIVE: nothing samples from their slot). Returns the names activated."""
        activated = []
        for name in names:
            record = self._live.get(name)
            if record is not None and record.kind is AdapterKind.CLIENT and record.state is AdapterState.PENDING:
                record.state = AdapterState.ACTIVE
                activated.append(name)
        return activated

    def set_step(self, name: str, step: int, accumulated_groups: int = 0) -> None:
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

    # ---- reads ------------------------------------------------------------------

    def _record(self, name: str) -> _Record:
        record = self._live.get(name)
        if record is not None:
            return record
        record = self._finished.get(name)
        if record is None:
            raise AdapterNotFoundError(f"Adapter '{name}' not registered")
        self._finished.move_to_end(name)  # reading a finished record keeps it longer
        return record

    def state(self, name: str) -> AdapterState | None:
        try:
            return self._record(name).state
        except AdapterNotFoundError:
            return None

    def step(self, name: str) -> int:
        return self._record(name).step

    def status(self, name: str) -> AdapterStatus:
        return self._status(self._record(name))

    def statuses(self) -> list[AdapterStatus]:
        """Every known adapter, live ones first (by slot), then finished (COMPLETED, FAILED) ones."""
        live = sorted(self._live.values(), key=lambda r: r.slot)
        return [self._status(r) for r in [*live, *self._finished.values()]]

    def _status(self, record: _Record) -> AdapterStatus:
        return AdapterStatus(
            name=record.name, state=record.state, slot=record.slot,
            version=None if record.state.terminal else self._slot_versions[record.slot],
            step=record.step, accumulated_groups=record.accumulated_groups,
            registration_id=record.registration_id, kind=record.kind, last_error=record.failure,
            **record.config.to_dict(),
        )

    def snapshot(self) -> MultiLoRASnapshot:
        views: dict[AdapterState, dict[str, AdapterRun]] = {s: {} for s in AdapterState}
        clients: dict[str, ClientAdapterRun] = {}
        cleanup = {r.name for r in self._live.values() if r.state is AdapterState.CLEANUP}
        for record in self._live.values():
            if isinstance(record.config, ClientModelConfig):
                if record.state is not AdapterState.CLEANUP:
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
            clients=clients,
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
            batches=[(rollout_id, _batch_to_json(b)) for rollout_id, b in self._batches.items()],
        )

    def _json(self, record: _Record) -> dict[str, Any]:
        """A record as JSON values; the same object while the record is unchanged, so the
        store can tell unchanged rows apart cheaply (a registry keeps ~1,000 records)."""
        key = (record.registration_id, record.state, record.step, record.start_step, record.accumulated_groups,
               record.resume_from, record.failure)
        cached = self._json_cache.get(record.name)
        if cached is None or cached[0] != key:
            cached = (key, _record_to_json(record))
            self._json_cache[record.name] = cached
        return cached[1]

    @classmethod
    def from_state(cls, state: RegistryState, n_slots: int, **kwargs: Any) -> AdapterRegistry:
        """A registry holding what `state` recorded, with `n_slots` slots (the table may grow,
        but never drop a slot a live adapter holds)."""
        registry = cls(n_slots, **kwargs)
        live = [_record_from_json(r) for r in state.live]
        too_high = sorted(r.name for r in live if r.slot >= n_slots)
        if too_high:
            raise ValueError(
                f"The saved registry has adapters {too_high} in slots beyond --multi-lora-n-adapters={n_slots}; "
                f"start with at least {max(r.slot for r in live) + 1} slots"
            )
        for index, version in enumerate(state.slot_versions[:n_slots]):
            registry._slot_versions[index] = version
        for record in live:
            registry._live[record.name] = record
            registry._free_slots.discard(record.slot)
        for raw in state.finished:
            record = _record_from_json(raw)
            registry._finished[record.name] = record
        for rollout_id, raw in state.batches:
            registry._batches[rollout_id] = _batch_from_json(raw)
        return registry

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free_slots)

    @property
    def slot_versions(self) -> list[int]:
        return list(self._slot_versions)

    def live_slots(self) -> dict[str, int]:
        return {name: record.slot for name, record in self._live.items()}

    def kind(self, name: str) -> AdapterKind | None:
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
