"""Client-driven models and their command log, as the controller hands them to the driver.

A Tinker client's model is a *client-driven* adapter (DESIGN §11): it holds a slot like any
adapter, but it has no dataset, reward or `num_step`; its client sends the work. The
gateway (`miles.controller.tinker`) writes each call into a per-model command log; the
driver takes the runnable commands, executes them and reports each result back:

    batch = await controller.take_client_commands.remote()     # ClientCommandBatch
    for model in batch.models:                                 # ModelCommands, seq_id order
        ...train model.work (forward / forward_backward) with the RL batch...
        await controller.complete_client_command.remote(cmd.future_id, ForwardBackwardResult(outputs, metrics))
        ...then model.barrier (optim_step / save / load), if any...

Everything here is a plain frozen dataclass or a pydantic model, picklable by Ray.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from miles.utils.types.client import AdamStep, ClientDatum, ClientLoss, DatumOutput
from miles.utils.types.lifecycle import AdapterState


class AdapterKind(str, enum.Enum):
    """Who drives an adapter's training."""

    SERVER = "server"
    """Miles v1: a dataset, a reward, `num_step`; the trainer runs its RL loop."""
    CLIENT = "client"
    """A Tinker model: its client sends forward_backward / optim_step; never auto-retires."""


class LoraGroup(str, enum.Enum):
    """Which part of the model a LoRA layer adapts: what a Tinker layout trains or freezes
    (`train_attn`, `train_mlp`, `train_unembed`)."""

    ATTN = "attn"
    MLP = "mlp"
    UNEMBED = "unembed"

    @classmethod
    def of(cls, module_name: str) -> LoraGroup:
        """The group of a LoRA layer by its Hugging Face module name (`model.layers.0.self_attn.q_proj`,
        `model.layers.0.mlp.up_proj`, `lm_head`); ValueError for a layer in none of them."""
        parts = module_name.split(".")
        if parts[-1] == "lm_head":
            return cls.UNEMBED
        if any("attn" in p or "attention" in p for p in parts):
            return cls.ATTN
        if any(p in ("mlp", "feed_forward", "experts") for p in parts):
            return cls.MLP
        raise ValueError(f"LoRA layer {module_name!r} is neither attention, MLP nor the unembedding: "
                         "no Tinker layout names it")


class ClientModelConfig(BaseModel):
    """A client-driven adapter's settings, fixed by `create_model`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    model_id: Annotated[str, Field(min_length=1)]
    """The id the client addresses it by (`{session_id}:train:{model_seq_id}`)."""
    session_id: Annotated[str, Field(min_length=1)]
    base_model: Annotated[str, Field(min_length=1)]
    rank: Annotated[int, Field(gt=0)]
    alpha: Annotated[float, Field(gt=0)]
    seed: int | None = None
    save: Annotated[Path, Field(strict=False)]
    """Its directory: checkpoints (`save_state`) and sampler snapshots go under it."""
    user_metadata: dict[str, Any] = Field(default_factory=dict)
    train_attn: bool = True
    """Its LoRA on the attention layers trains; False: it stays zero (B = 0, never stepped)."""
    train_mlp: bool = True
    """Its LoRA on the MLP layers trains; False: it stays zero."""
    train_unembed: bool = False
    """Its LoRA on the unembedding (`lm_head`, slots that carry one: `--lora-unembed`) trains;
    False: it stays zero. (Configs stored before layouts existed read as attention and MLP.)"""

    def frozen_groups(self) -> frozenset[LoraGroup]:
        """The LoRA groups this model never trains."""
        trained = {LoraGroup.ATTN: self.train_attn, LoraGroup.MLP: self.train_mlp,
                   LoraGroup.UNEMBED: self.train_unembed}
        return frozenset(group for group, on in trained.items() if not on)

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump()
        out["save"] = str(self.save)
        return out


@dataclass(frozen=True)
class ClientAdapterRun:
    """Read-only view of one live client-driven adapter, as carried by a snapshot."""

    name: str
    config: ClientModelConfig
    state: AdapterState
    slot: int
    version: int
    step: int
    """Optimizer steps taken (`optim_step` commands completed)."""
    registration_id: str
    resume_from: str | None = None
    """The directory of its latest completed `save_state` (or `load_state`): where a trainer
    that restarts over the registry loads it from; None: fresh (A from `seed`, B zero)."""
    resume_step: int = 0
    """Its `step` when that state was saved or loaded: a restarted trainer resumes it there
    (the optimizer steps after it are lost with the trainer)."""


class ClientCommandKind(str, enum.Enum):
    """A command of the log, by the SDK's call."""

    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_STATE = "save_state"
    LOAD_STATE = "load_state"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"

    @property
    def barrier(self) -> bool:
        """Runs alone, after the forward work before it: it changes or reads the whole slot."""
        return self not in (ClientCommandKind.FORWARD, ClientCommandKind.FORWARD_BACKWARD)


