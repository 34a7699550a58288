"""Sample futures (`miles.controller.tinker.sampling`) and their retrieve_future answers, without an engine.

Each sample's work is a coroutine of the test, so what the futures do around it (retries,
retention, errors by type, cancellation at close) is seen exactly.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from tinker import types
from tinker.proto.response_conv import deserialize_proto_response

from miles.controller.tinker.routes import sample_response
from miles.controller.tinker.sampler import Sampler, SamplingAbortedError, SamplingError
from miles.controller.tinker.sampling import NoRouterError, SampleFutures
from miles.utils.types import SampledSequence, SampleResult, StopReason

ROUTER = "http://127.0.0.1:9"
RESULT = SampleResult(sequences=[SampledSequence(tokens=[4, 2], logprobs=[-0.5, -0.25], stop_reason=StopReason.STOP)])


async def answer(result: SampleResult = RESULT) -> SampleResult:
    return result


async def test_a_retry_is_the_same_future_and_old_samples_are_forgotten() -> None:
    samples = SampleFutures(lambda: ROUTER, keep=2)
    gate = asyncio.Event()
    used: list[Sampler] = []

    async def run(sampler: Sampler) -> SampleResult:
        used.append(sampler)
        await gate.wait()
        return RESULT

    first = samples.submit("s:sample:0", 1, 2, run)
    assert samples.submit("s:sample:0", 1, 2, run) is first  # a retried request runs once
    assert first.future_id in samples and first.sequence_ids == [f"{first.future_id}-0", f"{first.future_id}-1"]
    pending = await samples.wait(first.future_id, 0.05)
    assert pending is first and not first.done
    assert json.loads(sample_response(first, None).body) == {
        "type": "try_again", "request_id": first.future_id, "queue_state": "active"}
    gate.set()
    done = await samples.wait(first.future_id, 5)
    assert done is not None and done.outcome() == RESULT
    assert [s.router_url for s in used] == [ROUTER]

    as_proto = sample_response(done, "application/x-protobuf")
    assert as_proto.media_type == "application/x-protobuf"
    decoded = deserialize_proto_response(bytes(as_proto.body), types.SampleResponse)
    assert list(decoded.sequences[0].tokens) == [4, 2] and decoded.sequences[0].stop_reason == "stop"
    as_json = json.loads(sample_response(done, "application/json").body)
    assert as_json["sequences"] == [{"stop_reason": "stop", "tokens": [4, 2], "logprobs": [-0.5, -0.25]}]

    later = [samples.submit("s:sample:0", seq, 1, lambda _: answer()) for seq in (2, 3)]
    await asyncio.gather(*(f.task for f in later))
    assert await samples.wait(first.future_id, 0) is None  # only the newest `keep` finished are kept
    assert samples.submit("s:sample:0", 1, 2, lambda _: answer()) is not first
    assert samples.submit("s:sample:0", None, 1, lambda _: answer()) is not samples.submit(
        "s:sample:0", None, 1, lambda _: answer())  # no seq_id: never taken for a retry
    await samples.aclose()


async def test_failures_say_whose_fault_and_aborted_samples_are_sent_again() -> None:
    samples = SampleFutures(lambda: ROUTER)

    async def fail(exc: Exception) -> SampleResult:
        raise exc

    cases = [
        (ValueError("the prompt is empty"), "user", "the prompt is empty"),
        (SamplingError("token outside the vocabulary", status=400), "user", "outside the vocabulary"),
        (SamplingError("engine crashed", status=500), "server", "engine crashed"),
        (httpx.ConnectError("refused"), "server", "the inference router did not answer"),
    ]
    for seq, (exc, category, words) in enumerate(cases):
        future = samples.submit("s:sample:0", seq, 1, lambda _, exc=exc: fail(exc))
        await samples.wait(future.future_id, 5)
        body = json.loads(sample_response(future, None).body)
        assert body["category"] == category and words in body["error"]
    aborted = samples.submit("s:sample:0", 99, 1, lambda _: fail(SamplingAbortedError("paused for a weight update")))
    await samples.wait(aborted.future_id, 5)
    response = sample_response(aborted, "application/x-protobuf")
    assert response.status_code == 410  # the SDK sends the sample again
    assert "paused" in json.loads(response.body)["detail"]
    await samples.aclose()


async def test_sampling_needs_a_router_and_close_cancels_what_runs() -> None:
    url: list[str | None] = [None]
    samples = SampleFutures(lambda: url[0])
    with pytest.raises(NoRouterError, match="no inference router"):
        samples.submit("s:sample:0", 1, 1, lambda _: answer())
    url[0] = ROUTER
    first = samples.sampler()
    url[0] = "http://127.0.0.1:10"
    assert samples.sampler() is not first and samples.sampler().router_url == "http://127.0.0.1:10"
    never = asyncio.Event()

    async def stuck(_: Sampler) -> SampleResult:
        await never.wait()
        raise AssertionError("unreachable")

    running = samples.submit("s:sample:0", 1, 1, stuck)
    await samples.aclose()
    assert running.task.cancelled()
    body = json.loads(sample_response(running, None).body)
    assert body["category"] == "server" and "cancelled" in body["error"]
