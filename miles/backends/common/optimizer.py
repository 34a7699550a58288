"""AdamW with one independent optimizer per row of slot-dimensioned parameters.

Every LoRA parameter of the page table has the slot as its first dimension
(`A: [n_slots, r_max, in]`, `B: [n_slots, out, r_max]`). `SlotAdamW` keeps one moment
tensor of the same shape per parameter, one step counter and one set of
hyper-parameters per slot. Stepping slot `s` reads and writes only row `s` of the
weights, moments and gradients, so an adapter's update never depends on its
co-tenants. Only the first `rank` components along each parameter's rank dimension are
ever updated; the padding stays exactly zero.

    opt = SlotAdamW([(layer.lora_A, 1), (layer.lora_B, 2)], n_slots=4)
    opt.configure_slot(2, rank=8, lr=1e-4, weight_decay=0.0)
    grad_norm = opt.clip_slot_grad(2, max_norm=1.0)
    opt.step_slot(2, lr=1e-4)
    opt.zero_slot_grad(2)

The update is torch's AdamW (decoupled weight decay, bias-corrected moments), run by
torch's fused AdamW kernel over the slot rows of every parameter at once. `step_slots` does
the whole step of several adapters (mask, scale, clip by each slot's own norm, AdamW,
zero the gradients) in one fused pass over all their rows:

    norms = opt.step_slots([SlotStep(slot=0, lr=1e-4, grad_scale=1 / 64), SlotStep(slot=2, lr=3e-4)], max_norm=1.0)

A step may carry its own AdamW settings (a Tinker `optim_step`'s `AdamParams`): betas, eps,
weight decay and clip norm, each None for the optimizer's betas and eps, the slot's weight
decay and the call's `max_norm`:

    opt.step_slots([SlotStep(slot=3, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, max_norm=0.0)], 1.0)

A slot may freeze some parameters (given by index in `params`): their rows of that slot
are never updated, nor their moments, and their gradient is dropped before the norm (a
Tinker model that trains only some of the LoRA layers):

    opt.configure_slot(1, rank=8, lr=1e-4, weight_decay=0.0, frozen={0, 1})   # layer 0's A and B

Where a slot's gradient is sharded over ranks (Megatron's tensor parallelism), its norm
is taken over every shard by the `slot_norm` it is given, and the slots step one by one:

    norms = opt.step_slots(steps, max_norm=1.0, slot_norm=norm_over_tensor_parallel_ranks)
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

SlotNorm = Callable[[list[Tensor]], Tensor]
"""The L2 norm (a 0-dim float32 tensor) of one slot's gradient given this rank's rows of it."""


@dataclass(frozen=True)
class SlotStep:
    """One slot's part of a fused step."""

    slot: int
    lr: float
    grad_scale: float = 1.0
    """The slot's gradient is multiplied by this before clipping (1 / global batch size)."""
    betas: tuple[float, float] | None = None
    """None: the optimizer's."""
    eps: float | None = None
    """None: the optimizer's."""
    weight_decay: float | None = None
    """Decoupled, as AdamW's; None: the slot's (`configure_slot`)."""
    max_norm: float | None = None
    """Clip norm of this slot's gradient (<= 0: no clipping); None: the call's `max_norm`."""


@dataclass
class SlotHyperParams:
    rank: int
    lr: float
    weight_decay: float
    frozen: frozenset[int] = frozenset()
    """Indices (in `params`) of the parameters this slot never updates."""


