"""The adapter lifecycle as the driver sees it: states, the snapshot, engine-side names.

The registry (`miles.controller.registry`) owns every transition; these are the read-only
views it hands out and the naming rules every component shares.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from miles.utils.adapter_config import AdapterRunConfig
    from miles.utils.types.client_commands import ClientAdapterRun


DEFAULT_QUEUE_SIZE = 1024
"""Registrations that may wait for a slot when every slot is held (`--multi-lora-queue-size`)."""


class AdapterState(str, enum.Enum):
    """Lifecycle of one adapter; PENDING, ACTIVE, RETIRING and CLEANUP hold a slot, COMPLETED
    and FAILED are terminal (the name may be registered again). QUEUED comes before PENDING
    when no slot was free at registration; it holds none.

        QUEUED --(a slot frees; head of the queue)--> PENDING --(first push)--> ACTIVE
        PENDING/ACTIVE --(DELETE or num_step)--> RETIRING --> CLEANUP --> COMPLETED (or FAILED)
        QUEUED --(DELETE)--> forgotten (no record kept; the name is free at once)
        ACTIVE (client-driven, idle) --(page out)--> PAGED --(its next command)--> PENDING
    """

    QUEUED = "QUEUED"
    """Registered while every slot was held: waiting, in priority then arrival order, for one
    to free. Holds no slot, is never loaded or sampled; `free_slot` hands the head of the queue
    the slot it frees (PENDING) in the same registry change. Not a Miles state."""
    PENDING = "PENDING"
    """Registered and given a slot; its weights are not on the engines yet."""
    ACTIVE = "ACTIVE"
    """Weights pushed at least once; sampled and trained."""
    RETIRING = "RETIRING"
    """Asked to stop (DELETE or `num_step` reached); still sampleable until retired."""
    CLEANUP = "CLEANUP"
    """No longer sampled; waiting for the trainer's final save and slot release."""
    COMPLETED = "COMPLETED"
    """Done; holds no slot. Kept for status queries (bounded retention)."""
    PAGED = "PAGED"
    """A client-driven model idle for `--multi-lora-idle-evict-s`: its state (weights, moments,
    pending gradient, clock) was written to its save directory and its slot freed. Live: its
    name, step and commands are kept; its next command pages it back into a free slot
    (PENDING, resumed from that state). Not a Miles state."""
    FAILED = "FAILED"
    """Its plug-ins failed prompt group after prompt group: it left like a retired adapter
    (requests aborted, saved, slot freed) and its status keeps the last error. Terminal like
    COMPLETED; never resumed by a restarted trainer. Not a Miles state."""

    @property
    def holds_slot(self) -> bool:
        """PENDING, ACTIVE, RETIRING or CLEANUP: a row of the page table is this adapter's."""
        return not (self.terminal or self in (AdapterState.QUEUED, AdapterState.PAGED))

    @property
    def terminal(self) -> bool:
        """COMPLETED or FAILED: nothing happens to this registration any more."""
        return self in (AdapterState.COMPLETED, AdapterState.FAILED)

    @property
    def sampleable(self) -> bool:
        return self in (AdapterState.ACTIVE, AdapterState.RETIRING)


LoraUpdateMode = Literal["in_place", "versioned"]
"""How pushed LoRA weights reach the engines (`--engine-lora-update`).

`in_place`: a slot keeps one engine-side name and each push replaces its weights
between two decode steps. `versioned`: each push loads a new name beside the previous
version (for SGLang builds that cannot replace a loaded adapter).
"""

ENGINE_LORA_PREFIX = "__miles_slot_"


def engine_lora_name(slot: int, version: int | None = None, mode: LoraUpdateMode = "in_place") -> str:
    """The engine-side name of a slot's LoRA (`lora_path` in SGLang requests): the only place it is built.

    >>> engine_lora_name(3, 7, "in_place"), engine_lora_name(3, 7, "versioned")
    ('__miles_slot_3', '__miles_slot_3_v7')
    """
    if mode == "in_place":
        return f"{ENGINE_LORA_PREFIX}{slot}"
    if mode == "versioned":
        if version is None:
            raise ValueError(f"a versioned engine LoRA name needs the slot version (slot {slot})")
        return f"{ENGINE_LORA_PREFIX}{slot}_v{version}"
    raise ValueError(f"unknown LoRA update mode {mode!r}: use 'in_place' or 'versioned'")


