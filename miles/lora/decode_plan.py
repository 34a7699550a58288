"""A LoRA layer's decode step, kept for the next step.

Each `MultiLoRALinear` keeps the operands of its last no-grad stacked, jagged or row-wise
step (`DecodePlan`, made by those strategies in `miles.lora.delta`): while the batch, the
input's size and dtype, the weights and the slot scales stay the same, the next step runs
the path's ops on them and nothing else. The layouts it derives from A and B are kept while
the weights are unchanged (`kept`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

PlanStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`step(x, out)`: the base output `out` plus the delta of `x`, with the path's operands bound."""


class PlannedLayer(Protocol):
    """What a plan reads of its layer (`miles.lora.layer.MultiLoRALinear`)."""

    @property
    def lora_A(self) -> torch.nn.Parameter: ...
    @property
    def lora_B(self) -> torch.nn.Parameter: ...
    @property
    def delta_mode(self) -> str: ...
    @property
    def slot_scales(self) -> tuple[float, ...]: ...
    @property
    def _parameters(self) -> Mapping[str, Any]: ...


class DecodePlan:
    """One layer's decode step, kept for the next step: `step(x, out)` with its operands bound.

    Valid while the step runs the same `SlotBatch` object (cached per slot list by
    `use_slots`) on an input of the same size and dtype, with A and B unchanged (same
    storage and version counter: a slot load or an optimizer step bumps it) and the same
    delta mode and slot scales. Then a step is the path's ops and numbers (`stacked_step`,
    `jagged_step`, `rowwise_step` of `miles.lora.delta`) without its Python.
    """

    __slots__ = ("batch", "numel", "dtype", "a_key", "b_key", "delta_mode", "slot_scales", "step")

    def __init__(self, layer: PlannedLayer, x: torch.Tensor, batch: object, step: PlanStep) -> None:
        self.batch, self.numel, self.dtype = batch, x.numel(), x.dtype
        self.a_key, self.b_key = weight_key(layer.lora_A), weight_key(layer.lora_B)
        self.delta_mode, self.slot_scales = layer.delta_mode, layer.slot_scales
        self.step = step

    def fits(self, layer: PlannedLayer, x: torch.Tensor, batch: object) -> bool:
        # Cheapest checks first; the weights straight from `_parameters` (no Module.__getattr__).
        if batch is not self.batch or x.numel() != self.numel or x.dtype != self.dtype:
            return False
        if layer.slot_scales is not self.slot_scales or layer.delta_mode != self.delta_mode:
            return False
        params = layer._parameters
        a, b = params["lora_A"], params["lora_B"]
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            return False  # the forward is recorded for autograd (`miles.lora.delta.base.training`)
        return a._version == self.a_key[1] and b._version == self.b_key[1] and (
            a.data_ptr() == self.a_key[0] and b.data_ptr() == self.b_key[0])


LayoutKey = tuple[int, int, torch.dtype, torch.device]


def kept(cache: tuple[LayoutKey, torch.Tensor] | None, weight: torch.Tensor,
         derive: Callable[[torch.Tensor], torch.Tensor]) -> tuple[LayoutKey, torch.Tensor]:
    """`(key, derive(weight))`, derived again only when the weight's storage, version counter
    (every in-place write bumps it), dtype or device differ from `cache`'s key."""
    key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
    if cache is None or cache[0] != key:
        cache = (key, derive(weight.detach()))
    return cache


def weight_key(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version
