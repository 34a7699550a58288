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
    UnsupportedSampleRequest,
    encode_sample_response,
    sample_request_from_json,
    sample_response_json,
    sample_response_proto,
)
from miles.utils.types import SampledSequence, SampleResult, SamplingRequestParams, StopReason

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


def sdk_body(**fields) -> dict:
    """A SampleRequest body exactly as the SDK's `asample` sends it."""
    from tinker import types
    from tinker._compat import model_dump

    request = types.SampleRequest(prompt=types.ModelInput.from_ints([1, 2, 3]), **fields)
    return json.loads(json.dumps(model_dump(request, exclude_unset=False, exclude_none=True, mode="json")))


def test_sample_request_from_the_sdk_body():
    from tinker import types

    body = sdk_body(num_samples=3, model_path="tinker://m/sampler_weights/s1", prompt_logprobs=True,
                    topk_prompt_logprobs=2, topk_sample_logprobs=1,
                    sampling_params=types.SamplingParams(max_tokens=5, stop=["\n\n", "END"], seed=11, temperature=0.5,
                                                         top_k=20, top_p=0.9))
    request = sample_request_from_json(body)
    assert request.prompt_tokens == [1, 2, 3] and request.model_path == "tinker://m/sampler_weights/s1"
    assert request.params == SamplingRequestParams(num_samples=3, max_tokens=5, temperature=0.5, top_p=0.9, top_k=20,
                                                   stop=["\n\n", "END"], seed=11, prompt_logprobs=True,
                                                   topk_prompt_logprobs=2, topk_sample_logprobs=1)
    ids = sample_request_from_json(sdk_body(base_model="tiny", sampling_params=types.SamplingParams(stop=[7, 8])))
    assert ids.model_path is None and ids.base_model == "tiny" and ids.params.stop == [7, 8]
    assert ids.params.max_tokens is None and ids.params.prompt_logprobs is False
    assert sample_request_from_json(sdk_body(base_model="tiny", sampling_params=types.SamplingParams())).params.stop \
        is None  # None keeps the end-of-sequence stop
    session = sample_request_from_json(sdk_body(sampling_session_id="s-1:sample:0", seq_id=4,
                                                sampling_params=types.SamplingParams(max_tokens=2)))
    assert (session.sampling_session_id, session.seq_id, session.model_path) == ("s-1:sample:0", 4, None)
    no_stop = sample_request_from_json(sdk_body(base_model="tiny", sampling_params=types.SamplingParams(stop=[])))
    assert no_stop.params.stop == []  # [] turns every stop off


def test_sample_requests_we_do_not_serve_are_refused_by_name():
    from tinker import types

    params = types.SamplingParams(max_tokens=2)
    with pytest.raises(UnsupportedSampleRequest, match="prompt_alt_tokens_k"):
        sample_request_from_json(sdk_body(base_model="b", sampling_params=params, prompt_alt_tokens_k=2))
    with pytest.raises(UnsupportedSampleRequest, match="record_stability_info"):
        sample_request_from_json(sdk_body(base_model="b", sampling_params=params, record_stability_info=True))
    with pytest.raises(UnsupportedSampleRequest, match="sampling_session_id, model_path"):
        sample_request_from_json(sdk_body(sampling_params=params))
    image = sdk_body(base_model="b", sampling_params=params)
    image["prompt"]["chunks"].append({"type": "image", "data": "..."})
    with pytest.raises(UnsupportedSampleRequest, match="'image'"):
        sample_request_from_json(image)
    with pytest.raises(UnsupportedSampleRequest, match="num_samples"):
        sample_request_from_json({**sdk_body(base_model="b", sampling_params=params), "num_samples": 0})
    with pytest.raises(UnsupportedSampleRequest, match="sampling_params.stop") as raised:
        sample_request_from_json({**sdk_body(base_model="b", sampling_params=params),
                                  "sampling_params": {"stop": ["a", 5, "secret-in-the-body"]}})
    assert "secret-in-the-body" not in str(raised.value)  # the body is never echoed back