def engine_lora_slot(name: str) -> int:
    """The slot of an engine-side LoRA name of either mode (the inverse of `engine_lora_name`)."""
    if not name.startswith(ENGINE_LORA_PREFIX):
        raise ValueError(f"{name!r} is not an engine-side slot LoRA name ({ENGINE_LORA_PREFIX}<slot>[_v<version>])")
    return int(name[len(ENGINE_LORA_PREFIX):].split("_v", 1)[0])


def next_slot_version(version: int) -> int:
    """The slot version a push makes of `version` (the registry's rule, used by the push too)."""
    return version + 1


def adapter_rid(adapter: str, unique: str) -> str:
    """Request id of one generation request; aborting an adapter is a prefix abort."""
    return f"{adapter}::{unique}"


def adapter_rid_prefix(adapter: str) -> str:
    return f"{adapter}::"


@dataclass(frozen=True)
class AdapterRun:
    """Read-only view of one live adapter, as carried by a snapshot."""

    name: str
    config: AdapterRunConfig
    """The resolved config: every default filled in from the process config."""
    slot: int
    """Row of the LoRA page table this adapter owns."""
    version: int
    """Slot version of the weights the engines serve (bumped per push, never reset)."""
    step: int
    """Optimizer steps taken (including steps restored from a checkpoint)."""
    accumulated_groups: int
    """Prompt groups trained since the last optimizer step."""
    registration_id: str
    """uuid4 hex issued at registration; a re-registration gets a new one."""
    start_step: int = 0
    """Step this registration started at (its resumed step); `num_step` counts from here."""
    pushed: bool = False
    """Its weights were pushed at least once: `start_step` is fixed from then on (a trainer
    that restarts over the registry resumes it without moving its end)."""
    pushing_version: int | None = None
    """The version of a push under way (the trainer has exported these weights; the engines
    still serve `version`); None when no push is under way."""

    @property
    def trainer_version(self) -> int:
        """The version of the weights the trainer has sent last: what staleness counts against."""
        return self.version if self.pushing_version is None else self.pushing_version

    @property
    def final_step(self) -> int | None:
        """The step at which it retires by itself (None: only a DELETE retires it)."""
        num_step = self.config.num_step
        return None if num_step is None else self.start_step + num_step


@dataclass(frozen=True)
class MultiLoRASnapshot:
    """Point-in-time copy of the registry that the driver loop acts on.

    `pending`, `active` and `retiring` hold the server-driven adapters (the RL loop's);
    client-driven ones (Tinker models) are in `clients` whatever their live state, so
    nothing generates for them or reads a dataset for them. `cleanup`, `completed` and
    `failed` name adapters of both kinds."""

    pending: dict[str, AdapterRun] = field(default_factory=dict)
    active: dict[str, AdapterRun] = field(default_factory=dict)
    retiring: dict[str, AdapterRun] = field(default_factory=dict)
    cleanup: frozenset[str] = frozenset()
    completed: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
    """FAILED adapters (of either kind) still kept for status queries."""
    clients: dict[str, ClientAdapterRun] = field(default_factory=dict)
    """Live client-driven adapters (PENDING, ACTIVE or RETIRING), by name."""
    queued: tuple[str, ...] = ()
    """QUEUED adapters in the order they will take slots (head first). The loop never acts on
    them: a slot that frees goes to the head inside the registry, which shows it as PENDING."""

    @property
    def sampleable(self) -> dict[str, AdapterRun]:
        """ACTIVE and RETIRING adapters: the ones the producer generates for."""
        return {**self.active, **self.retiring}

    @property
    def live(self) -> dict[str, AdapterRun]:
        """Adapters that own a slot and have a view (PENDING, ACTIVE, RETIRING)."""
        return {**self.pending, **self.active, **self.retiring}

    @property
    def all_adapters_cleaned_up(self) -> bool:
        """True when no adapter of either kind holds a slot, and none waits for one."""
        return not (self.pending or self.active or self.retiring or self.cleanup or self.clients or self.queued)
