"""Sampling through the gateway with the official SDK (`tinker` 0.38.0), end to end.

A controller (port 0) knows a real sglang-router in front of one builtin engine serving a
tiny model. A small test-side driver runs the clients' commands: its
`save_weights_for_sampler` writes a PEFT directory (a random adapter, `conftest.py`) where the
command says, as the trainer's driver does. Every answer the SDK decodes is compared with
the sampler's own answer (`miles.controller.tinker.sampler`) for the same request.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from miles.controller.tinker import sampler as tinker_sampler
from miles.controller.tinker.gateway import GatewayConfig
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.types import (
    ClientCommand,
    OptimStepCommand,
    OptimStepResult,
    SamplerSnapshot,
    SamplingRequestParams,
    SaveForSamplerCommand,
    WeightsResult,
)
from tests.helpers.controller_fakes import ThreadedController, controller_config

TOKEN = "tml-sampling-test-token"
BASE = "tiny-base"
PROMPT = [3, 14, 15, 9, 26, 5]
MAX_RANK = 4


@pytest.fixture(autouse=True)
def no_sdk_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


class SnapshotDriver:
    """Plays the trainer's driver for saves and steps: a save_weights_for_sampler writes the
    test adapter to the command's directory."""

    def __init__(self, plane: ThreadedController, adapter: Path) -> None:
        self.plane, self.adapter = plane, adapter
        self.ran: list[ClientCommand] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        controller = self.plane.controller
        while not self._stop.is_set():
            for command in self.plane.call(controller.take_client_commands()).commands:
                request = command.request
                result: OptimStepResult | WeightsResult = WeightsResult()
                if isinstance(request, SaveForSamplerCommand):
                    shutil.copytree(self.adapter, request.directory)
                elif isinstance(request, OptimStepCommand):
                    result = OptimStepResult(metrics={})
                self.ran.append(command)  # before its future completes: the client reads `ran` once it has
                self.plane.call(controller.complete_client_command(command.future_id, result))
            self.plane.call(controller.wait_for_client_commands(0.2))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults, router_url: str) -> Iterator[ThreadedController]:
    config = controller_config(data_root, defaults, n_slots=2, token=TOKEN,
                               gateway=GatewayConfig(base_model=BASE, retrieve_poll_s=1.0))
    controller = ThreadedController(config, router_url=router_url)
    yield controller
    controller.close()


@pytest.fixture
def driver(plane: ThreadedController, adapter_dir: Path) -> Iterator[SnapshotDriver]:
    fake = SnapshotDriver(plane, adapter_dir)
    yield fake
    fake.close()


def reference(router_url: str, snapshot: SamplerSnapshot | None, params: SamplingRequestParams,
              prompt: list[int] = PROMPT) -> tinker_sampler.SampleResult:
    """The sampler's own answer for the same request."""
    return asyncio.run(tinker_sampler.sample(router_url, snapshot, prompt, params))


def tokens_of(response: types.SampleResponse) -> list[list[int]]:
    return [list(s.tokens) for s in response.sequences]


def test_the_base_model_is_sampled_as_the_sampler_samples_it(plane: ThreadedController, router_url: str) -> None:
    rest = tinker.RestClient(base_url=plane.url, api_key=TOKEN)
    (supported,) = rest.get_server_capabilities().result(timeout=30).supported_models
    assert supported.sampleable
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        client = service.create_sampling_client(base_model=BASE).result(timeout=30)
        assert client.get_base_model() == BASE
        prompt = types.ModelInput.from_ints(PROMPT)

        seeded = client.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=7, temperature=1.0, stop=[]))
        response = seeded.result(timeout=120)
        expected = reference(router_url, None, SamplingRequestParams(num_samples=3, max_tokens=6, seed=7, stop=[]))
        assert tokens_of(response) == [s.tokens for s in expected.sequences]
        assert len({tuple(t) for t in tokens_of(response)}) == 3  # seed + i per sample
        for got, want in zip(response.sequences, expected.sequences, strict=True):
            assert got.stop_reason == "length" and len(got.tokens) == 6
            assert list(got.logprobs or []) == pytest.approx(want.logprobs, abs=1e-5)  # float32 on the wire
        again = client.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=7, stop=[])).result(timeout=120)
        assert tokens_of(again) == tokens_of(response)

        greedy = client.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[]))
        tokens = tokens_of(greedy.result(timeout=120))[0]
        stop_token = tokens[3]
        stopped = client.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_token]))
        (sequence,) = stopped.result(timeout=120).sequences
        assert sequence.stop_reason == "stop" and list(sequence.tokens) == tokens[:tokens.index(stop_token) + 1]

        scored = client.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0.0),
                               include_prompt_logprobs=True, topk_prompt_logprobs=2).result(timeout=120)
        logprobs = client.compute_logprobs(prompt).result(timeout=120)
        want_logprobs = asyncio.run(tinker_sampler.compute_logprobs(router_url, None, PROMPT))
        assert logprobs[0] is None and want_logprobs[0] is None
        assert logprobs[1:] == pytest.approx(want_logprobs[1:], abs=1e-5)
        assert scored.prompt_logprobs is not None and scored.prompt_logprobs[1:] == pytest.approx(logprobs[1:],
                                                                                                   abs=1e-5)
        assert scored.topk_prompt_logprobs is not None and scored.topk_prompt_logprobs[0] is None
        assert all(len(row) == 2 for row in scored.topk_prompt_logprobs[1:])


