"""The optimizer step of a set of adapters on a train rank: their gradients summed over the
data-parallel replicas, scaled, clipped by each slot's own norm, and applied to those slots only.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles.backends.base import AdapterSpec, AdapterStepStats
from miles.backends.common.optimizer import SlotStep
from miles.backends.rank.adapters import SlotAdapters
from miles.backends.rank.take_back import TakeBack
from miles.utils.types.client import AdamStep


def _slot_step(spec: AdapterSpec, lr: float, adam: AdamStep | None) -> SlotStep:
    """An adapter's part of a fused step: its schedule's lr and batch scale, or its `AdamStep`."""
    if adam is None:
        return SlotStep(slot=spec.slot, lr=lr, grad_scale=1.0 / spec.global_batch_size)
    return SlotStep(slot=spec.slot, lr=adam.learning_rate, grad_scale=1.0, betas=(adam.beta1, adam.beta2),
                    eps=adam.eps, weight_decay=adam.weight_decay, max_norm=adam.grad_clip_norm)


class AdapterSteps:
    """Steps of the loaded adapters' slots (a rank counts no steps: the registry does)."""

    def __init__(self, adapters: SlotAdapters, take_back: TakeBack) -> None:
        self.adapters = adapters
        self.take_back = take_back

    def step(self, names: Sequence[str], adam: dict[str, AdamStep] | None = None) -> dict[str, AdapterStepStats]:
        """Optimizer step of the given adapters only; every rank must call it with the same names.

        A server-driven adapter steps with its LR schedule, its gradient scaled by
        `1 / global_batch_size` and clipped by `--clip-grad`; one given an `AdamStep` in
        `adam` (a client's `optim_step`) with that step's lr, betas, eps, weight decay and
        clip norm (0: none), its gradient unscaled (Tinker's losses are sums), and no schedule.
        """
        adam = adam or {}
        unknown = sorted(set(adam) - set(names))
        if unknown:
            raise ValueError(f"Adam settings given for {unknown}, "
                             f"which are not among the adapters to step {sorted(names)}")
        loaded = [self.adapters.loaded(name) for name in sorted(names)]
        self.take_back.keep()  # a batch that stepped is kept
        model, optimizer = self.adapters.model, self.adapters.optimizer
        slots = [a.spec.slot for a in loaded]
        if slots:
            model.reduce_grads([g for slot in slots for g in optimizer.slot_grads(slot)])
        lrs = {a.spec.name: adam[a.spec.name].learning_rate if a.spec.name in adam else a.schedule.begin_step()
               for a in loaded}
        norms = optimizer.step_slots(
            [_slot_step(a.spec, lrs[a.spec.name], adam.get(a.spec.name)) for a in loaded],
            max_norm=self.adapters.config.clip_grad, slot_norm=model.slot_grad_norm,
        )
        for a in loaded:
            a.adam = adam.get(a.spec.name, a.adam)
        return {a.spec.name: AdapterStepStats(grad_norm=norms[a.spec.slot], lr=lrs[a.spec.name]) for a in loaded}