class ClientCommandStatus(str, enum.Enum):
    PENDING = "pending"
    """Logged; not handed to the driver yet (or its seq_id's predecessors have not arrived)."""
    RUNNING = "running"
    """Taken by the driver."""
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (ClientCommandStatus.DONE, ClientCommandStatus.FAILED)


@dataclass(frozen=True)
class ForwardCommand:
    """`forward` (no gradient) or `forward_backward` (gradients accumulate in the slot)."""

    datums: list[ClientDatum]
    loss: ClientLoss


@dataclass(frozen=True)
class OptimStepCommand:
    adam: AdamStep


@dataclass(frozen=True)
class SaveStateCommand:
    """Write a checkpoint (weights and optimizer state) to `directory`."""

    name: str
    tinker_path: str
    directory: str


@dataclass(frozen=True)
class LoadStateCommand:
    """Load the checkpoint in `directory` into the slot (with its optimizer state if `optimizer`)."""

    tinker_path: str
    directory: str
    optimizer: bool


@dataclass(frozen=True)
class SaveForSamplerCommand:
    """Export the slot's LoRA as an immutable PEFT directory: a sampler snapshot that samplers
    load by `tinker_path` (`.../sampler_weights/{name}`), or an external-weights export
    (`save_weights_external`, `.../external_weights/{name}`) that clients download."""

    name: str
    tinker_path: str
    directory: str
    ttl_seconds: int | None = None
    """An export only: it is deleted this long after it is written (None: kept until deleted)."""


ClientRequest = ForwardCommand | OptimStepCommand | SaveStateCommand | LoadStateCommand | SaveForSamplerCommand


@dataclass(frozen=True)
class ClientCommand:
    """One logged call of a client-driven model."""

    future_id: str
    """The SDK's `request_id`: what `retrieve_future` is asked for."""
    model: str
    """The adapter's name in the registry."""
    seq_id: int
    kind: ClientCommandKind
    request: ClientRequest


@dataclass(frozen=True)
class ForwardBackwardResult:
    """What a `forward` / `forward_backward` gave: one output per datum, in order."""

    outputs: list[DatumOutput]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimStepResult:
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightsResult:
    """A save or load finished (the path is the one its command carried)."""


ClientResult = ForwardBackwardResult | OptimStepResult | WeightsResult


@dataclass(frozen=True)
class ModelCommands:
    """One model's runnable commands: forward work in seq_id order, then at most one barrier."""

    model: str
    slot: int
    registration_id: str
    work: list[ClientCommand]
    """`forward` / `forward_backward` commands, in seq_id order (each with its own loss)."""
    barrier: ClientCommand | None = None
    """Runs after `work`: `optim_step`, `save_state`, `load_state` or `save_weights_for_sampler`."""


@dataclass(frozen=True)
class ClientCommandBatch:
    """Everything `take_client_commands` handed out, marked RUNNING."""

    models: list[ModelCommands] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.models

    @property
    def commands(self) -> list[ClientCommand]:
        out: list[ClientCommand] = []
        for model in self.models:
            out.extend(model.work)
            if model.barrier is not None:
                out.append(model.barrier)
        return out
