"""The jagged delta: the rows sorted by slot through one grouped GEMM pair against each
slot's own A and B (`torch._grouped_mm`).

No grad, one token per sample: decode steps with many rows, where the stacked path's work
on the other slots' columns dominates. A step keeps its operands on the layer (`DecodePlan`
running `jagged_step`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from miles.lora.decode_plan import DecodePlan
from miles.lora.delta.base import SlotLinear, training
from miles.lora.slot_batch import SlotBatch

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def forward(layer: SlotLinear, x: Tensor, batch: SlotBatch) -> Tensor:
    """The base output plus the delta of every row from its own slot only: the rows sorted by
    slot (a gather, unless they already are), one grouped GEMM against the slots' A and one
    against their B (`torch._grouped_mm`, both read in place), each row scaled in
    between, added back in place. No grad: for decode steps with many rows, where the
    stacked path's work on every slot's columns outgrows its saving in ops.
    """
    out = layer.base(x)
    if x.shape[1:-1].numel() != 1 or training(layer):
        raise ValueError("the jagged delta runs decode steps only: one token per sample, no grad")
    rows_N, offs_M = batch.jagged_rows_N, batch.jagged_offs_M
    if rows_N is None or offs_M is None:
        raise ValueError("the jagged delta needs a batch with a present slot (SlotBatch.build)")
    n_slots = batch.present[-1] + 1
    scale_N1 = batch.jagged_scale_N1
    if scale_N1 is None or batch.slot_scales != layer.slot_scales:
        slots_N = batch.slot_ids_B.index_select(0, rows_N)
        scale_N1 = layer.scaling.index_select(0, slots_N)[:, None]
    a_MIR = layer.lora_A.detach()[:n_slots].transpose(1, 2)
    b_MRO = layer.lora_B.detach()[:n_slots].transpose(1, 2)
    step = functools.partial(jagged_step, rows_N, offs_M, batch.jagged_in_order,
                             a_MIR, scale_N1.to(a_MIR.dtype), b_MRO, layer.in_features)
    if x.dtype == a_MIR.dtype and out.dtype == a_MIR.dtype:
        layer.decode_plan = DecodePlan(layer, x, batch, step)
        return step(x, out)
    return out + step(x.to(a_MIR.dtype), out.new_zeros(out.shape, dtype=a_MIR.dtype)).to(out.dtype)


def jagged_step(rows_N: Tensor, offs_M: Tensor, in_order: bool, a_MIR: Tensor, scale_N1: Tensor, b_MRO: Tensor,
                in_features: int, x: Tensor, out: Tensor) -> Tensor:
    """`out` plus the delta of the jagged path: rows grouped by slot, one grouped GEMM each way."""
    x_NI = x.reshape(-1, in_features)
    if not in_order:
        x_NI = x_NI.index_select(0, rows_N)
    h_NR = torch._grouped_mm(x_NI, a_MIR, offs=offs_M).mul_(scale_N1)
    delta_NO = torch._grouped_mm(h_NR, b_MRO, offs=offs_M)
    out_NO = out.reshape(-1, b_MRO.shape[2])
    return (out_NO.add_(delta_NO) if in_order else out_NO.index_add_(0, rows_N, delta_NO)).reshape(out.shape)
