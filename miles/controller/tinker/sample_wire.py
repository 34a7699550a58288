"""A sample result on the wire: the SDK's SampleResponse as JSON or as protobuf.

Pure functions for the gateway's `retrieve_future` of a sample (no routes here):

    body, content_type = encode_sample_response(result, request.headers.get("accept"))

SDKs up to 0.26 read a JSON `SampleResponse` (`{"type": "sample", "sequences":
[{"stop_reason", "tokens", "logprobs"}], "prompt_logprobs", "topk_prompt_logprobs"}`);
0.38 asks with `Accept: application/x-protobuf` and takes only the protobuf
`tinker_public.SampleResponse`, whose numbers travel as little-endian byte arrays
(tokens int32, logprobs float32 with NaN where there is none, top-k as dense N x K
matrices with empty cells token 0 / logprob -99999.0). The protobuf is written by hand
(varints and length-delimited fields, field numbers of the SDK's `tinker_public.proto`),
so the server needs neither protobuf nor the SDK.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from miles.utils.types import SampledSequence, SampleResult, StopReason, TopLogprobs

PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
JSON_CONTENT_TYPE = "application/json"

TOPK_EMPTY_TOKEN = 0
TOPK_EMPTY_LOGPROB = -99999.0
"""What an empty top-k cell holds (the SDK reads a row that starts with it as None)."""

_STOP_REASON_NUMBER = {StopReason.STOP: 0, StopReason.LENGTH: 1}
_VARINT, _LEN = 0, 2


def wants_protobuf(accept: str | None) -> bool:
    """Whether a client's `Accept` header asks for the protobuf body (SDK 0.38 does)."""
    return accept is not None and PROTOBUF_CONTENT_TYPE in accept.lower()


def encode_sample_response(result: SampleResult, accept: str | None) -> tuple[bytes, str]:
    """(body, content type) of `result` for a client that sent `accept`."""
    if wants_protobuf(accept):
        return sample_response_proto(result), PROTOBUF_CONTENT_TYPE
    return json.dumps(sample_response_json(result)).encode(), JSON_CONTENT_TYPE


# ---- JSON (SDK 0.24 - 0.26) ----

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


# ---- protobuf (SDK 0.38) ----

def _put_varint(out: bytearray, value: int) -> None:
    if value < 0:
        value += 1 << 64  # two's complement, as protobuf writes negative int32/int64
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _put_int(out: bytearray, number: int, value: int) -> None:
    _put_varint(out, number << 3 | _VARINT)
    _put_varint(out, value)


def _put_bytes(out: bytearray, number: int, payload: bytes) -> None:
    _put_varint(out, number << 3 | _LEN)
    _put_varint(out, len(payload))
    out += payload


def _topk_message(rows: list[TopLogprobs | None]) -> bytes:
    """`TopkLogprobs`: 1 token_ids (int32 N x K), 2 logprobs (float32 N x K), 3 k, 4 length."""
    k = max((len(row) for row in rows if row), default=0)
    token_ids = np.full((len(rows), k), TOPK_EMPTY_TOKEN, dtype="<i4")
    logprobs = np.full((len(rows), k), TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate(row or []):
            token_ids[i, j], logprobs[i, j] = tok, lp
    out = bytearray()
    _put_bytes(out, 1, token_ids.tobytes())
    _put_bytes(out, 2, logprobs.tobytes())
    _put_int(out, 3, k)
    _put_int(out, 4, len(rows))
    return bytes(out)


def _sequence_message(sequence: SampledSequence) -> bytes:
    """`SampledSequence`: 1 stop_reason, 2 tokens (int32), 3 logprobs (float32), 4 topk_sampled_logprobs."""
    out = bytearray()
    _put_int(out, 1, _STOP_REASON_NUMBER[sequence.stop_reason])
    _put_bytes(out, 2, np.asarray(sequence.tokens, dtype="<i4").tobytes())
    _put_bytes(out, 3, np.asarray(sequence.logprobs, dtype="<f4").tobytes())
    if sequence.topk_logprobs is not None:
        _put_bytes(out, 4, _topk_message(sequence.topk_logprobs))
    return bytes(out)


def sample_response_proto(result: SampleResult) -> bytes:
    """`tinker_public.SampleResponse`: 1 sequences, 2 prompt_logprobs (float32, NaN for none),
    3 topk_prompt_logprobs."""
    out = bytearray()
    for sequence in result.sequences:
        _put_bytes(out, 1, _sequence_message(sequence))
    if result.prompt_logprobs is not None:
        values = [np.nan if lp is None else lp for lp in result.prompt_logprobs]
        _put_bytes(out, 2, np.asarray(values, dtype="<f4").tobytes())
    if result.topk_prompt_logprobs is not None:
        _put_bytes(out, 3, _topk_message(result.topk_prompt_logprobs))
    return bytes(out)
