"""The slot of every sample of one batch, prepared once for all multi-LoRA layers.

`SlotBatch.build` groups the rows by slot and derives the per-row scales and the layouts
each delta strategy reads (`miles.lora.delta`); `slot_batch` keeps one per distinct slot
list, so the steps of a decode loop share it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotBatch:
    """The slot of every sample of one batch, prepared once for all layers."""

    slot_ids_B: torch.Tensor
    """Slot per sample (long, on the model's device); -1 means base only."""
    present: tuple[int, ...]
    """Sorted slots >= 0 that occur in the batch."""
    rows: dict[int, torch.Tensor]
    """Per present slot: the batch rows of its samples (long, on the model's device)."""
    single_slot: int | None
    """The slot of every sample when all samples share one slot >= 0, else None."""
    runs: tuple[tuple[int, int], ...] | None
    """(slot, count) of consecutive equal slots when the batch is sorted by slot, else None."""
    group_rows_PG: torch.Tensor | None = None
    """Grouped layout: batch row at [present slot p, place g] (padding places read row 0)."""
    row_place_B: torch.Tensor | None = None
    """Flat place (p * G + g) of every batch row in the grouped layout; rows of slot -1
    point at a padding place, whose scale is 0."""
    valid_PG: torch.Tensor | None = None
    """1.0 at the places that hold a real row, 0.0 at padding (float32)."""
    scales: tuple[float, ...] = ()
    """alpha / rank of each present slot as the layers hold it when the batch is built."""
    scale_PG: torch.Tensor | None = None
    """`valid_PG` times each present slot's scale: the per-row LoRA scale, once per batch."""
    present_P: torch.Tensor | None = None
    """`present` as a long tensor (on the model's device)."""
    slot_scales: tuple[float, ...] | None = None
    """alpha / rank of every slot as given to `build`: a layer whose own differ computes its scales itself."""
    scale_cols_BC: torch.Tensor | None = None
    """Stacked layout: [B, M * max_rank] with each row's scale on its slot's rank columns and
    0 elsewhere (M = highest present slot + 1); with `scales` given, once per batch."""
    grouped_in_place: bool = False
    """The batch is already the grouped layout (sorted by slot, equal counts, no base-only
    rows): the grouped path reshapes instead of copying rows."""
    jagged_rows_N: torch.Tensor | None = None
    """Jagged layout: the rows of slots >= 0, stable-sorted by slot (long)."""
    jagged_offs_M: torch.Tensor | None = None
    """End of each slot's rows in `jagged_rows_N`, for slots 0..M-1 (int32; empty groups repeat)."""
    jagged_scale_N1: torch.Tensor | None = None
    """Each jagged row's alpha / rank (float32, with `scales` given)."""
    jagged_in_order: bool = False
    """`jagged_rows_N` is every row in order (sorted by slot, no base-only rows): no gather."""

    @classmethod
    def build(
        cls, slot_ids: Sequence[int] | torch.Tensor, device: torch.device, scales: Sequence[float] | None = None,
        max_rank: int | None = None,
    ) -> SlotBatch:
        """`scales[s]` is slot s's alpha / rank (optional: the grouped path then reads
        each layer's own scaling)."""
        ids = torch.as_tensor(slot_ids, dtype=torch.long).reshape(-1).cpu()
        values = ids.tolist()
        if values and min(values) < -1:
            raise ValueError(f"slot ids must be >= -1 (-1 = base model only), got {values}")
        present = tuple(sorted({s for s in values if s >= 0}))
        by_slot: dict[int, list[int]] = {s: [] for s in present}
        for row, slot in enumerate(values):
            if slot >= 0:
                by_slot[slot].append(row)
        rows = {s: torch.tensor(by_slot[s], dtype=torch.long, device=device) for s in present}
        single = present[0] if len(present) == 1 and all(s == present[0] for s in values) else None
        runs = None
        if values == sorted(values):
            runs = tuple((slot, sum(1 for _ in group)) for slot, group in itertools.groupby(values))
        if not present:
            return cls(ids.to(device), present, rows, single, runs)
        group = max(len(r) for r in by_slot.values())
        if -1 in values and all(len(r) == group for r in by_slot.values()):
            group += 1  # a padding place for the base-only rows to read (scale 0)
        grid = [[0] * group for _ in present]
        valid = [[0.0] * group for _ in present]
        place = [0] * len(values)
        pad_place = None
        for p, slot in enumerate(present):
            for g, row in enumerate(by_slot[slot]):
                grid[p][g], valid[p][g], place[row] = row, 1.0, p * group + g
            if len(by_slot[slot]) < group and pad_place is None:
                pad_place = p * group + len(by_slot[slot])
        for row, slot in enumerate(values):
            if slot < 0:
                # Some slot has fewer rows than `group` whenever a row is base-only (see above).
                assert pad_place is not None
                place[row] = pad_place
        valid_PG = torch.tensor(valid, dtype=torch.float32)
        jagged_rows = [row for slot in present for row in by_slot[slot]]
        counts = [len(by_slot.get(slot, ())) for slot in range(present[-1] + 1)]
        batch_scales: tuple[float, ...] = ()
        scale_PG = scale_cols_BC = jagged_scale_N1 = None
        if scales is not None:
            batch_scales = tuple(float(scales[s]) if s < len(scales) else 0.0 for s in present)
            scale_PG = (valid_PG * torch.tensor(batch_scales, dtype=torch.float32)[:, None]).to(device)
            if max_rank is not None:
                scale_cols_BC = scale_columns(values, present, batch_scales, max_rank).to(device)
            scale_of = dict(zip(present, batch_scales))
            jagged_scale_N1 = torch.tensor([[scale_of[values[row]]] for row in jagged_rows], dtype=torch.float32,
                                           device=device)
        return cls(
            ids.to(device), present, rows, single, runs,
            group_rows_PG=torch.tensor(grid, dtype=torch.long, device=device),
            row_place_B=torch.tensor(place, dtype=torch.long, device=device),
            valid_PG=valid_PG.to(device), scales=batch_scales, scale_PG=scale_PG, scale_cols_BC=scale_cols_BC,
            slot_scales=None if scales is None else tuple(float(v) for v in scales),
            present_P=torch.tensor(present, dtype=torch.long, device=device),
            grouped_in_place=runs is not None and -1 not in values and len({n for _, n in runs}) == 1,
            jagged_rows_N=torch.tensor(jagged_rows, dtype=torch.long, device=device),
            jagged_offs_M=torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device),
            jagged_scale_N1=jagged_scale_N1, jagged_in_order=jagged_rows == list(range(len(values))),
        )

    @property
    def batch_size(self) -> int:
        return self.slot_ids_B.numel()


def scale_columns(values: list[int], present: tuple[int, ...], scales: Sequence[float], max_rank: int) -> torch.Tensor:
    """[B, M * max_rank]: row b holds its slot's scale on that slot's columns, 0 elsewhere."""
    n_cols = (present[-1] + 1) * max_rank
    out = torch.zeros(len(values), n_cols, dtype=torch.float32)
    scale_of = dict(zip(present, scales))
    for row, slot in enumerate(values):
        if slot >= 0:
            out[row, slot * max_rank : (slot + 1) * max_rank] = scale_of[slot]
    return out


@functools.lru_cache(maxsize=256)
def slot_batch(slot_ids: tuple[int, ...], device: torch.device, scales: tuple[float, ...], max_rank: int) -> SlotBatch:
    """One `SlotBatch` per distinct batch: decode steps repeat the same slots step after
    step, and the batch (routing, per-row scales) depends on nothing else."""
    return SlotBatch.build(slot_ids, device, scales=scales, max_rank=max_rank)
