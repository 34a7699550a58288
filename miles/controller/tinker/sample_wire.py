"""A sample result on the wire: the SDK's SampleResponse as JSON or as protobuf.

Pure functions for the gateway's `asample` and `retrieve_future` of a sample (no routes here):

    request = sample_request_from_json(await http_request.json())   # -> WireSampleRequest
    result = await sampler.sample(snapshot_of(request.model_path), request.prompt_tokens, request.params)
    body, content_type = encode_sample_response(result, http_request.headers.get("accept"))

Every SDK sends the SampleRequest as JSON (`{"num_samples", "prompt": {"chunks":
[{"type": "encoded_text", "tokens"}]}, "sampling_params", "sampling_session_id" (0.24 on)
or "model_path" | "base_model" (earlier clients), "seq_id", "prompt_logprobs", "topk_prompt_logprobs",
"topk_sample_logprobs", ...}`); what we do not serve (images, target / alternative prompt
tokens, stability records) is refused with `UnsupportedSampleRequest` naming the field,
never ignored.

A client that does not ask for protobuf reads a JSON `SampleResponse` (`{"type": "sample",
"sequences": [{"stop_reason", "tokens", "logprobs"}], "prompt_logprobs", "topk_prompt_logprobs"}`).
The SDKs ask for protobuf: 0.24.1 with `Accept: application/x-protobuf, application/json`,
0.26.2 and 0.38 with `Accept: application/x-protobuf`, and those two take only the protobuf
`tinker_public.SampleResponse` (its `topk_sampled_logprobs` is 0.38's: 0.24 and 0.26 cannot
ask for `topk_sample_logprobs`), whose numbers travel as little-endian byte arrays
(tokens int32, logprobs float32 with NaN where there is none, top-k as dense N x K
matrices with empty cells token 0 / logprob -99999.0). The protobuf is written by hand
(varints and length-delimited fields, field numbers of the SDK's `tinker_public.proto`),
so the server needs neither protobuf nor the SDK.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles.controller.tinker.proto import put_len, put_varint_field
from miles.controller.tinker.wire import Id, SeqId
from miles.utils.types import SampledSequence, SampleResult, SamplingRequestParams, StopReason, TopLogprobs

PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
JSON_CONTENT_TYPE = "application/json"

MAX_NUM_SAMPLES = 1024
"""Samples per request: each is one generate call to the engines."""
MAX_SAMPLE_TOKENS = 1 << 20
"""`max_tokens` above any context length served here."""

TOPK_EMPTY_TOKEN = 0
TOPK_EMPTY_LOGPROB = -99999.0
"""What an empty top-k cell holds (the SDK reads a row that starts with it as None)."""

_STOP_REASON_NUMBER = {StopReason.STOP: 0, StopReason.LENGTH: 1}


class UnsupportedSampleRequest(ValueError):
    """A sample request that is malformed or asks for what this server does not serve (HTTP 400)."""


class _SdkChunk(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Id = "encoded_text"
    tokens: list[Annotated[int, Field(ge=0)]] | None = None


class _SdkModelInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    chunks: list[_SdkChunk]


class _SdkSamplingParams(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = Field(default=None, ge=0, le=MAX_SAMPLE_TOKENS)
    seed: int | None = None
    stop: str | list[int] | list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_k: int = Field(default=-1, ge=-1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)


class _SdkSampleRequest(BaseModel):
    """The SDK's SampleRequest body (fields of 0.24 to 0.38; newer unknown ones are ignored)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    num_samples: int = Field(default=1, ge=1, le=MAX_NUM_SAMPLES)
    prompt: _SdkModelInput
    sampling_params: _SdkSamplingParams = Field(default_factory=_SdkSamplingParams)
    base_model: Id | None = None
    model_path: Id | None = None
    sampling_session_id: Id | None = None
    seq_id: SeqId | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0)
    topk_sample_logprobs: int = Field(default=0, ge=0)
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1)
    record_stability_info: bool = False


@dataclass(frozen=True)
class WireSampleRequest:
    """A sample request as the sampler takes it."""

    prompt_tokens: list[int]
    params: SamplingRequestParams
    model_path: str | None
    """The `tinker://.../sampler_weights/...` snapshot to sample; None: the base model."""
    base_model: str | None
    sampling_session_id: str | None = None
    """The sampling session (`create_sampling_session`) that names the model; SDKs 0.24 on send
    only this, earlier clients `model_path` or `base_model`."""
    seq_id: int | None = None
    """The sampling client's request number: a retry with the same one is the same request."""


