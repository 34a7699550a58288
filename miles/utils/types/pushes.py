"""Pushes of LoRA weights: what the engine fleet keeps of each, and how a weights-update group is laid out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SlotPush:
    """The latest push of one live slot, as the engine fleet keeps it: what an engine that
    Ray restarted loads before it takes requests."""

    slot: int
    version: int
    peft_config: dict[str, Any]
    tensors_ref: Any
    """ObjectRef to the `{PEFT name: tensor}` dict; the fleet holds it, so the object lives
    as long as the slot does (its owner, the process that exported it, outlives engines)."""


@dataclass(frozen=True)
class UpdateGroupLayout:
    """How a weights-update group with the engines is laid out (the rollout manager says)."""

    backend: str
    """The process-group backend: nccl on GPU, gloo on CPU."""
    ranks_per_engine: int
    """Ranks each engine joins with (its tensor-parallel size)."""
    bucketed: bool
    """Pushes go as one flat tensor per dtype (builtin engines), not one per name (SGLang)."""