class SlotAdamW:
    """Per-slot AdamW over parameters whose dimension 0 is the slot."""

    def __init__(
        self,
        params: list[tuple[torch.nn.Parameter, int]],
        *,
        n_slots: int,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        """`params` are (parameter, rank dimension) pairs; dim 0 must be the slot."""
        for param, rank_dim in params:
            if param.shape[0] != n_slots:
                raise ValueError(f"parameter of shape {tuple(param.shape)} does not have {n_slots} slots in dim 0")
            if not 0 < rank_dim < param.dim():
                raise ValueError(f"rank dimension {rank_dim} is not a non-slot dimension of {tuple(param.shape)}")
        self.params = params
        self.n_slots = n_slots
        self.betas = betas
        self.eps = eps
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p, _ in params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p, _ in params]
        self.steps = [0] * n_slots
        self.hparams: dict[int, SlotHyperParams] = {}

    def configure_slot(self, slot: int, *, rank: int, lr: float, weight_decay: float,
                       frozen: Collection[int] = ()) -> None:
        """Give a slot its adapter's rank and hyper-parameters (moments untouched but those of
        `frozen`: indices of the parameters whose rows of this slot never change, their moments
        zero)."""
        self._check_slot(slot)
        unknown = sorted(i for i in frozen if not 0 <= i < len(self.params))
        if unknown:
            raise IndexError(f"frozen parameter indices {unknown} are outside 0..{len(self.params) - 1}")
        with torch.no_grad():
            for i in frozen:
                self.exp_avg[i][slot].zero_()
                self.exp_avg_sq[i][slot].zero_()
        self.hparams[slot] = SlotHyperParams(rank=rank, lr=lr, weight_decay=weight_decay, frozen=frozenset(frozen))

    def reset_slot(self, slot: int) -> None:
        """Forget a slot: zero its moments, step counter and retained gradients."""
        self._check_slot(slot)
        with torch.no_grad():
            for (param, _), m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
                m[slot].zero_()
                v[slot].zero_()
                if param.grad is not None:
                    param.grad[slot].zero_()
        self.steps[slot] = 0
        self.hparams.pop(slot, None)

    def slot_grads(self, slot: int) -> list[Tensor]:
        """Views of row `slot` of every gradient (allocated as zeros when missing)."""
        self._ensure_grads()
        return [_grad(param)[slot] for param, _ in self.params]

    def _ensure_grads(self) -> None:
        for param, _ in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    def mask_slot_grad(self, slot: int) -> None:
        """Zero the gradient outside the slot's rank (and of its frozen parameters) so padding never moves."""
        self._ensure_grads()
        self._mask(slot)

    def _mask(self, slot: int) -> None:
        hparams = self._hparams(slot)
        rank = hparams.rank
        for index, (param, rank_dim) in enumerate(self.params):
            if index in hparams.frozen:
                _grad(param)[slot].zero_()
            elif rank < param.shape[rank_dim]:
                _grad(param)[slot].narrow(rank_dim - 1, rank, param.shape[rank_dim] - rank).zero_()

    def scale_slot_grad(self, slot: int, factor: float) -> None:
        torch._foreach_mul_(self.slot_grads(slot), factor)

    def clip_slot_grad(self, slot: int, max_norm: float) -> float:
        """Clip row `slot` of the gradients by their joint L2 norm; returns the pre-clip norm.

        Same rule as `torch.nn.utils.clip_grad_norm_`; `max_norm <= 0` only measures.
        """
        return self._clip(self.slot_grads(slot), max_norm)

    @staticmethod
    def _clip(grads: list[Tensor], max_norm: float, slot_norm: SlotNorm | None = None) -> float:
        if slot_norm is None:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, dtype=torch.float32)))
        else:
            norm = slot_norm(grads)
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return float(norm)

    @torch.no_grad()
    def step_slot(self, slot: int, lr: float) -> None:
        """One AdamW step of row `slot` with learning rate `lr`."""
        self._hparams(slot)
        self.mask_slot_grad(slot)
        self._adamw_rows(slot, slot + 1, lr)

    @torch.no_grad()
    def step_slots(self, steps: list[SlotStep], max_norm: float, *,
                   slot_norm: SlotNorm | None = None) -> dict[int, float]:
        """The whole optimizer step of several slots in one fused pass; returns each slot's
        gradient norm (after `grad_scale`, before clipping).

        Per slot, in order: mask the gradient past the rank, multiply by `grad_scale`,
        clip by the slot's own norm (`max_norm <= 0`: no clipping), AdamW with `lr`, zero
        the gradient. Equal to calling `mask_slot_grad`, `scale_slot_grad`,
        `clip_slot_grad`, `step_slot` and `zero_slot_grad` per slot.

        Per parameter and run of consecutive slots, one norm and one multiply each for the
        scale and the clip; one fused AdamW kernel per run of slots with equal scalars.

        With `slot_norm` (this rank holds a shard of each slot's gradient; it returns the
        norm over every shard, a collective), the slots step one by one in the given order,
        that sequence with the clip taken by `slot_norm`.
        """
        if not steps:
            return {}
        slots = [s.slot for s in steps]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a fused step names a slot twice: {slots}")
        if slot_norm is not None:
            return {s.slot: self._step_sharded(s, max_norm, slot_norm) for s in steps}
        steps = sorted(steps, key=lambda s: s.slot)
        own_norms = any(s.max_norm is not None for s in steps)
        self._ensure_grads()
        for s in steps:
            self._mask(s.slot)
        # Consecutive stepping slots are one slice of every gradient: per parameter one
        # multiply and one norm for the whole run, not one per slot. The scale and the clip
        # stay two multiplies, so the numbers are the per-slot sequence's.
        runs = self._runs([s.slot for s in steps])
        grads = [[_grad(param)[start:stop] for param, _ in self.params] for start, stop in runs]
        lengths = [stop - start for start, stop in runs]
        scale_S = torch.tensor([s.grad_scale for s in steps], dtype=torch.float32, device=grads[0][0].device)
        for run_grads, scale_R in zip(grads, scale_S.split(lengths)):
            _mul_rows(run_grads, scale_R)
        norm_S = torch.cat([_row_norms(run_grads) for run_grads in grads])
        coef_S = None
        if own_norms:  # a slot's own clip norm; <= 0: a factor of exactly 1
            max_S = torch.tensor([max_norm if s.max_norm is None else s.max_norm for s in steps],
                                 dtype=torch.float32, device=norm_S.device)
            coef_S = torch.where(max_S > 0, torch.clamp(max_S / (norm_S + 1e-6), max=1.0), torch.ones_like(norm_S))
        elif max_norm > 0:
            coef_S = torch.clamp(max_norm / (norm_S + 1e-6), max=1.0)
        if coef_S is not None:
            for run_grads, coef_R in zip(grads, coef_S.split(lengths)):
                _mul_rows(run_grads, coef_R)
        for block in self._blocks(steps):
            self._adamw_rows(block[0].slot, block[-1].slot + 1, block[0].lr, **self._settings(block[0]))
        torch._foreach_zero_([g for run_grads in grads for g in run_grads])
        return dict(zip([s.slot for s in steps], norm_S.tolist()))

    def _step_sharded(self, step: SlotStep, max_norm: float, slot_norm: SlotNorm) -> float:
        self.mask_slot_grad(step.slot)
        self.scale_slot_grad(step.slot, step.grad_scale)
        norm = self._clip(self.slot_grads(step.slot), max_norm if step.max_norm is None else step.max_norm, slot_norm)
        self._adamw_rows(step.slot, step.slot + 1, step.lr, **self._settings(step))
        self.zero_slot_grad(step.slot)
        return norm

    def _settings(self, step: SlotStep) -> dict[str, float]:
        """The AdamW scalars of `step` besides its lr: its own, else the optimizer's and the slot's."""
        beta1, beta2 = self.betas if step.betas is None else step.betas
        return {"beta1": beta1, "beta2": beta2, "eps": self.eps if step.eps is None else step.eps,
                "weight_decay": self._hparams(step.slot).weight_decay if step.weight_decay is None
                else step.weight_decay}

    @staticmethod
    def _runs(slots: list[int]) -> list[tuple[int, int]]:
        """Sorted slots as (start, stop) runs of consecutive slots."""
        runs: list[tuple[int, int]] = []
        for slot in slots:
            if runs and runs[-1][1] == slot:
                runs[-1] = (runs[-1][0], slot + 1)
            else:
                runs.append((slot, slot + 1))
        return runs

    def _blocks(self, steps: list[SlotStep]) -> list[list[SlotStep]]:
        """Runs of consecutive slots whose AdamW scalars are equal (lr, betas, eps, weight
        decay, step count, frozen parameters): each run is updated as one slice of every
        parameter it trains."""
        blocks: list[list[SlotStep]] = []

        def key(s: SlotStep) -> tuple:
            return (s.lr, tuple(sorted(self._settings(s).items())), self.steps[s.slot],
                    self._hparams(s.slot).frozen)

        for s in steps:
            last = blocks[-1][-1] if blocks else None
            if last is not None and last.slot + 1 == s.slot and key(last) == key(s):
                blocks[-1].append(s)
            else:
                blocks.append([s])
        return blocks

    def _adamw_rows(self, start: int, stop: int, lr: float, *, beta1: float | None = None,
                    beta2: float | None = None, eps: float | None = None, weight_decay: float | None = None) -> None:
        """AdamW on rows start..stop-1 (gradients already masked), which share lr, betas, eps,
        weight decay and step count: torch's fused AdamW kernel, one call over every
        parameter but those the slots freeze. None: the optimizer's betas and eps, the slot's
        weight decay."""
        beta1 = self.betas[0] if beta1 is None else beta1
        beta2 = self.betas[1] if beta2 is None else beta2
        eps = self.eps if eps is None else eps
        weight_decay = self._hparams(start).weight_decay if weight_decay is None else weight_decay
        for slot in range(start, stop):
            self.steps[slot] += 1
        step = torch.tensor(float(self.steps[start]), device=self.params[0][0].device)
        frozen = self._hparams(start).frozen
        trained = [i for i in range(len(self.params)) if i not in frozen]
        if not trained:
            return
        weights = [self.params[i][0].detach()[start:stop] for i in trained]
        torch._fused_adamw_(
            weights,
            [_grad(self.params[i][0])[start:stop] for i in trained],
            [self.exp_avg[i][start:stop] for i in trained],
            [self.exp_avg_sq[i][start:stop] for i in trained],
            [],
            [step] * len(trained),
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
            amsgrad=False, maximize=False,
        )
        # The fused kernel writes without bumping the weights' version counters, which the
        # layers' cached layouts of A and B check: bump them here.
        increment_version(weights)

    def zero_slot_grad(self, slot: int) -> None:
        torch._foreach_zero_(self.slot_grads(slot))

    def slot_state(self, slot: int) -> tuple[list[Tensor], list[Tensor], int]:
        """Copies of row `slot` of the moments, and the slot's step counter."""
        return (
            [m[slot].clone() for m in self.exp_avg],
            [v[slot].clone() for v in self.exp_avg_sq],
            self.steps[slot],
        )

    @torch.no_grad()
    def load_slot_state(self, slot: int, exp_avg: list[Tensor], exp_avg_sq: list[Tensor], step: int) -> None:
        if len(exp_avg) != len(self.params) or len(exp_avg_sq) != len(self.params):
            raise ValueError(f"optimizer state holds {len(exp_avg)} moments, "
                             f"the model has {len(self.params)} LoRA parameters")
        for m_all, v_all, m, v in zip(self.exp_avg, self.exp_avg_sq, exp_avg, exp_avg_sq):
            m_all[slot].copy_(m)
            v_all[slot].copy_(v)
        self.steps[slot] = step

    def _hparams(self, slot: int) -> SlotHyperParams:
        self._check_slot(slot)
        if slot not in self.hparams:
            raise KeyError(f"slot {slot} has no adapter configured: call configure_slot first")
        return self.hparams[slot]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} is outside the page table (0..{self.n_slots - 1})")


def _grad(param: Tensor) -> Tensor:
    """`param.grad`, which `SlotAdamW._ensure_grads` allocates before any row of it is read."""
    grad = param.grad
    assert grad is not None, "a slot gradient read before SlotAdamW._ensure_grads allocated it"
    return grad


def _mul_rows(grads: list[Tensor], factor_R: Tensor) -> None:
    """Row r (dim 0) of every tensor in `grads` times `factor_R[r]`, in place."""
    for g in grads:
        g.mul_(factor_R.to(g.dtype).view(-1, *[1] * (g.dim() - 1)))


def _row_norms(grads: list[Tensor]) -> Tensor:
    """[R]: the L2 norm of each row (dim 0) over all of `grads`, in float32."""
    per_tensor = [torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim())), dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(per_tensor), dim=0)
