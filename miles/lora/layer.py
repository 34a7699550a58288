"""The slot page-table LoRA linear layer and the per-batch slot routing.

One frozen base model carries one LoRA page table per targeted linear layer:
`lora_A: [n_slots, max_rank, in]`, `lora_B: [n_slots, out, max_rank]` and a per-slot
`scaling = alpha / rank`. Every sample of a batch names its slot (`-1`: base only), so
samples of different adapters share one forward and one backward:

    names = inject_multi_lora(model, n_slots=4, max_rank=8, target_modules="all-linear")
    init_slot(model, 0, rank=8, alpha=16)
    with use_slots(model, [0, 0, -1, 2]):
        logits = model(input_ids_BT).logits

The delta of each layer is computed either per slot segment (one pair of GEMMs per slot
present in the batch; best for the long, slot-sorted sequences of training) or grouped:
the rows are gathered into one [slot, rows, features] block per present adapter and run
through one pair of batched GEMMs against the adapters' A and B, read in place (best for
unsorted batches and sorted ones of equal counts, which run base and delta as one autograd
node: `miles.lora.grouped`), or stacked: every slot up to the
highest present one as one wide LoRA, each row scaled on its own slot's columns (three
ops whatever the mix: best for decode steps with a few rows), or jagged: the rows sorted
by slot through one grouped GEMM pair against each slot's own A and B
(`torch._grouped_mm`: decode steps with many rows, where the stacked path's work on the
other slots' columns dominates), or row-wise: one call of a C kernel that runs each row
through its own slot's A and B only (`miles.lora.rowwise`: float32 decode steps on
CPU, where it is built). All give the same numbers.
Everything that depends only on the batch (row grouping, per-row scale) is computed once
per batch in `SlotBatch`, and `use_slots` keeps one per distinct slot list, so that the
steps of a decode loop share it; each layer keeps the operands of its last no-grad stacked,
jagged or row-wise step (`miles.lora.decode_plan`) while the batch and its weights stay the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch
from torch import nn

from miles.lora.decode_plan import DecodePlan, jagged_step, kept, rowwise_step, stacked_step
from miles.lora.grouped import GroupedLoRALinear
from miles.lora.rowwise import RowwiseKernel, plan_arguments, rowwise_kernel

DeltaMode = Literal["auto", "segment", "gather", "stacked", "jagged", "rowwise"]

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
JAGGED_MIN_SAVED_MACS = 1_500_000
"""A decode step takes the jagged path when the stacked one would spend at least this many
multiply-adds per layer on other slots' columns (rows x (M - 1) x max_rank x (in + out)):
about what the grouped GEMMs' fixed cost buys on a CPU core (measured: 16 rows of 8
adapters on a 128-wide layer stay stacked, 64 rows or a 576-wide layer go jagged)."""

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
                scale_cols_BC = _scale_columns(values, present, batch_scales, max_rank).to(device)
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


def _scale_columns(values: list[int], present: tuple[int, ...], scales: Sequence[float], max_rank: int) -> torch.Tensor:
    """[B, M * max_rank]: row b holds its slot's scale on that slot's columns, 0 elsewhere."""
    n_cols = (present[-1] + 1) * max_rank
    out = torch.zeros(len(values), n_cols, dtype=torch.float32)
    scale_of = dict(zip(present, scales))
    for row, slot in enumerate(values):
        if slot >= 0:
            out[row, slot * max_rank : (slot + 1) * max_rank] = scale_of[slot]
    return out


# One mapping per context (thread or asyncio task): id of a multi-LoRA layer -> the
# batch being run. Keyed per layer object so that two models (or a deep copy) never
# see each other's slots. Never mutated: `use_slots` and `restore_routing` set a new one
# (the default, no routing at all, is read-only).
_ACTIVE: contextvars.ContextVar[Mapping[int, SlotBatch]] = contextvars.ContextVar(
    "miles_lora_slots", default=MappingProxyType({})
)


class MultiLoRALinear(nn.Module):
    """A frozen `nn.Linear` plus a LoRA page table with one row per slot.

    `lora_A[s, :r]` and `lora_B[s, :, :r]` hold slot s's adapter of rank r; the rest of
    the row stays zero. Slots that were never initialised have scaling 0 and rank 0.
    """

    def __init__(self, base: nn.Linear, *, n_slots: int, max_rank: int):
        super().__init__()
        if n_slots <= 0 or max_rank <= 0:
            raise ValueError(f"n_slots and max_rank must be > 0, got n_slots={n_slots}, max_rank={max_rank}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        weight = base.weight
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A = nn.Parameter(torch.zeros(n_slots, max_rank, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(n_slots, base.out_features, max_rank, **factory))
        # fp32 whatever the weights' dtype: alpha / rank must not round to bf16.
        self.register_buffer("scaling", torch.zeros(n_slots, device=weight.device, dtype=torch.float32),
                             persistent=False)
        self.ranks: list[int] = [0] * n_slots
        self.alphas: list[float] = [0.0] * n_slots
        self.delta_mode: DeltaMode = "auto"
        self.jagged_min_saved_macs: float = JAGGED_MIN_SAVED_MACS
        """Where "auto" turns decode steps from stacked to jagged (inf: never)."""
        self.rowwise_decode: bool = True
        """"auto" runs decode steps through the row-wise C kernel where it is built (False: the torch paths)."""
        # Layouts derived from the weights for the no-grad paths, kept while the weight is
        # unchanged (`kept`: every in-place write, e.g. set_slot or an optimizer step through
        # `detach()`, bumps its version): B as [n_slots * max_rank, out] (stacked, row-wise) and
        # A as [n_slots, in, max_rank] (row-wise).
        self._stacked_b_cache: tuple[tuple, torch.Tensor] | None = None
        self._rowwise_a_cache: tuple[tuple, torch.Tensor] | None = None
        self.slot_scales: tuple[float, ...] = (0.0,) * n_slots
        """alpha / rank of every slot (0 when empty), as a tuple a batch compares at C speed."""
        self._decode_plan: DecodePlan | None = None
        """What the last no-grad stacked step used (A's transpose, per-row scale, stacked B),
        reused while the batch, the weights and the input shape stay the same."""

    @property
    def n_slots(self) -> int:
        return self.lora_A.shape[0]

    @property
    def max_rank(self) -> int:
        return self.lora_A.shape[1]

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def extra_repr(self) -> str:
        return f"n_slots={self.n_slots}, max_rank={self.max_rank}, delta_mode={self.delta_mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = _ACTIVE.get().get(id(self))
        if batch is None or not batch.present:
            return self.base(x)
        plan = self._decode_plan
        if plan is not None and plan.fits(self, x, batch):
            return plan.step(x, self.base(x))  # a decode step like the last one: its ops, nothing else
        if x.shape[0] != batch.batch_size:
            raise ValueError(
                f"use_slots gave {batch.batch_size} slot ids but the layer input has batch size "
                f"{x.shape[0]}: pass one slot id per sample (row of input_ids)"
            )
        mode = self._pick_mode(x, batch)
        if mode == "gather" and batch.grouped_in_place and self._frozen_base_of_dtype(x.dtype):
            return self._grouped_linear(x, batch)
        out = self.base(x)
        if mode == "rowwise":
            return self._add_rowwise_delta(out, x, batch)
        if mode == "jagged":
            return self._add_jagged_delta(out, x, batch)
        if mode == "stacked":
            return self._add_stacked_delta(out, x, batch)
        if mode == "gather":
            return self._add_gather_delta(out, x, batch)
        return out + self._segment_delta(x, batch).to(out.dtype)

    def _pick_mode(self, x: torch.Tensor, batch: SlotBatch) -> DeltaMode:
        if self.delta_mode != "auto":
            return self.delta_mode
        if batch.single_slot is not None:
            return "segment"
        tokens_per_sample = x.shape[1] if x.dim() == 3 else 1
        # Decode steps of several adapters. On CPU in float32, the row-wise C kernel: each
        # row's own slot only, one call. Otherwise, with a handful of rows the cost is the
        # number of ops: the stacked path is three (GEMM, scale, GEMM) whatever the mix, but
        # computes every slot up to the highest present one for every row. Past
        # JAGGED_MIN_SAVED_MACS of that waste, one grouped GEMM pair over each slot's own rows
        # is cheaper.
        if tokens_per_sample == 1:
            if self.rowwise_decode and not _training(self) and self._rowwise_kernel(x) is not None:
                return "rowwise"
            wasted = batch.batch_size * batch.present[-1] * self.max_rank * (self.in_features + self.out_features)
            if HAS_GROUPED_MM and wasted >= self.jagged_min_saved_macs and not _training(self):
                return "jagged"
            return "stacked"
        # Unsorted batches and sorted batches with equal slot counts (a reshape, no copy):
        # one batched GEMM pair beats a GEMM pair (and a scatter) per slot. Sorted batches
        # of unequal counts favour contiguous segments: no row copies, no padding.
        return "gather" if batch.runs is None or batch.grouped_in_place else "segment"

    def _add_stacked_delta(self, out: torch.Tensor, x: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """`out` plus the delta of every slot up to the highest present one as one wide
        LoRA: x @ [A_0; ..; A_M-1]^T, each row's scale on its own slot's columns (0 on the
        others), then @ the stacked B, added in the same GEMM.

        M * max_rank columns of work per row instead of rank, but three ops and no row or
        weight copies (B's stacked transpose is kept between calls while B is unchanged
        and not being trained): the best path for decode steps, whose GEMMs have a few rows.
        """
        n_cols = (batch.present[-1] + 1) * self.max_rank
        scale_BC = batch.scale_cols_BC
        if scale_BC is None or batch.slot_scales != self.slot_scales:
            scale_BC = _scale_columns(batch.slot_ids_B.tolist(), batch.present, [self._scale(s) for s in batch.present],
                                      self.max_rank).to(x.device)
        a_CI = self.lora_A.reshape(-1, self.in_features)[:n_cols]
        x_NI = x.reshape(-1, self.in_features).to(a_CI.dtype)
        rows_per_sample = x_NI.shape[0] // batch.batch_size
        if rows_per_sample != 1:
            scale_BC = scale_BC.repeat_interleave(rows_per_sample, dim=0)
        h_NC = ((x_NI @ a_CI.transpose(0, 1)) * scale_BC).to(a_CI.dtype)
        b_CO = self._stacked_b()[:n_cols]
        out_NO = out.reshape(-1, self.out_features)
        if out_NO.dtype == h_NC.dtype:
            if rows_per_sample == 1 and x.dtype == a_CI.dtype and not _training(self):
                self._decode_plan = DecodePlan(self, x, batch, functools.partial(
                    stacked_step, a_CI.detach().transpose(0, 1), scale_BC, b_CO, self.in_features))
            return torch.addmm(out_NO, h_NC, b_CO).reshape(out.shape)
        return out + (h_NC @ b_CO).to(out.dtype).reshape(out.shape)

    def _stacked_b(self) -> torch.Tensor:
        """B of every slot as [n_slots * max_rank, out]: row s * max_rank + k is B[s, :, k]."""
        b = self.lora_B
        if _training(self):
            return b.transpose(1, 2).reshape(-1, self.out_features)
        self._stacked_b_cache = kept(self._stacked_b_cache, b,
                                      lambda w: w.transpose(1, 2).reshape(-1, self.out_features).contiguous())
        return self._stacked_b_cache[1]

    def _add_jagged_delta(self, out: torch.Tensor, x: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """`out` plus the delta of every row from its own slot only: the rows sorted by slot
        (a gather, unless they already are), one grouped GEMM against the slots' A and one
        against their B (`torch._grouped_mm`, both read in place), each row scaled in
        between, added back in place. No grad: for decode steps with many rows, where the
        stacked path's work on every slot's columns outgrows its saving in ops.
        """
        if x.shape[1:-1].numel() != 1 or _training(self):
            raise ValueError("the jagged delta runs decode steps only: one token per sample, no grad")
        n_slots = batch.present[-1] + 1
        scale_N1 = batch.jagged_scale_N1
        if scale_N1 is None or batch.slot_scales != self.slot_scales:
            slots_N = batch.slot_ids_B.index_select(0, batch.jagged_rows_N)
            scale_N1 = self.scaling.index_select(0, slots_N)[:, None]
        a_MIR = self.lora_A.detach()[:n_slots].transpose(1, 2)
        b_MRO = self.lora_B.detach()[:n_slots].transpose(1, 2)
        step = functools.partial(jagged_step, batch.jagged_rows_N, batch.jagged_offs_M, batch.jagged_in_order,
                                 a_MIR, scale_N1.to(a_MIR.dtype), b_MRO, self.in_features)
        if x.dtype == a_MIR.dtype and out.dtype == a_MIR.dtype:
            self._decode_plan = DecodePlan(self, x, batch, step)
            return step(x, out)
        return out + step(x.to(a_MIR.dtype), out.new_zeros(out.shape, dtype=a_MIR.dtype)).to(out.dtype)

    def _rowwise_kernel(self, x: torch.Tensor) -> RowwiseKernel | None:
        """The C kernel where it can run this step: float32 on CPU, and built (`rowwise_kernel`)."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or self.lora_A.dtype != torch.float32:
            return None
        return rowwise_kernel()

    def _add_rowwise_delta(self, out: torch.Tensor, x: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """`out` plus the delta of every row from its own slot only, in one C call
        (`miles.lora.rowwise`): rank x (in + out) multiply-adds a row, rows taken in
        slot order so that each slot's A and B are read once per step. No grad, float32 on CPU:
        decode steps, where the torch paths either compute every slot for every row (stacked)
        or pay a GEMM call per slot (jagged)."""
        kernel = self._rowwise_kernel(x)
        if kernel is None or x.shape[1:-1].numel() != 1 or _training(self):
            raise ValueError("the row-wise delta runs float32 CPU decode steps only (one token per sample, no "
                             "grad), with the kernel built")
        ids_B = batch.slot_ids_B
        scale_B = self.scaling.index_select(0, ids_B.clamp(min=0)) * (ids_B >= 0)
        a_SIR, b_SRO = self._rowwise_a(), self._stacked_b().view(self.n_slots, self.max_rank, self.out_features)
        fixed = plan_arguments(a_SIR, b_SRO, ids_B, scale_B, batch.jagged_rows_N)
        # The plan holds the tensors behind those pointers, so they live as long as it does.
        step = functools.partial(rowwise_step, kernel, fixed, (a_SIR, b_SRO, ids_B, scale_B, batch))
        self._decode_plan = DecodePlan(self, x, batch, step)
        return step(x, out)

    def _rowwise_a(self) -> torch.Tensor:
        """A of every slot transposed, [n_slots, in, max_rank], kept while A is unchanged."""
        self._rowwise_a_cache = kept(self._rowwise_a_cache, self.lora_A, lambda w: w.transpose(1, 2).contiguous())
        return self._rowwise_a_cache[1]

    def _slot_delta(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        rank = self.ranks[slot]
        a = self.lora_A[slot, :rank]
        b = self.lora_B[slot, :, :rank]
        x = x.to(a.dtype)
        # A Python float scales like PEFT does (exact, no device sync).
        return (x @ a.transpose(0, 1)) @ b.transpose(0, 1) * (self.alphas[slot] / rank if rank else 0.0)

    def _segment_delta(self, x: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        if batch.single_slot is not None:
            return self._slot_delta(x, batch.single_slot)
        if batch.runs is not None:
            # Sorted batches (the trainer sorts by slot): contiguous slices, no scatter.
            pieces = []
            for (slot, _), segment in zip(batch.runs, x.split([n for _, n in batch.runs])):
                if slot < 0:
                    pieces.append(segment.new_zeros((*segment.shape[:-1], self.out_features), dtype=self.lora_B.dtype))
                else:
                    pieces.append(self._slot_delta(segment, slot))
            return torch.cat(pieces)
        delta = x.new_zeros((*x.shape[:-1], self.out_features), dtype=self.lora_B.dtype)
        for slot in batch.present:
            rows = batch.rows[slot].to(x.device)
            delta = delta.index_add(0, rows, self._slot_delta(x.index_select(0, rows), slot))
        return delta

    def _add_gather_delta(self, out: torch.Tensor, x: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """`out` plus the LoRA delta, rows grouped per present slot: one pair of batched GEMMs
        over the slots' A and B.

        A and B are read in place (a slice when the present slots are 0..P-1, else one
        copy per present adapter, never per sample). Rows past a slot's rank are zero, so
        the full max_rank product equals the rank-sliced one. The per-row scale goes on the
        [P, N, rank] product, not the wider delta. Batches already grouped (a slot-sorted
        training batch) whose input, base and LoRA share one dtype take `_grouped_linear`;
        of mixed dtypes, the second GEMM adds straight into `out` (baddbmm).
        """
        n_present = len(batch.present)
        a_PRI, b_POR = self._present_weights(batch)
        scale_PG = self._group_scale(batch)
        group = batch.group_rows_PG.shape[1]
        x = x.to(a_PRI.dtype)
        lead = x.shape[1:-1]  # (T,) for [B, T, in] inputs, () for [B, in]
        tokens = math.prod(lead)
        if not batch.grouped_in_place:
            x = x.index_select(0, batch.group_rows_PG.reshape(-1))
        x_PNI = x.reshape(n_present, group * tokens, -1)
        h_PGTR = torch.bmm(x_PNI, a_PRI.transpose(1, 2)).reshape(n_present, group, tokens, -1)
        h_PNR = (h_PGTR * scale_PG[:, :, None, None].to(h_PGTR.dtype)).reshape(n_present, group * tokens, -1)
        if batch.grouped_in_place and out.dtype == h_PNR.dtype:
            out_PNO = out.reshape(n_present, group * tokens, -1)
            return torch.baddbmm(out_PNO, h_PNR, b_POR.transpose(1, 2)).reshape(out.shape)
        delta = torch.bmm(h_PNR, b_POR.transpose(1, 2)).reshape(n_present * group, *lead, -1)
        if not batch.grouped_in_place:
            delta = delta.index_select(0, batch.row_place_B)
        return out + delta.to(out.dtype)

    def _grouped_linear(self, x: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """Base and delta of a batch already in the grouped layout as one autograd node
        (`GroupedLoRALinear`): fewer ops in the forward and the backward, no copy of the
        base output."""
        a_PRI, b_POR = self._present_weights(batch)
        scale_P = self._group_scale(batch)[:, 0]  # in place: every place of a slot holds a row
        x_PNI = x.reshape(len(batch.present), -1, x.shape[-1])
        out_PNO = GroupedLoRALinear.apply(x_PNI, self.base.weight, self.base.bias, a_PRI, b_POR, scale_P.to(x.dtype))
        return out_PNO.view(*x.shape[:-1], -1)

    def _frozen_base_of_dtype(self, dtype: torch.dtype) -> bool:
        weight = self.base.weight
        return dtype == weight.dtype == self.lora_A.dtype and not weight.requires_grad and \
            (self.base.bias is None or not self.base.bias.requires_grad)

    def _present_weights(self, batch: SlotBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A and B of the batch's present slots: a slice when they are 0..P-1, else one
        copy per present adapter (never per sample)."""
        n_present = len(batch.present)
        if batch.present == tuple(range(n_present)):
            return self.lora_A[:n_present], self.lora_B[:n_present]
        return self.lora_A.index_select(0, batch.present_P), self.lora_B.index_select(0, batch.present_P)

    def _group_scale(self, batch: SlotBatch) -> torch.Tensor:
        """[P, G]: each place's alpha / rank (0 at padding), the batch's own when its
        scales are this layer's."""
        if batch.scale_PG is None or batch.slot_scales != self.slot_scales:
            return batch.valid_PG * self.scaling.index_select(0, batch.present_P)[:, None]
        return batch.scale_PG

    def _sync_scales(self) -> None:
        self.slot_scales = tuple(self._scale(s) for s in range(self.n_slots))

    def _scale(self, slot: int) -> float:
        rank = self.ranks[slot]
        return self.alphas[slot] / rank if rank else 0.0

    # ---- per-slot state (no autograd: these are weight loads, not training steps) ----

    @torch.no_grad()
    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor, *, alpha: float) -> None:
        """Write slot `slot`: `a` is [rank, in], `b` is [out, rank]; the rest is zeroed."""
        rank = a.shape[0]
        if a.shape != (rank, self.in_features) or b.shape != (self.out_features, rank):
            raise ValueError(
                f"LoRA shapes do not fit this layer: expected A [rank, {self.in_features}] and "
                f"B [{self.out_features}, rank], got A {list(a.shape)} and B {list(b.shape)}"
            )
        check_rank(rank, self.max_rank)
        if rank < self.max_rank:  # only the padding past the rank: the copies write the rest
            self.lora_A[slot, rank:].zero_()
            self.lora_B[slot, :, rank:].zero_()
        self.lora_A[slot, :rank].copy_(a)
        self.lora_B[slot, :, :rank].copy_(b)
        self.scaling[slot] = alpha / rank
        self.ranks[slot] = rank
        self.alphas[slot] = float(alpha)
        self._sync_scales()

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.scaling[slot] = 0.0
        self.ranks[slot] = 0
        self.alphas[slot] = 0.0
        self._sync_scales()

    def slot_tensors(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Detached CPU copies of slot `slot`'s A [rank, in] and B [out, rank]."""
        rank = self.ranks[slot]
        a = self.lora_A[slot, :rank].detach().to("cpu", copy=True)
        b = self.lora_B[slot, :, :rank].detach().to("cpu", copy=True)
        return a.contiguous(), b.contiguous()


def _training(layer: MultiLoRALinear) -> bool:
    """Autograd records this forward: the LoRA weights are read in place, never from a copy."""
    return torch.is_grad_enabled() and (layer.lora_A.requires_grad or layer.lora_B.requires_grad)


def check_rank(rank: int, max_rank: int) -> None:
    """ValueError unless an adapter of `rank` fits a slot `max_rank` wide."""
    if not 0 < rank <= max_rank:
        raise ValueError(f"LoRA rank {rank} does not fit the slot width: need 0 < rank <= max_rank={max_rank}")


# --------------------------------------------------------------------------------------
# Injection and lookup
# --------------------------------------------------------------------------------------


def resolve_targets(target_modules: str | Sequence[str]) -> set[str] | None:
    """None means all-linear; otherwise the set of module short names to wrap."""
    if isinstance(target_modules, str):
        if target_modules.strip() == "all-linear":
            return None
        names = [n.strip() for n in target_modules.split(",")]
    else:
        names = [str(n).strip() for n in target_modules]
    names = [n for n in names if n]
    if not names:
        raise ValueError("target_modules is empty: give 'all-linear' or names such as 'q_proj,v_proj'")
    return set(names)


def _decoder_layers_prefix(model: nn.Module) -> str:
    """Name prefix of the decoder blocks ("model.layers." for HF Llama/Qwen2)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers"):
            return name + "."
    raise ValueError("no decoder layers (an nn.ModuleList named '...layers') found: is this a Hugging Face causal LM?")


UNEMBED_TARGET = "lm_head"
"""The target name of the unembedding (the output embeddings, PEFT's name for them too)."""


def split_unembed(target_modules: str | Sequence[str]) -> tuple[str | list[str], bool]:
    """(the decoder layers' targets, whether the unembedding is targeted too) of a
    `target_modules` that may name `lm_head` beside them ("all-linear,lm_head")."""
    names = [n.strip() for n in (target_modules.split(",") if isinstance(target_modules, str) else target_modules)]
    unembed = UNEMBED_TARGET in names
    rest = [n for n in names if n and n != UNEMBED_TARGET]
    if rest == ["all-linear"]:
        return "all-linear", unembed
    return rest, unembed


def inject_multi_lora(
    model: nn.Module, *, n_slots: int, max_rank: int, target_modules: str | Sequence[str]
) -> list[str]:
    """Wrap the targeted linear layers in place; return their names.

    `target_modules` is "all-linear" (every nn.Linear inside the decoder layers, never
    lm_head or embeddings), a comma string or a list of module short names, any of which
    may add `lm_head`: the unembedding (the model's output embeddings, a plain linear, tied
    to the input embeddings or not) gets a slot LoRA as well ("all-linear,lm_head"). Base
    weights are frozen; every slot starts empty (A = B = 0, scaling 0).
    """
    if lora_modules(model):
        raise ValueError("model already has multi-LoRA layers: inject_multi_lora must be called once")
    decoder_targets, unembed = split_unembed(target_modules)
    head = model.get_output_embeddings() if unembed else None  # type: ignore[operator]
    if unembed and type(head) is not nn.Linear:
        raise ValueError(f"lm_head LoRA needs the model's output embeddings to be a plain nn.Linear, "
                         f"not {type(head).__name__}: leave out lm_head (--lora-unembed)")
    targets = resolve_targets(decoder_targets) if decoder_targets or not unembed else set()
    prefix = _decoder_layers_prefix(model)
    chosen = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.startswith(prefix)
        and (targets is None or name.rsplit(".", 1)[-1] in targets)
    ]
    if head is not None:
        chosen.append(next(name for name, module in model.named_modules() if module is head))
    if targets:
        missing = targets - {name.rsplit(".", 1)[-1] for name in chosen}
        if missing:
            raise ValueError(f"target_modules {sorted(missing)} match no nn.Linear in the decoder layers of this model")
    for p in model.parameters():
        p.requires_grad_(False)
    _LAYERS.pop(model, None)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, MultiLoRALinear(getattr(parent, child), n_slots=n_slots, max_rank=max_rank))
    return chosen


def lora_modules(model: nn.Module) -> dict[str, MultiLoRALinear]:
    """Every multi-LoRA layer of `model`, by module name (the name of the wrapped linear)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MultiLoRALinear)}


def slot_parameters(model: nn.Module) -> list[nn.Parameter]:
    """All lora_A / lora_B parameters (every slot) in module order."""
    params: list[nn.Parameter] = []
    for module in lora_modules(model).values():
        params.extend([module.lora_A, module.lora_B])
    return params


def set_delta_mode(model: nn.Module, mode: DeltaMode) -> None:
    """Force the segment, gather (grouped), stacked, jagged or row-wise path for every layer
    ("auto" picks per batch)."""
    if mode not in ("auto", "segment", "gather", "stacked", "jagged", "rowwise"):
        raise ValueError(f"delta mode must be 'auto', 'segment', 'gather', 'stacked', 'jagged' or 'rowwise', "
                         f"got {mode!r}")
    for module in require_lora(model).values():
        module.delta_mode = mode


def require_lora(model: nn.Module) -> dict[str, MultiLoRALinear]:
    """The model's multi-LoRA layers by module name; ValueError when it has none."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("model has no multi-LoRA layers: call inject_multi_lora(model, ...) first")
    return modules


@contextlib.contextmanager
def use_slots(model: nn.Module, slot_ids: Sequence[int] | torch.Tensor) -> Iterator[SlotBatch]:
    """Route sample i of the batches run inside the block through slot `slot_ids[i]`.

    `-1` means base model only. Outside any block the model is the base model. Nested
    blocks (and other threads or asyncio tasks) see their own slots; the previous
    routing is restored on exit. A layer recomputed in the backward keeps the routing of
    its forward (`active_routing`), so `backward()` may run outside the block.
    """
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = tuple(require_lora(model).values())
    first = layers[0]
    ids = slot_ids.reshape(-1).tolist() if isinstance(slot_ids, torch.Tensor) else slot_ids
    batch = _slot_batch(tuple(ids), first.lora_A.device, first.slot_scales, first.max_rank)
    for slot in batch.present:
        if slot >= first.n_slots:
            raise ValueError(f"slot {slot} does not exist: "
                             f"the page table has {first.n_slots} slots (0..{first.n_slots - 1})")
    token = _ACTIVE.set({**_ACTIVE.get(), **dict.fromkeys(map(id, layers), batch)})
    try:
        yield batch
    finally:
        _ACTIVE.reset(token)


def active_routing() -> Mapping[int, SlotBatch]:
    """The slot routing in effect here (what the enclosing `use_slots` blocks set), for
    `restore_routing` to put back later: a layer recomputed in the backward
    (`miles.backends.torch.recompute`) must see the slots of its first forward, whichever
    thread and context the autograd engine runs it in."""
    return _ACTIVE.get()


@contextlib.contextmanager
def restore_routing(routing: Mapping[int, SlotBatch]) -> Iterator[None]:
    """Run the block with `routing` (from `active_routing`) in effect."""
    token = _ACTIVE.set(routing)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# The multi-LoRA layers of a model, found once (a decode step must not walk the module tree).
_LAYERS: weakref.WeakKeyDictionary[nn.Module, tuple[MultiLoRALinear, ...]] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=256)
def _slot_batch(slot_ids: tuple[int, ...], device: torch.device, scales: tuple[float, ...], max_rank: int) -> SlotBatch:
    """One `SlotBatch` per distinct batch: decode steps repeat the same slots step after
    step, and the batch (routing, per-row scales) depends on nothing else."""
    return SlotBatch.build(slot_ids, device, scales=scales, max_rank=max_rank)
