"""The segment delta: one pair of GEMMs per slot present in the batch, at the slot's rank.

Best for the long, slot-sorted sequences of training (contiguous slices, no scatter) and
for batches of one adapter; unsorted batches add each slot's rows back with `index_add`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.lora.delta.base import SlotLinear
from miles.lora.slot_batch import SlotBatch


def forward(layer: SlotLinear, x: Tensor, batch: SlotBatch) -> Tensor:
    out = layer.base(x)
    return out + segment_delta(layer, x, batch).to(out.dtype)


def slot_delta(layer: SlotLinear, x: Tensor, slot: int) -> Tensor:
    rank = layer.ranks[slot]
    a = layer.lora_A[slot, :rank]
    b = layer.lora_B[slot, :, :rank]
    x = x.to(a.dtype)
    # A Python float scales like PEFT does (exact, no device sync).
    return (x @ a.transpose(0, 1)) @ b.transpose(0, 1) * (layer.alphas[slot] / rank if rank else 0.0)


def segment_delta(layer: SlotLinear, x: Tensor, batch: SlotBatch) -> Tensor:
    if batch.single_slot is not None:
        return slot_delta(layer, x, batch.single_slot)
    if batch.runs is not None:
        # Sorted batches (the trainer sorts by slot): contiguous slices, no scatter.
        pieces = []
        for (slot, _), segment in zip(batch.runs, x.split([n for _, n in batch.runs])):
            if slot < 0:
                pieces.append(segment.new_zeros((*segment.shape[:-1], layer.out_features), dtype=layer.lora_B.dtype))
            else:
                pieces.append(slot_delta(layer, segment, slot))
        return torch.cat(pieces)
    delta = x.new_zeros((*x.shape[:-1], layer.out_features), dtype=layer.lora_B.dtype)
    for slot in batch.present:
        rows = batch.rows[slot].to(x.device)
        delta = delta.index_add(0, rows, slot_delta(layer, x.index_select(0, rows), slot))
    return delta
