"""The adapter lifecycle's states and the engine-side names every component shares.

The registry (`miles.controller.registry`) owns every transition; the read-only views it
hands out are in `miles.utils.types.snapshot`.
"""

from __future__ import annotations

import enum
from typing import Literal


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
