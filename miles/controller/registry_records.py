"""A registry's records and their stored form: what the registry keeps of each adapter (`Record`,
`Queued`, `BatchRecord`), what a transition answers (`Changed`: its result and the rows it
changed), and the JSON-ready values the store writes and reads back (`RegistryState`, the whole
registry; `RegistryChanges`, what changed since the last write).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from miles.utils.adapter_config import AdapterRunConfig
from miles.utils.types import AdapterFailure, AdapterKind, AdapterState, ClientModelConfig

R = TypeVar("R")

AnyAdapterConfig = AdapterRunConfig | ClientModelConfig
"""A server-driven adapter's run config, or a client-driven one's model config."""


def adapter_kind(config: AnyAdapterConfig) -> AdapterKind:
    return AdapterKind.CLIENT if isinstance(config, ClientModelConfig) else AdapterKind.SERVER


@dataclass
class Record:
    name: str
    config: AnyAdapterConfig
    slot: int
    """The slot it holds; while PAGED, the one it held last (it holds none)."""
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
    priority: int = 0
    """The priority it was registered with (it ordered the queue, if it waited in it)."""
    revision: int = field(default=0, compare=False, repr=False)
    """How many transitions changed it (its cached stored form and status text follow it);
    not stored."""

    @property
    def kind(self) -> AdapterKind:
        return adapter_kind(self.config)


@dataclass
class Queued:
    """A QUEUED registration: a server-driven adapter waiting for a slot (it holds none)."""

    name: str
    config: AdapterRunConfig
    registration_id: str
    """Issued when it was queued; kept when it takes a slot."""
    priority: int = 0

    @functools.cached_property
    def as_json(self) -> dict[str, Any]:
        """Its stored form (one dict for its whole stay, so the store reuses the row's text)."""
        return {"name": self.name, "kind": AdapterKind.SERVER.value, "config": self.config.model_dump(mode="json"),
                "slot": None, "registration_id": self.registration_id, "state": AdapterState.QUEUED.value,
                "priority": self.priority}


def queued_from_json(raw: dict[str, Any]) -> Queued:
    return Queued(name=raw["name"], config=AdapterRunConfig.model_validate_json(json.dumps(raw["config"])),
                   registration_id=raw["registration_id"], priority=raw.get("priority", 0))


@dataclass(frozen=True)
class Changed(Generic[R]):
    """What a registry transition answers: its `result`, and the `names` whose stored rows it
    changed (a record's field, its place, or it was forgotten), for the store to write."""

    result: R
    names: Collection[str] = ()


@dataclass(frozen=True)
class BatchRecord:
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
    queued: list[dict[str, Any]] = field(default_factory=list)
    """QUEUED registrations, head of the queue first."""


@dataclass(frozen=True)
class RegistryChanges:
    """What changed in a registry since its last `take_changes`, for the store to write only
    those rows: the records that changed or moved, the names it no longer holds, and the
    small parts whole (slot versions, the queue in its order, the recorded batches)."""

    n_slots: int
    slot_versions: list[int]
    live: list[dict[str, Any]]
    """Live records that changed (their order does not matter)."""
    finished: list[dict[str, Any]]
    """Terminal records that changed or were read since: the last ones of the retention order, in it."""
    removed: list[str]
    """Names no longer held (forgotten, or dropped past the retention)."""
    queued: list[dict[str, Any]]
    """Every QUEUED registration, head first."""
    batches: list[tuple[int, dict[str, Any]]]
    """Every recorded batch, oldest first."""


def record_to_json(record: Record) -> dict[str, Any]:
    return {
        "name": record.name, "kind": record.kind.value, "config": record.config.model_dump(mode="json"),
        "slot": record.slot,
        "registration_id": record.registration_id, "state": record.state.value, "step": record.step,
        "start_step": record.start_step, "accumulated_groups": record.accumulated_groups,
        "pushed": record.pushed, "resume_from": record.resume_from, "resume_step": record.resume_step,
        "failure": None if record.failure is None else record.failure.model_dump(mode="json"),
        "priority": record.priority,
    }


def record_from_json(raw: dict[str, Any]) -> Record:
    config_cls = ClientModelConfig if raw.get("kind") == AdapterKind.CLIENT.value else AdapterRunConfig
    return Record(
        name=raw["name"], config=config_cls.model_validate_json(json.dumps(raw["config"])),
        slot=raw["slot"], registration_id=raw["registration_id"], state=AdapterState(raw["state"]),
        step=raw["step"], start_step=raw["start_step"], accumulated_groups=raw["accumulated_groups"],
        pushed=raw.get("pushed", raw["state"] != AdapterState.PENDING.value), resume_from=raw.get("resume_from"),
        resume_step=raw.get("resume_step", 0),
        failure=None if raw.get("failure") is None else AdapterFailure.model_validate(raw["failure"]),
        priority=raw.get("priority", 0),
    )


def batch_to_json(batch: BatchRecord) -> dict[str, Any]:
    return {"groups": batch.groups, "step_names": sorted(batch.step_names), "registrations": batch.registrations}


def batch_from_json(raw: dict[str, Any]) -> BatchRecord:
    return BatchRecord(dict(raw["groups"]), frozenset(raw["step_names"]), dict(raw["registrations"]))
