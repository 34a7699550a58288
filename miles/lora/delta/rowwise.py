"""The row-wise delta: one call of the C kernel (`miles.lora.rowwise`) that runs each row
through its own slot's A and B only.

No grad, float32 on CPU where the kernel is built: decode steps, where the torch paths
either compute every slot for every row (stacked) or pay a GEMM call per slot (jagged). A
step keeps its operands on the layer (`DecodePlan` running `rowwise_step`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from miles.lora.decode_plan import DecodePlan
from miles.lora.delta.base import SlotLinear, training
from miles.lora.delta.stacked import stacked_b
from miles.lora.rowwise import RowwiseKernel, plan_arguments, rowwise_kernel
from miles.lora.slot_batch import SlotBatch


def kernel_for(layer: SlotLinear, x: Tensor) -> RowwiseKernel | None:
    """The C kernel where it can run this step: float32 on CPU, and built (`rowwise_kernel`)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or layer.lora_A.dtype != torch.float32:
        return None
    return rowwise_kernel()


def forward(layer: SlotLinear, x: Tensor, batch: SlotBatch) -> Tensor:
    """The base output plus the delta of every row from its own slot only, in one C call:
    rank x (in + out) multiply-adds a row, rows taken in slot order so that each slot's A
    and B are read once per step."""
    out = layer.base(x)
    kernel = kernel_for(layer, x)
    if kernel is None or x.shape[1:-1].numel() != 1 or training(layer):
        raise ValueError("the row-wise delta runs float32 CPU decode steps only (one token per sample, no "
                         "grad), with the kernel built")
    if batch.jagged_rows_N is None:
        raise ValueError("the row-wise delta needs a batch with a present slot (SlotBatch.build)")
    ids_B = batch.slot_ids_B
    scale_B = layer.scaling.index_select(0, ids_B.clamp(min=0)) * (ids_B >= 0)
    a_SIR = layer.kept_layout("rowwise_a", layer.lora_A, lambda w: w.transpose(1, 2).contiguous())
    b_SRO = stacked_b(layer).view(layer.n_slots, layer.max_rank, layer.out_features)
    fixed = plan_arguments(a_SIR, b_SRO, ids_B, scale_B, batch.jagged_rows_N)
    # The plan holds the tensors behind those pointers, so they live as long as it does.
    step = functools.partial(rowwise_step, kernel, fixed, (a_SIR, b_SRO, ids_B, scale_B, batch))
    layer.decode_plan = DecodePlan(layer, x, batch, step)
    return step(x, out)


def rowwise_step(kernel: RowwiseKernel, fixed: tuple[int, ...], keep_alive: tuple[object, ...],
                 x: Tensor, out: Tensor) -> Tensor:
    """`out` (the base output, fresh) plus the delta, written in place by the kernel, which
    reads both as [rows, features] (the plan fixes x's size; `keep_alive` holds the tensors
    behind the pointers in `fixed`)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if not out.is_contiguous():
        out = out.contiguous()
    kernel.call_raw(out.data_ptr(), x.data_ptr(), fixed)
    return out
