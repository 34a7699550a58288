"""The control plane's HTTP bodies: a registration and an adapter's status."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from miles.utils.types.lifecycle import AdapterState


class RegisterAdapterRequest(BaseModel):
    """`POST /adapter_runs`: exactly one of `config` (inline fields) or `yaml_path`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    config: dict[str, Any] | None = None
    yaml_path: str | None = None


class AdapterStatus(BaseModel):
    """One adapter as the control plane reports it: its run, its config fields, its state."""

    name: str
    state: AdapterState
    slot: int
    """The slot it holds, or held last once COMPLETED."""
    version: int | None
    """Slot version; None once COMPLETED (the slot may serve another adapter)."""
    step: int
    accumulated_groups: int
    registration_id: str
    data: str
    rank: int
    alpha: float
    rollout_batch_size: int
    n_samples_per_prompt: int
    save: str
    input_key: str
    label_key: str | None
    """None: the adapter's rows carry no label."""
    metadata_key: str
    rm_type: str | None
    custom_rm_path: str | None
    custom_generate_function_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    num_step: int | None
    num_epoch: int | None
    metadata: dict[str, Any]
    lr: float
    weight_decay: float
    lr_decay_style: str
    lr_warmup_steps: int
    loss: dict[str, Any] | None = None
    """Every loss flag of the adapter, by Miles' flag name."""