def test_a_saved_snapshot_is_sampled_by_its_tinker_path(plane: ThreadedController, driver: SnapshotDriver,
                                                        router_url: str) -> None:
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        trainer = service.create_lora_training_client(BASE, rank=MAX_RANK, train_unembed=False).result(timeout=30)
        saved = trainer.save_weights_for_sampler("s1").result(timeout=30)
        assert saved.path == f"tinker://{trainer.model_id}/sampler_weights/s1"
        save = driver.ran[-1].request
        assert isinstance(save, SaveForSamplerCommand) and Path(save.directory, "adapter_config.json").is_file()
        snapshot = SamplerSnapshot(model_id=trainer.model_id, name="s1", directory=save.directory)
        with pytest.raises(tinker.RequestFailedError, match="snapshots are immutable"):
            trainer.save_weights_for_sampler("s1").result(timeout=30)

        client = service.create_sampling_client(model_path=saved.path).result(timeout=30)
        assert client.get_base_model() == BASE
        prompt = types.ModelInput.from_ints(PROMPT)
        params = SamplingRequestParams(num_samples=2, max_tokens=5, seed=11, stop=[])
        response = client.sample(prompt, 2, types.SamplingParams(max_tokens=5, seed=11, stop=[])).result(timeout=120)
        expected = reference(router_url, snapshot, params)
        assert tokens_of(response) == [s.tokens for s in expected.sequences]
        base = reference(router_url, None, params)
        assert tokens_of(response) != [s.tokens for s in base.sequences]  # the snapshot, not the base model
        logprobs = client.compute_logprobs(prompt).result(timeout=120)
        want = asyncio.run(tinker_sampler.compute_logprobs(router_url, snapshot, PROMPT))
        assert logprobs[1:] == pytest.approx(want[1:], abs=1e-5)

        # save_weights_and_get_sampling_client: an unnamed snapshot and a sampling session in one call.
        quick = trainer.save_weights_and_get_sampling_client().result(timeout=60)
        unnamed = driver.ran[-1].request
        assert isinstance(unnamed, SaveForSamplerCommand) and unnamed.name.startswith("sampler-seq-")
        same = quick.sample(prompt, 2, types.SamplingParams(max_tokens=5, seed=11, stop=[])).result(timeout=120)
        assert tokens_of(same) == tokens_of(response)  # the driver wrote the same adapter again

        session = tinker.RestClient(base_url=plane.url, api_key=TOKEN).get_session(
            service.holder.get_session_id()).result(timeout=30)
        assert len(session.sampler_ids) == 2


def test_paths_that_name_no_snapshot_fail_at_once_with_the_path(plane: ThreadedController,
                                                                driver: SnapshotDriver) -> None:
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        trainer = service.create_lora_training_client(BASE, rank=2, train_unembed=False).result(timeout=30)
        never = f"tinker://{trainer.model_id}/sampler_weights/never"
        refusals = [
            ("tinker://nobody:train:0/sampler_weights/s", tinker.NotFoundError, "model 'nobody:train:0' is unknown"),
            (never, tinker.NotFoundError, "never ran save_weights_for_sampler"),
            (f"tinker://{trainer.model_id}/weights/w", tinker.BadRequestError, "not a sampler snapshot path"),
        ]
        for path, error, message in refusals:
            started = time.monotonic()
            with pytest.raises(error, match=message) as raised:
                service.create_sampling_client(model_path=path).result(timeout=30)
            assert path in str(raised.value)
            assert time.monotonic() - started < 5  # refused, not retried
        with pytest.raises(tinker.BadRequestError, match="'other-base' is not served here"):
            service.create_sampling_client(base_model="other-base").result(timeout=30)


