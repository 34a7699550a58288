"""The adapters a train rank holds in its slots: each one's spec and LR schedule, and its
layout over the slot (the layers it freezes stay the base model's, exports leave them out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles.backends.base import AdapterSpec
from miles.backends.common.lr_schedule import LRSchedule
from miles.backends.common.optimizer import SlotAdamW
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.model import TrainModel
from miles.lora import peft_adapter_config
from miles.lora.slots import PEFT_PREFIX
from miles.utils.loss_settings import LossSettings
from miles.utils.types.client import AdamStep
from miles.utils.types.client_commands import LoraGroup


@dataclass
class LoadedAdapter:
    """An adapter in its slot: its spec and its LR schedule (whose clock counts its samples)."""

    spec: AdapterSpec
    schedule: LRSchedule
    adam: AdamStep | None = None
    """The settings of its latest client `optim_step` (a checkpoint records them); None: none yet."""


class SlotAdapters:
    """The loaded adapters by name, and how each one's slot is laid out."""

    def __init__(self, config: TrainActorConfig, model: TrainModel, optimizer: SlotAdamW, rank: int = 0) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.rank = rank
        self.by_name: dict[str, LoadedAdapter] = {}

    def loaded(self, name: str) -> LoadedAdapter:
        if name not in self.by_name:
            raise KeyError(f"adapter '{name}' is not loaded on train rank {self.rank}: reconcile adapters first")
        return self.by_name[name]

    def slots(self) -> dict[str, int]:
        return {name: a.spec.slot for name, a in self.by_name.items()}

    def loss_settings(self, adapter: str) -> LossSettings:
        return self.loaded(adapter).spec.loss or self.config.loss

    def check_free(self, spec: AdapterSpec) -> None:
        if spec.name in self.by_name:
            raise ValueError(f"adapter '{spec.name}' is already loaded in slot {self.by_name[spec.name].spec.slot}")
        for other in self.by_name.values():
            if other.spec.slot == spec.slot:
                raise ValueError(f"slot {spec.slot} is held by adapter '{other.spec.name}': clean it up first")
        self.check_rank(spec)

    def check_rank(self, spec: AdapterSpec) -> None:
        if not 0 < spec.rank <= self.config.lora_rank:
            raise ValueError(f"adapter '{spec.name}' has rank {spec.rank}; "
                             f"it must be in 1..{self.config.lora_rank} (--lora-rank)")

    def configure_slot(self, spec: AdapterSpec) -> None:
        """The slot's optimizer settings, and its frozen layers (`spec.frozen`) made exactly the
        base model's: their B and moments zeroed (a fresh B is zero already; a checkpoint of the
        same layout holds zeros) and their rows never stepped."""
        frozen = [i for i, name in enumerate(self.model.param_names)
                  if frozen_module(spec, name.rsplit(".", 1)[0])]
        with torch.no_grad():
            for i in frozen:
                if self.model.param_names[i].endswith(".lora_B"):
                    self.model.lora_params[i][0][spec.slot].zero_()
        self.optimizer.configure_slot(spec.slot, rank=spec.rank, lr=spec.lr, weight_decay=spec.weight_decay,
                                      frozen=frozen)

    def peft_config(self, spec: AdapterSpec) -> dict[str, Any]:
        """`adapter_config.json` of the adapter `spec` describes (its target modules: the
        layers it trains)."""
        targets = self.model.target_modules
        if spec.frozen:
            modules = {name.rsplit(".", 1)[0] for name in self.model.param_names}
            targets = sorted({m.rsplit(".", 1)[-1] for m in modules if not frozen_module(spec, m)})
        return peft_adapter_config(
            rank=spec.rank, alpha=spec.alpha, target_modules=targets,
            base_model_name_or_path=self.config.hf_checkpoint,
        )


def frozen_module(spec: AdapterSpec, module: str) -> bool:
    return bool(spec.frozen) and LoraGroup.of(module) in spec.frozen


def trained_tensors(spec: AdapterSpec, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`tensors` (PEFT names) without the layers the adapter freezes: what it exports and
    saves (a loader gives the layers it lacks a zero delta, which they have)."""
    if not spec.frozen:
        return tensors
    return {key: t for key, t in tensors.items()
            if not frozen_module(spec, key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0])}
