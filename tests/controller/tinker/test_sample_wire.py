"""Our SampleResponse bodies, read back by the official SDK's own decoder (tinker 0.38)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from tinker.proto.response_conv import deserialize_sample_response

from miles.controller.tinker.sample_wire import (
    JSON_CONTENT_TYPE,
    PROTOBUF_CONTENT_TYPE,
    encode_sample_response,
    sample_response_json,
    sample_response_proto,
)
from miles.utils.types import SampledSequence, SampleResult, StopReason

FULL = SampleResult(
    sequences=[
        SampledSequence(tokens=[5, 70000, 2], logprobs=[-0.5, -1.25, -3.0], stop_reason=StopReason.STOP,
                        topk_logprobs=[[(5, -0.5), (9, -1.0)], None, [(2, -3.0)]]),
        SampledSequence(tokens=[], logprobs=[], stop_reason=StopReason.LENGTH),
        SampledSequence(tokens=[1], logprobs=[-0.125], stop_reason=StopReason.LENGTH),
    ],
    prompt_logprobs=[None, -2.5, -0.75],
    topk_prompt_logprobs=[None, [(3, -0.25), (4, -2.0)], [(8, -0.75), (1, -1.5)]],
)


def test_protobuf_round_trip_through_the_sdk_decoder():
    decoded = deserialize_sample_response(sample_response_proto(FULL))
    assert len(decoded.sequences) == 3
    for ours, theirs in zip(FULL.sequences, decoded.sequences):
        assert theirs.stop_reason == ours.stop_reason.value
        assert theirs.tokens == ours.tokens
        assert theirs.topk_logprobs == ours.topk_logprobs
    assert decoded.sequences[0].logprobs == [-0.5, -1.25, -3.0]  # exact in float32
    assert decoded.sequences[1].logprobs is None  # the SDK reads no bytes as "not requested"
    assert decoded.sequences[2].logprobs == [-0.125]
    assert decoded.prompt_logprobs == [None, -2.5, -0.75]
    assert decoded.topk_prompt_logprobs == FULL.topk_prompt_logprobs
    assert decoded.prompt_cache_hit_tokens == 0


def test_protobuf_without_prompt_fields_decodes_them_as_absent():
    result = SampleResult(sequences=[SampledSequence([4, 4], [-1.0, -2.0], StopReason.LENGTH)])
    decoded = deserialize_sample_response(sample_response_proto(result))
    assert decoded.prompt_logprobs is None and decoded.topk_prompt_logprobs is None
    assert decoded.sequences[0].topk_logprobs is None
    assert decoded.sequences[0].tokens == [4, 4] and decoded.sequences[0].stop_reason == "length"


def test_float32_rounding_is_the_only_change():
    logprobs = [-0.1, -1 / 3, -12.345678]
    result = SampleResult(sequences=[SampledSequence([1, 2, 3], logprobs, StopReason.STOP)],
                          prompt_logprobs=[None, -0.1])
    decoded = deserialize_sample_response(sample_response_proto(result))
    assert decoded.sequences[0].logprobs == np.asarray(logprobs, dtype=np.float32).tolist()
    assert decoded.prompt_logprobs[0] is None and decoded.prompt_logprobs[1] == pytest.approx(-0.1, rel=1e-7)


def test_json_body_has_the_pre_protobuf_sdk_shape():
    body = json.loads(json.dumps(sample_response_json(FULL)))
    assert body["type"] == "sample"
    assert body["sequences"][0] == {"stop_reason": "stop", "tokens": [5, 70000, 2], "logprobs": [-0.5, -1.25, -3.0]}
    assert body["prompt_logprobs"] == [None, -2.5, -0.75]
    assert body["topk_prompt_logprobs"] == [None, [[3, -0.25], [4, -2.0]], [[8, -0.75], [1, -1.5]]]
    bare = sample_response_json(SampleResult(sequences=[]))
    assert bare == {"type": "sample", "sequences": []}


def test_content_type_follows_the_accept_header():
    body, kind = encode_sample_response(FULL, "application/x-protobuf")
    assert kind == PROTOBUF_CONTENT_TYPE and deserialize_sample_response(body).sequences[0].tokens == [5, 70000, 2]
    for accept in (None, "application/json", "*/*"):
        body, kind = encode_sample_response(FULL, accept)
        assert kind == JSON_CONTENT_TYPE and json.loads(body)["sequences"][2]["tokens"] == [1]
    assert not math.isnan(json.loads(encode_sample_response(FULL, None)[0])["prompt_logprobs"][1])
