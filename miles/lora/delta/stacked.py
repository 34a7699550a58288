"""The stacked delta: every slot up to the highest present one as one wide LoRA, each row
scaled on its own slot's columns.

Three ops whatever the mix of slots: the best path for decode steps with a few rows. A
no-grad step keeps its operands on the layer (`DecodePlan` running `stacked_step`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from miles.lora.decode_plan import DecodePlan
from miles.lora.delta.base import SlotLinear, training
from miles.lora.slot_batch import SlotBatch, scale_columns


def forward(layer: SlotLinear, x: Tensor, batch: SlotBatch) -> Tensor:
    """The base output plus the delta of every slot up to the highest present one as one wide
    LoRA: x @ [A_0; ..; A_M-1]^T, each row's scale on its own slot's columns (0 on the
    others), then @ the stacked B, added in the same GEMM.

    M * max_rank columns of work per row instead of rank, but three ops and no row or
    weight copies (B's stacked transpose is kept between calls while B is unchanged
    and not being trained): the best path for decode steps, whose GEMMs have a few rows.
    """
    out = layer.base(x)
    n_cols = (batch.present[-1] + 1) * layer.max_rank
    scale_BC = batch.scale_cols_BC
    if scale_BC is None or batch.slot_scales != layer.slot_scales:
        scale_BC = scale_columns(batch.slot_ids_B.tolist(), batch.present, [layer.scale(s) for s in batch.present],
                                 layer.max_rank).to(x.device)
    a_CI = layer.lora_A.reshape(-1, layer.in_features)[:n_cols]
    x_NI = x.reshape(-1, layer.in_features).to(a_CI.dtype)
    rows_per_sample = x_NI.shape[0] // batch.batch_size
    if rows_per_sample != 1:
        scale_BC = scale_BC.repeat_interleave(rows_per_sample, dim=0)
    h_NC = ((x_NI @ a_CI.transpose(0, 1)) * scale_BC).to(a_CI.dtype)
    b_CO = stacked_b(layer)[:n_cols]
    out_NO = out.reshape(-1, layer.out_features)
    if out_NO.dtype == h_NC.dtype:
        if rows_per_sample == 1 and x.dtype == a_CI.dtype and not training(layer):
            layer.decode_plan = DecodePlan(layer, x, batch, functools.partial(
                stacked_step, a_CI.detach().transpose(0, 1), scale_BC, b_CO, layer.in_features))
        return torch.addmm(out_NO, h_NC, b_CO).reshape(out.shape)
    return out + (h_NC @ b_CO).to(out.dtype).reshape(out.shape)


def stacked_b(layer: SlotLinear) -> Tensor:
    """B of every slot as [n_slots * max_rank, out]: row s * max_rank + k is B[s, :, k]."""
    b = layer.lora_B
    if training(layer):
        return b.transpose(1, 2).reshape(-1, layer.out_features)
    return layer.kept_layout("stacked_b", b, lambda w: w.transpose(1, 2).reshape(-1, layer.out_features).contiguous())


def stacked_step(a_IC: Tensor, scale_BC: Tensor, b_CO: Tensor, in_features: int, x: Tensor, out: Tensor) -> Tensor:
    """`out` plus the delta of the stacked path: every slot's A side by side, one GEMM each way."""
    h_NC = torch.mm(x.reshape(-1, in_features), a_IC)
    h_NC.mul_(scale_BC)
    return torch.addmm(out.reshape(-1, b_CO.shape[1]), h_NC, b_CO).reshape(out.shape)
