"""A LoRA layer's decode step, kept for the next step.

Each `MultiLoRALinear` keeps the operands of its last no-grad stacked, jagged or row-wise
step (`DecodePlan`): while the batch, the input's size and dtype, the weights and the slot
scales stay the same, the next step runs the path's ops on them and nothing else. The
layouts it derives from A and B are kept while the weights are unchanged (`kept`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from miles.lora.rowwise import RowwiseKernel


class PlannedLayer(Protocol):
    """What a plan reads of its layer (`miles.lora.layer.MultiLoRALinear`)."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter
    delta_mode: str
    slot_scales: tuple[float, ...] | None
    _parameters: dict[str, Any]


class DecodePlan:
    """One layer's decode step, kept for the next step: `step(x, out)` with its operands bound.

    Valid while the step runs the same `SlotBatch` object (cached per slot list by
    `use_slots`) on an input of the same size and dtype, with A and B unchanged (same
    storage and version counter: a slot load or an optimizer step bumps it) and the same
    delta mode and slot scales. Then a step is the path's ops and numbers (`stacked_step`,
    `jagged_step`) without its Python.
    """

    __slots__ = ("batch", "numel", "dtype", "a_key", "b_key", "delta_mode", "slot_scales", "step")

    def __init__(self, layer: PlannedLayer, x: torch.Tensor, batch: object, step) -> None:
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
            return False  # the forward is recorded for autograd (`_training`)
        return a._version == self.a_key[1] and b._version == self.b_key[1] and (
            a.data_ptr() == self.a_key[0] and b.data_ptr() == self.b_key[0])


def stacked_step(a_IC: torch.Tensor, scale_BC: torch.Tensor, b_CO: torch.Tensor, in_features: int,
                 x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` plus the delta of the stacked path: every slot's A side by side, one GEMM each way."""
    h_NC = torch.mm(x.reshape(-1, in_features), a_IC)
    h_NC.mul_(scale_BC)
    return torch.addmm(out.reshape(-1, b_CO.shape[1]), h_NC, b_CO).reshape(out.shape)


def jagged_step(rows_N: torch.Tensor, offs_M: torch.Tensor, in_order: bool, a_MIR: torch.Tensor,
                scale_N1: torch.Tensor, b_MRO: torch.Tensor, in_features: int,
                x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` plus the delta of the jagged path: rows grouped by slot, one grouped GEMM each way."""
    x_NI = x.reshape(-1, in_features)
    if not in_order:
        x_NI = x_NI.index_select(0, rows_N)
    h_NR = torch._grouped_mm(x_NI, a_MIR, offs=offs_M).mul_(scale_N1)
    delta_NO = torch._grouped_mm(h_NR, b_MRO, offs=offs_M)
    out_NO = out.reshape(-1, b_MRO.shape[2])
    return (out_NO.add_(delta_NO) if in_order else out_NO.index_add_(0, rows_N, delta_NO)).reshape(out.shape)


def rowwise_step(kernel: RowwiseKernel, fixed: tuple[int, ...], keep_alive: tuple,
                 x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (the base output, fresh) plus the delta, written in place by the kernel, which
    reads both as [rows, features] (the plan fixes x's size; `keep_alive` holds the tensors
    behind the pointers in `fixed`)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if not out.is_contiguous():
        out = out.contiguous()
    kernel.call_raw(out.data_ptr(), x.data_ptr(), fixed)
    return out


def kept(cache: tuple[tuple, torch.Tensor] | None, weight: torch.Tensor,
          derive) -> tuple[tuple, torch.Tensor]:
    """`(key, derive(weight))`, derived again only when the weight's storage, version counter
    (every in-place write bumps it), dtype or device differ from `cache`'s key."""
    key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
    if cache is None or cache[0] != key:
        cache = (key, derive(weight.detach()))
    return cache


def weight_key(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version
