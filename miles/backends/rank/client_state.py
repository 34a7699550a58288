"""A client-driven (Tinker) adapter's whole state on a train rank: its `save_state` and
`load_state`, and the page-out and page-in of an idle model (which also carry the gradient
of the calls not yet stepped and the LR clock, so it goes on exactly where it left its slot).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles.backends.common.checkpoint import TrainerState, read_checkpoint, read_pending_grad, write_checkpoint_dir
from miles.backends.common.lr_schedule import LRSchedule
from miles.backends.rank.adapters import SlotAdapters, trained_tensors
from miles.backends.rank.export import AdapterExport
from miles.backends.rank.take_back import TakeBack
from miles.lora import write_peft_dir


class ClientStates:
    """Saves and loads of a client adapter's weights, moments, step count and pending gradient."""

    def __init__(self, adapters: SlotAdapters, export: AdapterExport, take_back: TakeBack) -> None:
        self.adapters = adapters
        self.export = export
        self.take_back = take_back
        self.model = adapters.model
        self.optimizer = adapters.optimizer

    def save(self, name: str, directory: str, pending: dict[str, Tensor] | None = None) -> str:
        """A client's `save_state`: weights and optimizer state written to `directory` (the
        trainer state records the adapter's optimizer step count); '' on a rank that does not
        write. Every rank that `gathers` must call. `pending`: a page-out, which also writes the
        gradient of the calls not yet stepped (summed over every rank: `accumulated_grad`)."""
        a = self.adapters.loaded(name)
        spec = a.spec
        if not self.model.gathers:
            return ""
        tensors = trained_tensors(spec, self.model.export_slot(spec.slot))
        optimizer = self.export.optimizer_state(name)
        if not self.model.writes:
            return ""
        state = TrainerState(name=name, step=optimizer.step, registration_id=spec.registration_id, rank=spec.rank,
                             alpha=spec.alpha)
        path = write_checkpoint_dir(
            directory, write_adapter=lambda p: write_peft_dir(p, tensors, self.adapters.peft_config(spec)),
            optimizer=optimizer, scheduler=a.schedule.state_dict(), trainer_state=state, pending_grad=pending)
        return str(path)

    def load(self, name: str, directory: str, optimizer: bool = True) -> None:
        """A client's `load_state`: the checkpoint's weights into the adapter's slot, and its
        moments and step count when `optimizer` (else fresh ones); the pending gradient is
        dropped, unless the checkpoint is a page-out's: then its pending gradient and LR clock
        come back too, so the model goes on exactly where it left its slot. ValueError when it
        holds another rank or alpha than the adapter's."""
        spec = self.adapters.loaded(name).spec
        path = Path(directory)
        ckpt = read_checkpoint(path)
        if ckpt.trainer_state.rank != spec.rank or abs(ckpt.trainer_state.alpha - spec.alpha) > 1e-6:
            raise ValueError(f"checkpoint {path} holds a rank-{ckpt.trainer_state.rank} alpha-"
                             f"{ckpt.trainer_state.alpha} adapter but model '{name}' has rank {spec.rank} alpha "
                             f"{spec.alpha}: load it into a model created with the same rank")
        self.model.load_peft_dir(spec.slot, path)
        self.optimizer.reset_slot(spec.slot)  # moments, step count and pending gradient
        if optimizer:
            exp_avg = self.model.pad_slot_tensors(ckpt.optimizer.exp_avg, spec.slot, spec.rank, path,
                                                  "optimizer state")
            exp_avg_sq = self.model.pad_slot_tensors(ckpt.optimizer.exp_avg_sq, spec.slot, spec.rank, path,
                                                     "optimizer state")
            self.optimizer.load_slot_state(spec.slot, exp_avg, exp_avg_sq, ckpt.optimizer.step)
            pending = read_pending_grad(path)
            if pending is not None:
                self._restore_pending(name, path, pending, ckpt.scheduler)
        self.adapters.configure_slot(spec)  # after the loads: a frozen layer stays the base's whatever they held
        self.take_back.keep()

    def _restore_pending(self, name: str, path: Path, pending: dict[str, Tensor], scheduler: dict[str, Any]) -> None:
        """A page-out's gradient back into the slot (the first DP replica holds the whole sum, the
        others zeros, as a resume's part-window gradient) and its LR clock."""
        a = self.adapters.loaded(name)
        if self.model.dp_rank == 0:
            grads = self.model.pad_slot_tensors(pending, a.spec.slot, a.spec.rank, path, "pending gradient")
            torch._foreach_copy_(self.optimizer.slot_grads(a.spec.slot), grads)
        saved = LRSchedule.from_state_dict(scheduler)
        a.schedule = replace(a.schedule, samples_seen=saved.samples_seen,
                             samples_at_last_step=saved.samples_at_last_step)
