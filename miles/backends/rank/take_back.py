"""The take-back of a rank's latest train call: its gradients and LR clock advances are
held until an adapter steps, so a call that failed (on this rank or any other of the
group) counts nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from miles.backends.common.optimizer import SlotAdamW
from miles.backends.rank.adapters import SlotAdapters


@dataclass
class _BatchUndo:
    """What the latest train call changed, so it can be taken back until a step."""

    grads: dict[int, list[Tensor] | None]
    """Slot -> copies of its gradients before the call; None when they were all zero
    (the first call after a step: no copy is held, the undo zeroes them)."""
    samples_seen: dict[str, int]
    """Adapter -> its LR clock before the call."""


class TakeBack:
    """What the latest train call changed, until a step (or a load, or a cleanup) keeps it."""

    def __init__(self, adapters: SlotAdapters, optimizer: SlotAdamW) -> None:
        self.adapters = adapters
        self.optimizer = optimizer
        self._undo: _BatchUndo | None = None

    def remember(self, names: set[str]) -> None:
        """Before a train call of these adapters: their slots' gradients and LR clocks."""
        slots = sorted({self.adapters.loaded(name).spec.slot for name in names})
        grads = {slot: self.optimizer.slot_grads(slot) for slot in slots}
        nonzero = self._slots_with_grads(slots)
        self._undo = _BatchUndo(
            grads={slot: [g.clone() for g in grads[slot]] if slot in nonzero else None for slot in slots},
            samples_seen={name: self.adapters.loaded(name).schedule.samples_seen for name in names},
        )

    def keep(self) -> None:
        """The latest call counts for good (an adapter stepped, or a slot was loaded or emptied)."""
        self._undo = None

    def discard(self) -> None:
        """Take back the latest train call, unless it was kept since."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        for slot, saved in undo.grads.items():
            if saved is None:
                torch._foreach_zero_(self.optimizer.slot_grads(slot))
            else:
                torch._foreach_copy_(self.optimizer.slot_grads(slot), saved)
        for name, seen in undo.samples_seen.items():
            if name in self.adapters.by_name:
                self.adapters.by_name[name].schedule.samples_seen = seen

    def _slots_with_grads(self, slots: list[int]) -> set[int]:
        """Those of `slots` with a nonzero gradient: one check per parameter, not per slot."""
        if not slots or not self.optimizer.params:
            return set()
        nonzero_PS = torch.stack([_grad(param).flatten(1).any(dim=1) for param, _ in self.optimizer.params])
        nonzero_S = nonzero_PS.any(dim=0).tolist()
        return {slot for slot in slots if nonzero_S[slot]}


def _grad(param: Tensor) -> Tensor:
    """A LoRA parameter's gradient (`SlotAdamW.slot_grads` allocated it, in `remember`)."""
    assert param.grad is not None, "a LoRA parameter without a gradient buffer"
    return param.grad
