"""The JSON bodies of the Tinker protocol that we accept, by the SDK's field names.

Our own pydantic models of what `tinker` 0.38 sends: unknown keys are ignored (a newer
SDK may add fields), a field of the wrong type, an id over `MAX_ID_CHARS` or a seq id
outside 0..2^63 - 1 is a 422 naming it. The protobuf bodies
(`forward_backward` in, its result out) are in `proto.py`; the translation into our
typed commands is in `routes.py`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

MAX_ID_CHARS = 512
"""The longest id, name, path or model name taken: refusals name what they refuse, so a
longer one would be echoed back (the SDK's are far shorter)."""
MAX_SEQ_ID = 2**63 - 1
"""Sequence numbers are kept as SQLite integers (signed 64-bit)."""

Id = Annotated[str, Field(max_length=MAX_ID_CHARS)]
"""A session, model, sampler or future id, a `tinker://` path, a checkpoint or model name."""
SeqId = Annotated[int, Field(ge=0, le=MAX_SEQ_ID)]


class WireBody(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionBody(WireBody):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class CreateSamplingSessionBody(WireBody):
    session_id: Id
    sampling_session_seq_id: SeqId
    base_model: Id | None = None
    model_path: Id | None = None


class SessionIdBody(WireBody):
    session_id: Id


class LoraConfigBody(WireBody):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(WireBody):
    model_config = ConfigDict(extra="allow")
    type: Id = "adamw"


class CreateModelBody(WireBody):
    session_id: Id
    model_seq_id: SeqId
    base_model: Id
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody = Field(default_factory=OptimizerConfigBody)


class ModelIdBody(WireBody):
    model_id: Id


class AdamParamsBody(WireBody):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepBody(WireBody):
    model_id: Id
    seq_id: SeqId | None = None
    adam_params: AdamParamsBody | None = Field(None, validation_alias=AliasChoices("adam_params", "optim_params"))
    optimizer_params: dict[str, Any] | None = None
    """Another optimizer family's step (Dimuon): refused, we train with AdamW."""


class SaveWeightsBody(WireBody):
    model_id: Id
    path: Id | None = None
    seq_id: SeqId | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerBody(WireBody):
    model_id: Id
    path: Id | None = None
    sampling_session_seq_id: SeqId | None = None
    kind: Id = "snapshot"
    seq_id: SeqId | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsBody(WireBody):
    model_id: Id | None = None
    seq_id: SeqId | None = None
    session_id: Id | None = None
    model_seq_id: SeqId | None = None
    base_model: Id | None = None
    user_metadata: dict[str, Any] | None = None
    path: Id
    optimizer: bool
    optimizer_config: dict[str, Any] | None = None
    weights_access_token: str | None = None


class RetrieveFutureBody(WireBody):
    request_id: Id
    allow_metadata_only: bool = False


class SaveWeightsExternalBody(WireBody):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None
    """Encrypt the export to these age recipients: refused, exports are plain PEFT files."""


class WeightsInfoBody(WireBody):
    tinker_path: str


class CheckpointTtlBody(WireBody):
    ttl_seconds: int | None = None
