"""The JSON bodies of the Tinker protocol that we accept, by the SDK's field names.

Our own pydantic models of what `tinker` 0.38 sends: unknown keys are ignored (a newer
SDK may add fields), a field of the wrong type is a 422 naming it. The protobuf bodies
(`forward_backward` in, its result out) are in `proto.py`; the translation into our
typed commands is in `routes.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field


class WireBody(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionBody(WireBody):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class CreateSamplingSessionBody(WireBody):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class SessionIdBody(WireBody):
    session_id: str


class LoraConfigBody(WireBody):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(WireBody):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModelBody(WireBody):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody = Field(default_factory=OptimizerConfigBody)


class ModelIdBody(WireBody):
    model_id: str


class AdamParamsBody(WireBody):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepBody(WireBody):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParamsBody | None = Field(None, validation_alias=AliasChoices("adam_params", "optim_params"))
    optimizer_params: dict[str, Any] | None = None
    """Another optimizer family's step (Dimuon): refused, we train with AdamW."""


class SaveWeightsBody(WireBody):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerBody(WireBody):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsBody(WireBody):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: dict[str, Any] | None = None
    weights_access_token: str | None = None


class RetrieveFutureBody(WireBody):
    request_id: str
    allow_metadata_only: bool = False
