"""The control plane's HTTP bodies: a registration and an adapter's status."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from miles.utils.types.client_commands import AdapterKind
from miles.utils.types.lifecycle import AdapterState


class RegisterAdapterRequest(BaseModel):
    """`POST /adapter_runs`: exactly one of `config` (inline fields) or `yaml_path`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    config: dict[str, Any] | None = None
    yaml_path: str | None = None


class AdapterStatus(BaseModel):
    """One adapter as the control plane reports it: its run, its config fields, its state.

    A client-driven adapter (`kind` "client", a Tinker model) has no dataset, reward,
    batch or schedule: those fields are None for it, and `model_id` names it to its client."""

    name: str
    state: AdapterState
    slot: int
    """The slot it holds, or held last once COMPLETED."""
    version: int | None
    """Slot version; None once COMPLETED (the slot may serve another adapter)."""
    step: int
    accumulated_groups: int
    registration_id: str
    kind: AdapterKind = AdapterKind.SERVER
    data: str | None = None
    rank: int
    alpha: float
    rollout_batch_size: int | None = None
    n_samples_per_prompt: int | None = None
    save: str
    input_key: str | None = None
    label_key: str | None = None
    """None: the adapter's rows carry no label."""
    metadata_key: str | None = None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    num_step: int | None = None
    num_epoch: int | None = None
    metadata: dict[str, Any] = {}
    lr: float | None = None
    weight_decay: float | None = None
    lr_decay_style: str | None = None
    lr_warmup_steps: int | None = None
    loss: dict[str, Any] | None = None
    """Every loss flag of the adapter, by Miles' flag name."""
    model_id: str | None = None
    """Client-driven only: the Tinker model id."""
    seed: int | None = None
    """Client-driven only: the LoRA init seed the client asked for."""
    train_attn: bool | None = None
    """Client-driven only: its layout (`create_model`'s lora_config): attention LoRA trains."""
    train_mlp: bool | None = None
    """Client-driven only: MLP LoRA trains."""
    train_unembed: bool | None = None
    """Client-driven only: unembedding (lm_head) LoRA trains."""