def test_sampling_without_a_router_is_refused_at_once(data_root: Path, defaults: AdapterDefaults,
                                                      router_url: str) -> None:
    config = controller_config(data_root, defaults, token=TOKEN, gateway=GatewayConfig(base_model=BASE))
    plane = ThreadedController(config)
    try:
        with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
            client = service.create_sampling_client(base_model=BASE).result(timeout=30)
            prompt = types.ModelInput.from_ints(PROMPT)
            started = time.monotonic()
            with pytest.raises(tinker.BadRequestError, match="no inference router"):
                client.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result(timeout=30)
            assert time.monotonic() - started < 5
            plane.call(plane.controller.set_router_url(router_url))  # the trainer's engines are up now
            assert len(client.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result(timeout=120)
                       .sequences[0].tokens) <= 2
        with httpx.Client(base_url=plane.url, headers={"X-API-Key": TOKEN}, trust_env=False) as raw:
            unknown = raw.post("/api/v1/retrieve_future", json={"request_id": "sample-0123"})
            assert unknown.status_code == 404 and "sample again" in unknown.json()["detail"]
    finally:
        plane.close()


def retrieve(raw: httpx.Client, request_id: str) -> httpx.Response:
    """retrieve_future until the future is finished (each call long-polls up to a second here)."""
    for _ in range(120):
        answer = raw.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if answer.status_code != 200 or answer.json().get("type") != "try_again":
            return answer
    raise AssertionError(f"sample {request_id} never finished")


def test_json_clients_get_json_and_a_retried_sample_runs_once(plane: ThreadedController, router_url: str) -> None:
    with httpx.Client(base_url=plane.url, headers={"X-API-Key": TOKEN}, trust_env=False, timeout=60) as raw:
        session_id = raw.post("/api/v1/create_session", json={"sdk_version": "raw"}).json()["session_id"]
        created = raw.post("/api/v1/create_sampling_session", json={
            "session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE}).json()
        sampler_id = created["sampling_session_id"]
        assert raw.get(f"/api/v1/samplers/{sampler_id}").json() == {
            "sampler_id": sampler_id, "base_model": BASE, "model_path": None}
        body = {"sampling_session_id": sampler_id, "seq_id": 5, "num_samples": 2,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                "sampling_params": {"max_tokens": 4, "seed": 3, "stop": []}}
        first = raw.post("/api/v1/asample", json=body).json()
        assert raw.post("/api/v1/asample", json=body).json() == first  # a retry: the same future, run once
        assert len(first["sample_sequence_ids"]) == 2
        answer = retrieve(raw, first["request_id"])
        assert answer.headers["content-type"] == "application/json"  # it did not ask for protobuf
        expected = reference(router_url, None, SamplingRequestParams(num_samples=2, max_tokens=4, seed=3, stop=[]))
        assert answer.json()["type"] == "sample"
        assert [s["tokens"] for s in answer.json()["sequences"]] == [s.tokens for s in expected.sequences]

        # Clients before sampling sessions name the model in each request (no retry key then).
        by_name = {k: v for k, v in body.items() if k != "sampling_session_id"} | {"base_model": BASE}
        again = retrieve(raw, raw.post("/api/v1/asample", json=by_name).json()["request_id"]).json()
        for got, want in zip(again["sequences"], answer.json()["sequences"], strict=True):
            assert got["tokens"] == want["tokens"] and got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)

        image = {**body, "seq_id": 6, "prompt": {"chunks": [{"type": "image", "data": "x"}]}}
        refused = raw.post("/api/v1/asample", json=image)
        assert refused.status_code == 400 and "'image'" in refused.json()["detail"]
        assert refused.headers["x-should-retry"] == "false"
        unknown = raw.post("/api/v1/asample", json={**body, "sampling_session_id": f"{session_id}:sample:9"})
        assert unknown.status_code == 404 and "Unknown sampling session" in unknown.json()["detail"]
        outside = retrieve(raw, raw.post("/api/v1/asample", json={
            **body, "seq_id": 7, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [10**9]}]}}).json()[
            "request_id"]).json()
        assert outside["category"] == "user" and "HTTP 400" in outside["error"]