def sample_request_from_json(body: Any) -> WireSampleRequest:
    """Read the SDK's SampleRequest; raise UnsupportedSampleRequest with what to change."""
    try:
        request = _SdkSampleRequest.model_validate(body)
    except ValidationError as exc:  # each field and what is wrong with it; the body is never echoed back
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors(include_url=False, include_input=False, include_context=False))
        raise UnsupportedSampleRequest(f"not a valid sample request: {problems}") from None
    refused = {"target_prompt_logprobs": request.target_prompt_logprobs is not None,
               "prompt_alt_tokens_k": request.prompt_alt_tokens_k != 0,
               "record_stability_info": request.record_stability_info}
    for name, asked in refused.items():
        if asked:
            raise UnsupportedSampleRequest(f"{name} is not served here; leave it unset")
    tokens: list[int] = []
    for chunk in request.prompt.chunks:
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise UnsupportedSampleRequest(f"prompt chunks of type {chunk.type!r} are not served: send token ids "
                                           "(encoded_text chunks)")
        tokens += chunk.tokens
    if not tokens:
        raise UnsupportedSampleRequest("prompt has no tokens: send at least one token id")
    if request.model_path is None and request.base_model is None and request.sampling_session_id is None:
        raise UnsupportedSampleRequest("give sampling_session_id, model_path (a tinker:// sampler path) or base_model")
    sp = request.sampling_params
    try:
        params = SamplingRequestParams(
            num_samples=request.num_samples, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
            top_k=sp.top_k, stop=sp.stop, seed=sp.seed, prompt_logprobs=bool(request.prompt_logprobs),
            topk_prompt_logprobs=request.topk_prompt_logprobs, topk_sample_logprobs=request.topk_sample_logprobs,
            prompt_logprobs_last_n=request.prompt_logprobs_last_n)
    except ValueError as exc:
        raise UnsupportedSampleRequest(str(exc)) from None
    return WireSampleRequest(prompt_tokens=tokens, params=params, model_path=request.model_path,
                             base_model=request.base_model, sampling_session_id=request.sampling_session_id,
                             seq_id=request.seq_id)


def wants_protobuf(accept: str | None) -> bool:
    """Whether a client's `Accept` header asks for the protobuf body (SDKs 0.24.1, 0.26.2 and 0.38 do)."""
    return accept is not None and PROTOBUF_CONTENT_TYPE in accept.lower()


def encode_sample_response(result: SampleResult, accept: str | None) -> tuple[bytes, str]:
    """(body, content type) of `result` for a client that sent `accept`."""
    if wants_protobuf(accept):
        return sample_response_proto(result), PROTOBUF_CONTENT_TYPE
    return json.dumps(sample_response_json(result)).encode(), JSON_CONTENT_TYPE


# ---- JSON (clients that do not ask for protobuf) ----

def _sequence_json(sequence: SampledSequence) -> dict[str, Any]:
    return {"stop_reason": sequence.stop_reason.value, "tokens": list(sequence.tokens),
            "logprobs": list(sequence.logprobs)}


def _topk_json(rows: list[TopLogprobs | None]) -> list[list[list[float]] | None]:
    return [None if row is None else [[tok, lp] for tok, lp in row] for row in rows]


def sample_response_json(result: SampleResult) -> dict[str, Any]:
    """The JSON `SampleResponse` of the SDKs before protobuf (fields they do not know are left out)."""
    body: dict[str, Any] = {"type": "sample", "sequences": [_sequence_json(s) for s in result.sequences]}
    if result.prompt_logprobs is not None:
        body["prompt_logprobs"] = list(result.prompt_logprobs)
    if result.topk_prompt_logprobs is not None:
        body["topk_prompt_logprobs"] = _topk_json(result.topk_prompt_logprobs)
    return body


# ---- protobuf (the SDKs, 0.24 on) ----

def _topk_message(rows: list[TopLogprobs | None]) -> bytes:
    """`TopkLogprobs`: 1 token_ids (int32 N x K), 2 logprobs (float32 N x K), 3 k, 4 length."""
    k = max((len(row) for row in rows if row), default=0)
    token_ids = np.full((len(rows), k), TOPK_EMPTY_TOKEN, dtype="<i4")
    logprobs = np.full((len(rows), k), TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate(row or []):
            token_ids[i, j], logprobs[i, j] = tok, lp
    out = bytearray()
    put_len(out, 1, token_ids.tobytes())
    put_len(out, 2, logprobs.tobytes())
    put_varint_field(out, 3, k)
    put_varint_field(out, 4, len(rows))
    return bytes(out)


def _sequence_message(sequence: SampledSequence) -> bytes:
    """`SampledSequence`: 1 stop_reason, 2 tokens (int32), 3 logprobs (float32), 4 topk_sampled_logprobs."""
    out = bytearray()
    put_varint_field(out, 1, _STOP_REASON_NUMBER[sequence.stop_reason])
    put_len(out, 2, np.asarray(sequence.tokens, dtype="<i4").tobytes())
    put_len(out, 3, np.asarray(sequence.logprobs, dtype="<f4").tobytes())
    if sequence.topk_logprobs is not None:
        put_len(out, 4, _topk_message(sequence.topk_logprobs))
    return bytes(out)


def sample_response_proto(result: SampleResult) -> bytes:
    """`tinker_public.SampleResponse`: 1 sequences, 2 prompt_logprobs (float32, NaN for none),
    3 topk_prompt_logprobs."""
    out = bytearray()
    for sequence in result.sequences:
        put_len(out, 1, _sequence_message(sequence))
    if result.prompt_logprobs is not None:
        values = [np.nan if lp is None else lp for lp in result.prompt_logprobs]
        put_len(out, 2, np.asarray(values, dtype="<f4").tobytes())
    if result.topk_prompt_logprobs is not None:
        put_len(out, 3, _topk_message(result.topk_prompt_logprobs))
    return bytes(out)
