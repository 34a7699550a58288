"""What a delta strategy is: a function that runs one multi-LoRA layer on one batch.

    def forward(layer: SlotLinear, x: Tensor, batch: SlotBatch) -> Tensor:   # base(x) + delta

`SlotLinear` is what a strategy reads of its layer (`miles.lora.layer.MultiLoRALinear`);
strategies hold no state of their own beyond what they keep on the layer (its decode plan
and the layouts it derives from A and B).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from miles.lora.decode_plan import DecodePlan, PlannedLayer
from miles.lora.slot_batch import SlotBatch


class SlotLinear(PlannedLayer, Protocol):
    """A frozen linear with a LoRA page table: `lora_A [n_slots, max_rank, in]`,
    `lora_B [n_slots, out, max_rank]`, and per slot its rank, alpha and `scaling = alpha / rank`."""

    decode_plan: DecodePlan | None
    """The operands of the last no-grad stacked, jagged or row-wise step, reused while they fit."""

    @property
    def base(self) -> nn.Linear: ...
    @property
    def scaling(self) -> Tensor: ...
    @property
    def ranks(self) -> list[int]: ...
    @property
    def alphas(self) -> list[float]: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def max_rank(self) -> int: ...
    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...

    def scale(self, slot: int) -> float:
        """alpha / rank of `slot` (0 when empty)."""
        ...

    def kept_layout(self, name: str, weight: Tensor, derive: Callable[[Tensor], Tensor]) -> Tensor:
        """`derive(weight)`, kept on the layer under `name` while the weight is unchanged."""
        ...


DeltaStrategy = Callable[[SlotLinear, Tensor, SlotBatch], Tensor]
"""`forward(layer, x, batch)`: the layer's output on `x` (its base output plus each row's
LoRA delta), for a batch with at least one present slot."""


def training(layer: SlotLinear) -> bool:
    """Autograd records this forward: the LoRA weights are read in place, never from a copy."""
    return torch.is_grad_enabled() and (layer.lora_A.requires_grad or layer.lora_B.requires_grad)
