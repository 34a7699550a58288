"""The slot page-table LoRA linear layer.

One frozen base model carries one LoRA page table per targeted linear layer:
`lora_A: [n_slots, max_rank, in]`, `lora_B: [n_slots, out, max_rank]` and a per-slot
`scaling = alpha / rank`. Every sample of a batch names its slot (`-1`: base only;
`miles.lora.model.use_slots`), so samples of different adapters share one forward and one
backward. The layer holds the table and picks one delta strategy per batch
(`miles.lora.delta`); all give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from miles.lora.decode_plan import DecodePlan, LayoutKey, kept
from miles.lora.delta import STRATEGIES, DeltaMode
from miles.lora.delta.base import training
from miles.lora.delta.jagged import HAS_GROUPED_MM
from miles.lora.delta.rowwise import kernel_for
from miles.lora.routing import batch_of
from miles.lora.slot_batch import SlotBatch

JAGGED_MIN_SAVED_MACS = 1_500_000
"""A decode step takes the jagged path when the stacked one would spend at least this many
multiply-adds per layer on other slots' columns (rows x (M - 1) x max_rank x (in + out)):
about what the grouped GEMMs' fixed cost buys on a CPU core (measured: 16 rows of 8
adapters on a 128-wide layer stay stacked, 64 rows or a 576-wide layer go jagged)."""


class MultiLoRALinear(nn.Module):
    """A frozen `nn.Linear` plus a LoRA page table with one row per slot.

    `lora_A[s, :r]` and `lora_B[s, :, :r]` hold slot s's adapter of rank r; the rest of
    the row stays zero. Slots that were never initialised have scaling 0 and rank 0.
    """

    scaling: torch.Tensor
    """alpha / rank per slot (a buffer, fp32 whatever the weights' dtype: it must not round to bf16)."""

    def __init__(self, base: nn.Linear, *, n_slots: int, max_rank: int):
        super().__init__()
        if n_slots <= 0 or max_rank <= 0:
            raise ValueError(f"n_slots and max_rank must be > 0, got n_slots={n_slots}, max_rank={max_rank}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        weight = base.weight
        self.lora_A = nn.Parameter(torch.zeros(n_slots, max_rank, base.in_features, device=weight.device,
                                               dtype=weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(n_slots, base.out_features, max_rank, device=weight.device,
                                               dtype=weight.dtype))
        self.register_buffer("scaling", torch.zeros(n_slots, device=weight.device, dtype=torch.float32),
                             persistent=False)
        self.ranks: list[int] = [0] * n_slots
        self.alphas: list[float] = [0.0] * n_slots
        self.delta_mode: DeltaMode = "auto"
        self.jagged_min_saved_macs: float = JAGGED_MIN_SAVED_MACS
        """Where "auto" turns decode steps from stacked to jagged (inf: never)."""
        self.rowwise_decode: bool = True
        """"auto" runs decode steps through the row-wise C kernel where it is built (False: the torch paths)."""
        self._layouts: dict[str, tuple[LayoutKey, torch.Tensor]] = {}
        """Layouts the no-grad strategies derive from the weights (`kept_layout`)."""
        self.slot_scales: tuple[float, ...] = (0.0,) * n_slots
        """alpha / rank of every slot (0 when empty), as a tuple a batch compares at C speed."""
        self.decode_plan: DecodePlan | None = None
        """What the last no-grad stacked, jagged or row-wise step used, reused while the batch,
        the weights and the input shape stay the same."""

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
        batch = batch_of(self)
        if batch is None or not batch.present:
            return self.base(x)
        plan = self.decode_plan
        if plan is not None and plan.fits(self, x, batch):
            return plan.step(x, self.base(x))  # a decode step like the last one: its ops, nothing else
        if x.shape[0] != batch.batch_size:
            raise ValueError(
                f"use_slots gave {batch.batch_size} slot ids but the layer input has batch size "
                f"{x.shape[0]}: pass one slot id per sample (row of input_ids)"
            )
        return STRATEGIES[self._pick_mode(x, batch)](self, x, batch)

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
            if self.rowwise_decode and not training(self) and kernel_for(self, x) is not None:
                return "rowwise"
            wasted = batch.batch_size * batch.present[-1] * self.max_rank * (self.in_features + self.out_features)
            if HAS_GROUPED_MM and wasted >= self.jagged_min_saved_macs and not training(self):
                return "jagged"
            return "stacked"
        # Unsorted batches and sorted batches with equal slot counts (a reshape, no copy):
        # one batched GEMM pair beats a GEMM pair (and a scatter) per slot. Sorted batches
        # of unequal counts favour contiguous segments: no row copies, no padding.
        return "gather" if batch.runs is None or batch.grouped_in_place else "segment"

    def scale(self, slot: int) -> float:
        """alpha / rank of `slot` (0 when empty)."""
        rank = self.ranks[slot]
        return self.alphas[slot] / rank if rank else 0.0

    def kept_layout(self, name: str, weight: torch.Tensor, derive: Callable[[torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
        """`derive(weight)` kept under `name` while the weight is unchanged (`kept`: every in-place
        write, e.g. set_slot or an optimizer step through `detach()`, bumps its version)."""
        self._layouts[name] = kept(self._layouts.get(name), weight, derive)
        return self._layouts[name][1]

    def _sync_scales(self) -> None:
        self.slot_scales = tuple(self.scale(s) for s in range(self.n_slots))

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


def check_rank(rank: int, max_rank: int) -> None:
    """ValueError unless an adapter of `rank` fits a slot `max_rank` wide."""
    if not 0 < rank <= max_rank:
        raise ValueError(f"LoRA rank {rank} does not fit the slot width: need 0 < rank <= max_rank={max_rank}")
