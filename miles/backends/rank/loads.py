"""Putting an adapter into its slot on a train rank: fresh (A seeded by seed and name, B
zero), resumed from a checkpoint of ours (weights, moments, LR clock and the part-window
gradient), or started from a Miles checkpoint's LoRA weights; and emptying the slot again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from miles.backends.base import AdapterSpec, LoadResult
from miles.backends.common.checkpoint import Checkpoint, checkpoint_step, read_checkpoint
from miles.backends.common.lr_schedule import LRSchedule
from miles.backends.rank.adapters import LoadedAdapter, SlotAdapters, trained_tensors
from miles.backends.rank.take_back import TakeBack
from miles.lora import peft_tensors

logger = logging.getLogger(__name__)


def adapter_seed(seed: int, name: str) -> int:
    """Seed of an adapter's fresh init: the same on every rank and in every run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class AdapterLoads:
    """Loads into and cleanups of the rank's slots."""

    def __init__(self, adapters: SlotAdapters, take_back: TakeBack) -> None:
        self.adapters = adapters
        self.take_back = take_back
        self.config = adapters.config
        self.model = adapters.model
        self.optimizer = adapters.optimizer

    def load(self, spec: AdapterSpec, checkpoint: str | None = None,
             miles_checkpoint: str | None = None) -> LoadResult:
        """Put an adapter into its slot, fresh (A seeded by seed and name, B zero), resumed
        from a checkpoint directory of ours, or started from the LoRA weights of a Miles
        checkpoint (`miles_checkpoint`: a fresh optimizer and LR clock, at its step); says
        which step and data position it resumed at."""
        self.adapters.check_free(spec)
        self.optimizer.reset_slot(spec.slot)
        schedule = self._new_schedule(spec)
        result = LoadResult()
        if checkpoint is not None:
            result, schedule = self._resume(spec, Path(checkpoint), schedule)
        elif miles_checkpoint is not None:
            result = self._start_from_miles(spec, Path(miles_checkpoint))
        else:
            self.model.init_slot(spec.slot, rank=spec.rank, alpha=spec.alpha, generator=self._generator(spec))
        self.adapters.configure_slot(spec)
        if spec.num_step is not None:
            # `num_step` counts from the step this registration started at.
            schedule.total_steps = spec.final_step(result.step)
        self.adapters.by_name[spec.name] = LoadedAdapter(spec=spec, schedule=schedule)
        return result

    def fresh_export(self, spec: AdapterSpec) -> dict[str, Tensor]:
        """What `export_adapter` will give once `load(spec)` has put the fresh adapter in its
        slot (the same seeded draws), computed without touching the model."""
        self.adapters.check_rank(spec)
        return trained_tensors(spec, peft_tensors(self.model.fresh_weights(rank=spec.rank,
                                                                           generator=self._generator(spec))))

    def cleanup(self, name: str) -> None:
        """Empty the adapter's slot: weights, moments, step counter, retained grads, schedule."""
        loaded = self.adapters.loaded(name)
        self.model.clear_slot(loaded.spec.slot)
        self.optimizer.reset_slot(loaded.spec.slot)
        del self.adapters.by_name[name]
        self.take_back.keep()

    def _generator(self, spec: AdapterSpec) -> torch.Generator:
        if spec.seed is not None:  # a client's seed: the same init whatever the model is called
            return torch.Generator().manual_seed(spec.seed)
        return torch.Generator().manual_seed(adapter_seed(self.config.seed, spec.name))

    def _new_schedule(self, spec: AdapterSpec) -> LRSchedule:
        return LRSchedule(
            lr=spec.lr, samples_per_step=spec.global_batch_size, style=spec.lr_decay_style,  # type: ignore[arg-type]
            warmup_steps=spec.lr_warmup_steps, warmup_init=min(self.config.lr_warmup_init, spec.lr),
            min_lr=self.config.min_lr,
        )

    def _start_from_miles(self, spec: AdapterSpec, path: Path) -> LoadResult:
        """A Miles checkpoint's PEFT weights into the slot (its shards and optimizer are not read)."""
        config = json.loads((path / "adapter_config.json").read_text())
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if rank != spec.rank or alpha is None or abs(float(alpha) - spec.alpha) > 1e-6:
            raise ValueError(f"Miles checkpoint {path} holds a rank-{rank} alpha-{alpha} adapter but adapter "
                             f"'{spec.name}' is configured with rank {spec.rank} alpha {spec.alpha}: use the "
                             "checkpoint's rank and alpha, or give the adapter a fresh save directory")
        self.model.init_slot(spec.slot, rank=spec.rank, alpha=spec.alpha, generator=self._generator(spec))
        self.model.load_peft_dir(spec.slot, path)
        return LoadResult(checkpoint=path, step=checkpoint_step(path), miles_checkpoint=True)

    def _resume(self, spec: AdapterSpec, path: Path, fresh: LRSchedule) -> tuple[LoadResult, LRSchedule]:
        ckpt = read_checkpoint(path)
        if ckpt.trainer_state.rank != spec.rank or abs(ckpt.trainer_state.alpha - spec.alpha) > 1e-6:
            raise ValueError(
                f"checkpoint {path} holds a rank-{ckpt.trainer_state.rank} alpha-{ckpt.trainer_state.alpha} adapter "
                f"but adapter '{spec.name}' is configured with rank {spec.rank} alpha {spec.alpha}: "
                "use the checkpoint's rank and alpha, or give the adapter a fresh save directory"
            )
        self.model.load_peft_dir(spec.slot, path)
        exp_avg = self.model.pad_slot_tensors(ckpt.optimizer.exp_avg, spec.slot, spec.rank, path, "optimizer state")
        exp_avg_sq = self.model.pad_slot_tensors(ckpt.optimizer.exp_avg_sq, spec.slot, spec.rank, path,
                                                 "optimizer state")
        self.optimizer.load_slot_state(spec.slot, exp_avg, exp_avg_sq, ckpt.optimizer.step)
        # The clock comes from the checkpoint; the schedule's settings from today's config.
        saved = LRSchedule.from_state_dict(ckpt.scheduler)
        schedule = replace(fresh, samples_seen=saved.samples_seen, samples_at_last_step=saved.samples_at_last_step)
        result = LoadResult(checkpoint=path, step=ckpt.trainer_state.step,
                            data_position=ckpt.trainer_state.data_position,
                            accumulated_groups=self._restore_accumulated_grad(spec, ckpt, schedule))
        return result, schedule

    def _restore_accumulated_grad(self, spec: AdapterSpec, ckpt: Checkpoint, schedule: LRSchedule) -> int:
        """Put a checkpoint's part-window gradient back into the slot; returns the groups it
        covers. The first DP replica holds the whole sum and the others zeros, so the step's
        all-reduce gives the sum the interrupted run would have had."""
        acc = ckpt.accumulated_grad
        if acc is None:
            return 0
        rbs = spec.rollout_batch_size
        fits = acc.samples < spec.global_batch_size and \
            (rbs is None or (acc.groups < rbs and acc.samples == acc.groups * (spec.global_batch_size // rbs)))
        if not fits:
            logger.warning("Adapter '%s': the gradient of %d group(s) (%d samples) in %s does not fit its batch "
                           "(%s groups, %d samples per step) as configured now; it is dropped and the step's "
                           "window starts empty", spec.name, acc.groups, acc.samples, ckpt.path, rbs,
                           spec.global_batch_size)
            schedule.samples_seen = schedule.samples_at_last_step
            return 0
        if self.model.dp_rank == 0:
            grads = self.model.pad_slot_tensors(acc.tensors, spec.slot, spec.rank, ckpt.path, "accumulated gradient")
            torch._foreach_copy_(self.optimizer.slot_grads(spec.slot), grads)
        return acc.groups
