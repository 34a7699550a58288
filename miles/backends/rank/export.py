"""What leaves a train rank's slot: an adapter's LoRA tensors (for a push or an export), its
optimizer and schedule state, its share of the gradient toward its next step, and the
periodic checkpoint `{save}/checkpoints/step_{N}` made of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from miles.backends.common.checkpoint import AccumulatedGrad, OptimizerState, TrainerState, write_checkpoint
from miles.backends.rank.adapters import SlotAdapters, trained_tensors
from miles.lora import write_peft_dir
from miles.utils.types import DataPosition


@dataclass(frozen=True)
class GradShare:
    """A rank's part of an adapter's gradient toward its next step (`TrainCore.accumulated_grad`)."""

    tensors: dict[str, Tensor]
    """By LoRA parameter name, whole, rank-sliced, CPU, not scaled: a torch rank's own share
    (the train group sums them); Megatron: the replicas' sum on global rank 0, none elsewhere."""
    samples: int
    """The samples of all ranks trained toward that step (the LR clock's count, the same on every rank)."""


def sum_grad_shares(shares: Sequence[GradShare]) -> dict[str, Tensor]:
    """The whole gradient from the ranks' shares (a Megatron rank past 0 holds none)."""
    tensors: dict[str, Tensor] = {}
    for share in shares:
        for key, value in share.tensors.items():
            tensors[key] = tensors[key] + value if key in tensors else value
    return tensors


class AdapterExport:
    """The tensors and state of a loaded adapter, and its step checkpoints."""

    def __init__(self, adapters: SlotAdapters) -> None:
        self.adapters = adapters
        self.model = adapters.model
        self.optimizer = adapters.optimizer

    def tensors(self, name: str) -> dict[str, Tensor]:
        """The adapter's LoRA tensors in PEFT names, sliced to its rank (CPU), the layers it
        freezes left out; every rank that `gathers` must call, and only a rank that `writes`
        gets them."""
        spec = self.adapters.loaded(name).spec
        return trained_tensors(spec, self.model.export_slot(spec.slot))

    def optimizer_state(self, name: str) -> OptimizerState:
        """The adapter's AdamW moments (whole, rank-sliced, by LoRA parameter name) and step count."""
        spec = self.adapters.loaded(name).spec
        exp_avg, exp_avg_sq, step = self.optimizer.slot_state(spec.slot)
        adam = self.adapters.loaded(name).adam
        hyper = {"lr": spec.lr, "weight_decay": spec.weight_decay, "betas": list(self.optimizer.betas),
                 "eps": self.optimizer.eps} if adam is None else \
            {"lr": adam.learning_rate, "weight_decay": adam.weight_decay, "betas": [adam.beta1, adam.beta2],
             "eps": adam.eps, "grad_clip_norm": adam.grad_clip_norm}
        return OptimizerState(exp_avg=self.model.whole_tensors(exp_avg, spec.rank),
                              exp_avg_sq=self.model.whole_tensors(exp_avg_sq, spec.rank), step=step, hyper=hyper)

    def schedule_state(self, name: str) -> dict[str, Any]:
        return self.adapters.loaded(name).schedule.state_dict()

    def accumulated_grad(self, name: str) -> GradShare:
        """This rank's part of the adapter's gradient toward its next step (`TrainModel.gather_grad`)
        and the samples of all ranks trained toward that step."""
        a = self.adapters.loaded(name)
        tensors = self.model.gather_grad(self.optimizer.slot_grads(a.spec.slot), a.spec.rank)
        return GradShare(tensors, a.schedule.samples_seen - a.schedule.samples_at_last_step)

    def save(self, name: str, step: int, data_position: DataPosition | None = None,
             accumulated: AccumulatedGrad | None = None) -> str:
        """Write `{save}/checkpoints/step_{step}` for the adapter; returns its path, or '' on
        a rank that only takes part in the gathers (or in none).

        `step` is the adapter's step as the registry counts it; this rank keeps none.
        `accumulated` is the adapter's part-window gradient summed over every rank (the
        train group gathers it with `accumulated_grad`); None: nothing toward the next step
        is kept.
        """
        spec = self.adapters.loaded(name).spec
        state, scheduler = self._checkpoint_state(name, step, data_position, accumulated)
        if not self.model.gathers:
            return ""
        tensors = trained_tensors(spec, self.model.export_slot(spec.slot))
        optimizer = self.optimizer_state(name)
        if not self.model.writes:
            return ""
        path = write_checkpoint(
            spec.save_dir, step,  # type: ignore[arg-type]
            write_adapter=lambda p: write_peft_dir(p, tensors, self.adapters.peft_config(spec)),
            optimizer=optimizer, scheduler=scheduler, trainer_state=state, accumulated_grad=accumulated,
        )
        return str(path)

    def _checkpoint_state(self, name: str, step: int, data_position: DataPosition | None,
                          accumulated: AccumulatedGrad | None) -> tuple[TrainerState, dict[str, Any]]:
        """`trainer_state.json` and `scheduler.json` of a save. Without a gradient the saved
        clock drops the samples trained since the last step, as the resumed window will."""
        a = self.adapters.loaded(name)
        spec = a.spec
        if spec.save_dir is None:
            raise ValueError(f"adapter '{name}' has no save directory: set 'save' in its config or --save")
        state = TrainerState(
            name=name, step=step, registration_id=spec.registration_id, rank=spec.rank, alpha=spec.alpha,
            data_position=data_position, accumulated_groups=0 if accumulated is None else accumulated.groups,
            accumulated_samples=0 if accumulated is None else accumulated.samples,
        )
        scheduler = a.schedule.state_dict()
        if accumulated is None:
            scheduler["samples_seen"] = scheduler["samples_at_last_step"]
        return state, scheduler
