"""Client-driven sampling (the Tinker protocol): sampler snapshots, sampling requests, samples.

A *sampler snapshot* is what `save_weights_for_sampler` makes: an immutable PEFT directory
on the engines' filesystem, served under an engine-side LoRA name tied to its
`tinker://<model_id>/sampler_weights/<name>` path. The gateway hands a snapshot (or None,
the base model) and `SamplingRequestParams` to `miles.controller.tinker.sampler`, which answers a
`SampleResult`; `miles.controller.tinker.sample_wire` turns that into the SDK's SampleResponse.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from enum import StrEnum

SNAPSHOT_LORA_PREFIX = "tinker-"
TINKER_SCHEME = "tinker://"
_NAME_PART = re.compile(r"[^A-Za-z0-9_.-]")


def snapshot_lora_name(model_id: str, name: str) -> str:
    """The engine-side LoRA name of snapshot `name` of model `model_id`:
    `tinker-<model_id>-<name>-<digest>`.

    Characters outside `[A-Za-z0-9_.-]` become `_`, so the name is safe in a rid prefix and
    a directory name; the digest (of the `tinker://` path) keeps two paths that read the
    same after that, or split differently at a `-` ("a-b"/"c" and "a"/"b-c"), apart. It is
    a pure function of the path, so every engine, the saver and the sampler agree on it
    without asking each other.

    >>> snapshot_lora_name("run-1", "step_0003")
    'tinker-run-1-step_0003-96f160f995'
    """
    if not model_id or not name:
        raise ValueError("a sampler snapshot needs a non-empty model id and name")
    digest = hashlib.sha256(sampler_weights_path(model_id, name).encode()).hexdigest()[:10]
    return f"{SNAPSHOT_LORA_PREFIX}{_NAME_PART.sub('_', model_id)}-{_NAME_PART.sub('_', name)}-{digest}"


def sampler_weights_path(model_id: str, name: str) -> str:
    """The `tinker://` path the SDK names a sampler snapshot by.

    >>> sampler_weights_path("run-1", "step_0003")
    'tinker://run-1/sampler_weights/step_0003'
    """
    return f"{TINKER_SCHEME}{model_id}/sampler_weights/{name}"


def parse_sampler_weights_path(path: str) -> tuple[str, str]:
    """(model_id, name) of a `tinker://<model_id>/sampler_weights/<name>` path; ValueError otherwise."""
    rest = path[len(TINKER_SCHEME):] if path.startswith(TINKER_SCHEME) else None
    parts = rest.split("/") if rest is not None else []
    if len(parts) != 3 or parts[1] != "sampler_weights" or not parts[0] or not parts[2]:
        raise ValueError(f"{path!r} is not a sampler snapshot path: expected "
                         f"{TINKER_SCHEME}<model_id>/sampler_weights/<name>")
    return parts[0], parts[2]


@dataclass(frozen=True)
class SamplerSnapshot:
    """An immutable sampler snapshot the engines can load by path."""

    model_id: str
    name: str
    """The snapshot's name within its model (the last part of its `tinker://` path)."""
    directory: str
    """PEFT directory (`adapter_config.json`, `adapter_model.safetensors`) on the engines' node."""

    @property
    def lora_name(self) -> str:
        """Engine-side LoRA name (`lora_path` of `/generate`, `lora_name` of `/load_lora_adapter`)."""
        return snapshot_lora_name(self.model_id, self.name)

    @property
    def tinker_path(self) -> str:
        return sampler_weights_path(self.model_id, self.name)


class StopReason(StrEnum):
    """Why a sampled sequence ended, in Tinker's words."""

    STOP = "stop"
    """An end-of-sequence token, a stop token or a stop string."""
    LENGTH = "length"
    """`max_tokens` (or the model's context length) reached."""


@dataclass(frozen=True)
class SamplingRequestParams:
    """One Tinker sample request, as the sampler takes it (the SDK's SampleRequest and SamplingParams)."""

    num_samples: int = 1
    max_tokens: int | None = None
    """None: the engine's default (SGLang's 128)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: no top-k filtering."""
    stop: str | list[str] | list[int] | None = None
    """Stop strings or stop token ids. None keeps the end-of-sequence stop; `[]` turns every
    stop off, EOS included (generation runs to `max_tokens`), as the SDK documents."""
    seed: int | None = None
    """Sample i of the request is drawn with seed `seed + i`: the same request gives the same
    samples, and its samples differ from each other."""
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    """Score only the last N prompt tokens (earlier entries are None); None scores them all."""

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.topk_prompt_logprobs < 0 or self.topk_sample_logprobs < 0:
            raise ValueError("topk_prompt_logprobs and topk_sample_logprobs must be >= 0")
        if isinstance(self.stop, list) and len({type(s) for s in self.stop}) > 1:
            raise ValueError("stop must be all strings or all token ids, not a mix")
        if self.prompt_logprobs_last_n is not None and self.prompt_logprobs_last_n < 1:
            raise ValueError(f"prompt_logprobs_last_n must be >= 1, got {self.prompt_logprobs_last_n}")


TopLogprobs = list[tuple[int, float]]
"""The most likely tokens at one position as (token id, logprob), most likely first (Tinker's order)."""


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    """Logprob of each sampled token under the raw model (temperature 1, no filtering)."""
    stop_reason: StopReason
    topk_logprobs: list[TopLogprobs | None] | None = None
    """Per sampled token, when `topk_sample_logprobs` > 0."""


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """One entry per prompt token (None for the first, which has no context), when asked."""
    topk_prompt_logprobs: list[TopLogprobs | None] | None = None
    """One entry per prompt token (None for the first), when `topk_prompt_logprobs` > 0."""
    lora_loads: int = field(default=0, compare=False)
    """Times the sampler had to load the snapshot into the engines to serve this request."""
