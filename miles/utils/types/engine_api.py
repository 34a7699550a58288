"""The engine HTTP API: the subset of SGLang's that every engine serves, as pydantic models.

Engines parse requests with these models and the trainer sends them; field names are
SGLang's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    """-1 or 0 means no top-k filtering."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    sampling_seed: int | None = None
    """SGLang's name for a per-request seed (honoured by SGLang under
    `--enable-deterministic-inference`); the builtin engine takes either name."""

    @property
    def request_seed(self) -> int | None:
        """The request's seed under either name (`seed` first)."""
        return self.seed if self.seed is not None else self.sampling_seed


class GenerateRequest(BaseModel):
    """`POST /generate`. A batch when `text` / `input_ids` is a list of prompts."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=SamplingParams)
    lora_path: str | list[str | None] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int | list[int] = -1
    """With `return_logprob`: the first prompt position whose logprob `input_token_logprobs`
    holds (position 0 has none: its entry is None); -1 returns no prompt logprobs."""
    top_logprobs_num: int | list[int] = 0
    """With `return_logprob`: this many most likely tokens at each returned prompt position
    (`input_top_logprobs`) and each output position (`output_top_logprobs`)."""


class FinishReason(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: str | int | None = None
    message: str | None = None


class GenerateMetaInfo(BaseModel):
    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    """SGLang's shape: (logprob, token_id, token_text or None) per generated token."""
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    """Prompt positions from `logprob_start_len` on, same shape; position 0's logprob is None."""
    input_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    """Per returned prompt position, the `top_logprobs_num` most likely tokens (None at position 0)."""
    output_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    """Per generated token, the `top_logprobs_num` most likely tokens at its position."""


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    prefix: bool = False
    abort_all: bool = False


class LoadLoraRequest(BaseModel):
    """`POST /load_lora_adapter`: a PEFT directory on the engine's node."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    pinned: bool = False
    """Accepted as SGLang does; the builtin engine never evicts a pinned adapter."""
    upsert: bool = False
    """Replace a loaded adapter in place (builtin engine, `in_place` mode only; SGLang ignores it)."""


class LoadLoraFromDistributedRequest(BaseModel):
    """`POST /load_lora_adapter_from_distributed`: the tensors arrive by broadcast, not over HTTP.

    Field names as SGLang's (the build Miles runs): the sender broadcasts from rank 0 of
    the group `group_name`, one tensor per name, in this order.
    """

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    config_dict: dict[str, Any]
    """Contents of the adapter's `adapter_config.json`."""
    names: list[str]
    """PEFT parameter names, in broadcast order."""
    dtypes: list[str]
    """torch dtype names without the `torch.` prefix (`"float32"`, `"bfloat16"`)."""
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    pinned: bool = False
    upsert: bool = False
    """Replace a loaded adapter in place; without it, loading a loaded name is an error."""
    added_tokens_config: dict[str, int] | None = None
    """Accepted for SGLang compatibility; adapters that add tokens are refused."""
    flattened_bucket: bool = False
    """Builtin engine only: the sender broadcast one flat tensor per dtype instead of one per
    name (`weight_sync.broadcast_tensors(bucketed=True)`); SGLang's servers take one per name."""


class InitWeightsUpdateGroupRequest(BaseModel):
    """`POST /init_weights_update_group`: join the sender's process group (field names as SGLang's)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    """This server's first rank; the sender is rank 0."""
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    """`nccl` on GPU; the builtin engine on CPU takes `gloo`."""


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    group_name: str = "weight_update_group"


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
