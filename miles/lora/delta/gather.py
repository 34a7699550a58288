"""The gather delta: the rows grouped into one [slot, rows, features] block per present
adapter, through one pair of batched GEMMs against the adapters' A and B, read in place.

Best for unsorted batches and for sorted ones of equal counts; those (a slot-sorted training
batch) whose input, base and LoRA share one dtype run base and delta as one autograd node
(`miles.lora.grouped`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from miles.lora.delta.base import SlotLinear
from miles.lora.grouped import GroupedLoRALinear
from miles.lora.slot_batch import SlotBatch


def forward(layer: SlotLinear, x: Tensor, batch: SlotBatch) -> Tensor:
    if batch.grouped_in_place and _frozen_base_of_dtype(layer, x.dtype):
        return grouped_linear(layer, x, batch)
    return add_gather_delta(layer, layer.base(x), x, batch)


def add_gather_delta(layer: SlotLinear, out: Tensor, x: Tensor, batch: SlotBatch) -> Tensor:
    """`out` plus the LoRA delta, rows grouped per present slot: one pair of batched GEMMs
    over the slots' A and B.

    A and B are read in place (a slice when the present slots are 0..P-1, else one
    copy per present adapter, never per sample). Rows past a slot's rank are zero, so
    the full max_rank product equals the rank-sliced one. The per-row scale goes on the
    [P, N, rank] product, not the wider delta. Batches already grouped (a slot-sorted
    training batch) whose input, base and LoRA share one dtype take `grouped_linear`;
    of mixed dtypes, the second GEMM adds straight into `out` (baddbmm).
    """
    group_rows_PG, row_place_B = _grouped_layout(batch)
    n_present = len(batch.present)
    a_PRI, b_POR = _present_weights(layer, batch)
    scale_PG = _group_scale(layer, batch)
    group = group_rows_PG.shape[1]
    x = x.to(a_PRI.dtype)
    lead = x.shape[1:-1]  # (T,) for [B, T, in] inputs, () for [B, in]
    tokens = math.prod(lead)
    if not batch.grouped_in_place:
        x = x.index_select(0, group_rows_PG.reshape(-1))
    x_PNI = x.reshape(n_present, group * tokens, -1)
    h_PGTR = torch.bmm(x_PNI, a_PRI.transpose(1, 2)).reshape(n_present, group, tokens, -1)
    h_PNR = (h_PGTR * scale_PG[:, :, None, None].to(h_PGTR.dtype)).reshape(n_present, group * tokens, -1)
    if batch.grouped_in_place and out.dtype == h_PNR.dtype:
        out_PNO = out.reshape(n_present, group * tokens, -1)
        return torch.baddbmm(out_PNO, h_PNR, b_POR.transpose(1, 2)).reshape(out.shape)
    delta = torch.bmm(h_PNR, b_POR.transpose(1, 2)).reshape(n_present * group, *lead, -1)
    if not batch.grouped_in_place:
        delta = delta.index_select(0, row_place_B)
    return out + delta.to(out.dtype)


def grouped_linear(layer: SlotLinear, x: Tensor, batch: SlotBatch) -> Tensor:
    """Base and delta of a batch already in the grouped layout as one autograd node
    (`GroupedLoRALinear`): fewer ops in the forward and the backward, no copy of the
    base output."""
    a_PRI, b_POR = _present_weights(layer, batch)
    scale_P = _group_scale(layer, batch)[:, 0]  # in place: every place of a slot holds a row
    x_PNI = x.reshape(len(batch.present), -1, x.shape[-1])
    out_PNO = GroupedLoRALinear.apply(x_PNI, layer.base.weight, layer.base.bias, a_PRI, b_POR, scale_P.to(x.dtype))
    return out_PNO.view(*x.shape[:-1], -1)


def _frozen_base_of_dtype(layer: SlotLinear, dtype: torch.dtype) -> bool:
    weight = layer.base.weight
    return dtype == weight.dtype == layer.lora_A.dtype and not weight.requires_grad and \
        (layer.base.bias is None or not layer.base.bias.requires_grad)


def _grouped_layout(batch: SlotBatch) -> tuple[Tensor, Tensor]:
    """(group_rows_PG, row_place_B): `SlotBatch.build` sets both whenever a slot is present."""
    if batch.group_rows_PG is None or batch.row_place_B is None:
        raise ValueError("the gather delta needs a batch with a present slot (SlotBatch.build)")
    return batch.group_rows_PG, batch.row_place_B


def _present_slots(batch: SlotBatch) -> Tensor:
    if batch.present_P is None:
        raise ValueError("the gather delta needs a batch with a present slot (SlotBatch.build)")
    return batch.present_P


def _present_weights(layer: SlotLinear, batch: SlotBatch) -> tuple[Tensor, Tensor]:
    """A and B of the batch's present slots: a slice when they are 0..P-1, else one
    copy per present adapter (never per sample)."""
    n_present = len(batch.present)
    if batch.present == tuple(range(n_present)):
        return layer.lora_A[:n_present], layer.lora_B[:n_present]
    present_P = _present_slots(batch)
    return layer.lora_A.index_select(0, present_P), layer.lora_B.index_select(0, present_P)


def _group_scale(layer: SlotLinear, batch: SlotBatch) -> Tensor:
    """[P, G]: each place's alpha / rank (0 at padding), the batch's own when its
    scales are this layer's."""
    if batch.scale_PG is None or batch.slot_scales != layer.slot_scales:
        if batch.valid_PG is None:
            raise ValueError("the gather delta needs a batch with a present slot (SlotBatch.build)")
        return batch.valid_PG * layer.scaling.index_select(0, _present_slots(batch))[:, None]
    return batch.scale_PG
