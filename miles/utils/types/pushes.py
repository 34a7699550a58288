"""LoRA weights on their way from the train rank to the engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoraPush:
    """One adapter's LoRA weights on their way from train rank 0 to every engine.

    `tensors_ref` is a Ray ObjectRef to a `dict[str, torch.Tensor]` keyed by PEFT
    parameter names (rank-sliced); it is put in the object store once per push.
    """

    adapter: str
    slot: int
    version: int
    """The slot version this push will become (current + 1)."""
    peft_config: dict[str, Any]
    """Contents of `adapter_config.json`."""
    tensors_ref: Any


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
