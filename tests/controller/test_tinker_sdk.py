"""The Tinker routes against the official SDK (`tinker` 0.38.0) and the controller alone.

The controller runs on loopback (port 0) as in the other HTTP tests; a small test-side
executor plays the driver through the controller's driver API (`take_client_commands`,
`complete_client_command`), answering each datum with made-up but well-formed outputs,
so what the SDK's `.result()` decodes can be checked number by number.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from miles.controller.client import ControlPlaneClient
from miles.controller.tinker.gateway import GatewayConfig
from miles.controller.tinker.models import model_name
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.types import (
    AdapterKind,
    AdapterState,
    ClientCommand,
    ClientCommandKind,
    DatumOutput,
    ForwardBackwardResult,
    ForwardCommand,
    OptimStepCommand,
    OptimStepResult,
    WeightsResult,
)
from miles.utils.types.lifecycle_ops import FreeSlots, RetireAdapters
from tests.helpers.controller_fakes import ThreadedController, controller_config

TOKEN = "tml-gateway-test-token"
BASE = "tiny-base"


@pytest.fixture(autouse=True)
def no_sdk_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def start_plane(data_root: Path, defaults: AdapterDefaults, registry: Path | None = None,
                n_slots: int = 2) -> ThreadedController:
    config = controller_config(data_root, defaults, n_slots=n_slots, token=TOKEN, registry_path=registry,
                               gateway=GatewayConfig(base_model=BASE, retrieve_poll_s=1.0))
    return ThreadedController(config)


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults) -> Iterator[ThreadedController]:
    controller = start_plane(data_root, defaults)
    yield controller
    controller.close()


@pytest.fixture
def raw(plane: ThreadedController) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=plane.url, headers={"X-API-Key": TOKEN}, trust_env=False, timeout=30) as http:
        yield http


def datum_outputs(command: ForwardCommand) -> ForwardBackwardResult:
    """Per position: logprob -(target % 7 + 1) / 10 and its weighted negative as the loss."""
    outputs = []
    for datum in command.datums:
        logprobs = [-(int(t) % 7 + 1) / 10 for t in datum.inputs["target_tokens"]]
        weights = datum.inputs.get("weights", [1.0] * len(logprobs))
        losses = [-lp * float(w) for lp, w in zip(logprobs, weights, strict=True)]
        outputs.append(DatumOutput({"logprobs": logprobs, "elementwise_loss": losses}, loss=sum(losses)))
    tokens = float(sum(len(d.tokens) for d in command.datums))
    return ForwardBackwardResult(outputs=outputs, metrics={"tokens:sum": tokens})


def run(plane: ThreadedController, command: ClientCommand) -> None:
    """Execute one command as a driver would (without a model), and report it."""
    if isinstance(command.request, ForwardCommand):
        result: ForwardBackwardResult | OptimStepResult | WeightsResult = datum_outputs(command.request)
    elif isinstance(command.request, OptimStepCommand):
        result = OptimStepResult(metrics={"learning_rate:mean": command.request.adam.learning_rate})
    else:
        result = WeightsResult()
    plane.call(plane.controller.complete_client_command(command.future_id, result))


class FakeDriver:
    """Takes and runs client commands in a thread until closed; remembers what it ran."""

    def __init__(self, plane: ThreadedController) -> None:
        self.plane = plane
        self.ran: list[ClientCommand] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for command in self.plane.call(self.plane.controller.take_client_commands()).commands:
                self.ran.append(command)  # before its future completes: the client reads `ran` once it has
                run(self.plane, command)
            self.plane.call(self.plane.controller.wait_for_client_commands(0.2))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def driver(plane: ThreadedController) -> Iterator[FakeDriver]:
    fake = FakeDriver(plane)
    yield fake
    fake.close()


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    targets = [*tokens[1:], 0]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": targets, "weights": weights or [1.0] * len(tokens)})


def test_a_training_client_trains_through_the_command_log(plane: ThreadedController, driver: FakeDriver) -> None:
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        trainer = service.create_lora_training_client(BASE, rank=4, seed=7, train_unembed=False).result(timeout=30)
        name = model_name(trainer.model_id)
        with ControlPlaneClient(plane.url, token=TOKEN) as cp:
            (status,) = cp.list()
        assert (status.name, status.kind, status.model_id, status.state, status.rank, status.seed) == (
            name, AdapterKind.CLIENT, trainer.model_id, AdapterState.PENDING, 4, 7)
        assert status.data is None and status.num_step is None
        snapshot = plane.call(plane.controller.snapshot())
        assert list(snapshot.clients) == [name] and not snapshot.live and not snapshot.sampleable
        assert trainer.get_info().model_data.model_name == BASE

        data = [datum([5, 6, 7], [0.0, 1.0, 1.0]), datum([8, 9])]
        fwd_bwd = trainer.forward_backward(data, "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=2e-4))
        result = fwd_bwd.result(timeout=30)
        assert result.loss_fn_output_type == "ArrayRecord"
        assert result.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-0.7, -0.1, -0.1])
        assert result.loss_fn_outputs[0]["elementwise_loss"].tolist() == pytest.approx([0.0, 0.1, 0.1])
        assert result.loss_fn_outputs[1]["logprobs"].tolist() == pytest.approx([-0.3, -0.1])
        assert result.metrics == pytest.approx({"tokens:sum": 5.0, "loss:sum": 0.2 + 0.4})
        assert step.result(timeout=30).metrics == pytest.approx({"learning_rate:mean": 2e-4})
        assert plane.call(plane.controller.adapter_status(name)).step == 1

        forward = trainer.forward([datum([1, 2])], "cross_entropy").result(timeout=30)
        assert forward.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-0.3, -0.1])
        saved = trainer.save_state("first").result(timeout=30)
        assert saved.path == f"tinker://{trainer.model_id}/weights/first"
        resume = plane.call(plane.controller.snapshot()).clients[name].resume_from
        assert resume is not None and resume.endswith(f"adapters/{name}/weights/first")

        kinds = [(c.seq_id, c.kind) for c in driver.ran]
        assert kinds == [(1, ClientCommandKind.FORWARD_BACKWARD), (2, ClientCommandKind.OPTIM_STEP),
                         (3, ClientCommandKind.FORWARD), (4, ClientCommandKind.SAVE_STATE)]
        sent = driver.ran[0].request
        assert isinstance(sent, ForwardCommand) and sent.loss.name == "cross_entropy"
        assert sent.datums[0].tokens == [5, 6, 7] and sent.datums[0].inputs["target_tokens"] == [6, 7, 0]
        assert driver.ran[1].request == OptimStepCommand(adam=driver.ran[1].request.adam)  # type: ignore[union-attr]
        assert driver.ran[1].request.adam.learning_rate == pytest.approx(2e-4)  # type: ignore[union-attr]
        save_dir = driver.ran[3].request.directory  # type: ignore[union-attr]
        assert save_dir.endswith(f"adapters/{name}/weights/first")

        session_id = service.holder.get_session_id()
        rest = tinker.RestClient(base_url=plane.url, api_key=TOKEN)
        session = rest.get_session(session_id).result(timeout=30)
        assert session.training_run_ids == [trainer.model_id]
    # Closing the service client finishes its session: its model is unloaded (RETIRING).
    assert plane.call(plane.controller.adapter_status(name)).state is AdapterState.RETIRING


def post_forward_backward(raw: httpx.Client, model_id: str, seq_id: int, data: list[types.Datum]) -> str:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    body = forward_backward_request_to_proto(request).SerializeToString()
    response = raw.post("/api/v1/forward_backward", content=body,
                        headers={"Content-Type": "application/x-protobuf"})
    assert response.status_code == 200, response.text
    return str(response.json()["request_id"])


def create_model(raw: httpx.Client, rank: int = 4, **lora: bool) -> tuple[str, str]:
    """(session id, model id) of a new model made over raw HTTP."""
    session = raw.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "test"})
    session_id = session.json()["session_id"]
    response = raw.post("/api/v1/create_model", json={
        "session_id": session_id, "model_seq_id": 0, "base_model": BASE,
        "lora_config": {"rank": rank, "train_unembed": False, **lora}})
    assert response.status_code == 200, response.text
    future = raw.post("/api/v1/retrieve_future", json={"request_id": response.json()["request_id"]}).json()
    return session_id, future["model_id"]


def test_a_retried_request_is_the_same_future_and_runs_once(plane: ThreadedController, raw: httpx.Client) -> None:
    _, model_id = create_model(raw)
    first = post_forward_backward(raw, model_id, 1, [datum([3, 4])])
    assert post_forward_backward(raw, model_id, 1, [datum([3, 4])]) == first
    step = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    step_id = raw.post("/api/v1/optim_step", json=step).json()["request_id"]
    assert raw.post("/api/v1/optim_step", json=step).json()["request_id"] == step_id
    pending = raw.post("/api/v1/retrieve_future", json={"request_id": first})
    assert pending.json() == {"type": "try_again", "request_id": first, "queue_state": "active"}

    (model,) = plane.call(plane.controller.take_client_commands()).models
    assert [c.future_id for c in model.work] == [first] and model.barrier is not None
    assert model.barrier.future_id == step_id
    for command in [*model.work, model.barrier]:
        run(plane, command)
    assert plane.call(plane.controller.take_client_commands()).empty
    assert post_forward_backward(raw, model_id, 1, [datum([3, 4])]) == first  # a late retry changes nothing
    assert plane.call(plane.controller.take_client_commands()).empty
    assert plane.call(plane.controller.adapter_status(model_name(model_id))).step == 1

    done = raw.post("/api/v1/retrieve_future", json={"request_id": first},
                    headers={"Accept": "application/x-protobuf"})
    assert done.headers["content-type"] == "application/x-protobuf"
    output = deserialize_forward_backward_output(done.content)
    assert output.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-0.5, -0.1])
    assert raw.post("/api/v1/retrieve_future", json={"request_id": step_id}).json() == {
        "metrics": {"learning_rate:mean": 1e-3}}
    unknown = raw.post("/api/v1/retrieve_future", json={"request_id": "nope"})
    assert unknown.status_code == 404 and unknown.headers["x-should-retry"] == "false"


def test_the_api_key_is_checked(plane: ThreadedController) -> None:
    with httpx.Client(base_url=plane.url, trust_env=False) as anonymous:
        assert anonymous.get("/api/v1/healthz").json() == {"status": "ok"}
        for headers in ({}, {"X-API-Key": "tml-wrong"}):
            response = anonymous.post("/api/v1/create_session", json={"tags": [], "sdk_version": "x"},
                                      headers=headers)
            assert response.status_code == 401, headers
            assert "X-API-Key" in response.json()["detail"]
    started = time.monotonic()
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=plane.url, api_key="tml-wrong").create_lora_training_client(
            BASE, rank=4, train_unembed=False).result(timeout=30)
    assert time.monotonic() - started < 10  # a 401 is not retried


def test_layouts_and_limits_are_refused_with_their_reason(plane: ThreadedController) -> None:
    service = tinker.ServiceClient(base_url=plane.url, api_key=TOKEN)
    refusals = [
        (dict(rank=4), tinker.BadRequestError, "train_unembed=True needs .* restart it with --lora-unembed"),
        (dict(rank=64, train_unembed=False), tinker.BadRequestError, r"rank 64 must be in 1\.\.8 .*--lora-rank"),
    ]
    for kwargs, error, message in refusals:
        with pytest.raises(error, match=message):
            service.create_lora_training_client(BASE, **kwargs).result(timeout=30)  # type: ignore[arg-type]
    with pytest.raises(tinker.BadRequestError, match="'other-base' is not served here"):
        service.create_lora_training_client("other-base", rank=4, train_unembed=False).result(timeout=30)
    assert plane.call(plane.controller.snapshot()).all_adapters_cleaned_up  # nothing was registered

    clients = [service.create_lora_training_client(BASE, rank=2, train_unembed=False).result(timeout=30)
               for _ in range(2)]
    started = time.monotonic()
    # Refused, not queued as a server-driven registration would be: its client waits on the answer.
    with pytest.raises(tinker.ConflictError,
                       match="all 2 slots are in use .*client models are not queued.*--multi-lora-n-adapters"):
        service.create_lora_training_client(BASE, rank=2, train_unembed=False).result(timeout=30)
    assert time.monotonic() - started < 5  # refused at once, not retried for minutes
    assert sorted(plane.call(plane.controller.snapshot()).clients) == sorted(model_name(c.model_id) for c in clients)
    service.close("success").result(timeout=30)
    assert {s.state for s in plane.call(plane.controller.snapshot()).clients.values()} == {AdapterState.RETIRING}


def test_unload_fails_queued_commands_and_frees_the_slot(plane: ThreadedController, raw: httpx.Client) -> None:
    _, model_id = create_model(raw)
    name = model_name(model_id)
    queued = post_forward_backward(raw, model_id, 1, [datum([1, 2])])
    unload = raw.post("/api/v1/unload_model", json={"model_id": model_id}).json()
    assert raw.post("/api/v1/retrieve_future", json={"request_id": unload["request_id"]}).json() == {
        "type": "unload_model", "model_id": model_id}
    failed = raw.post("/api/v1/retrieve_future", json={"request_id": queued}).json()
    assert failed["category"] == "user" and "was unloaded" in failed["error"]
    late = raw.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {}})
    assert late.status_code == 404 and "unloaded" in late.json()["detail"]
    assert plane.call(plane.controller.take_client_commands()).empty

    # The driver's normal lifecycle: retire, clean up, free the slot.
    assert name in plane.call(plane.controller.apply(RetireAdapters())).cleanup
    snapshot = plane.call(plane.controller.apply(FreeSlots([name])))
    assert name in snapshot.completed and snapshot.all_adapters_cleaned_up
    _, again = create_model(raw)
    assert plane.call(plane.controller.adapter_status(model_name(again))).slot == 0


def test_models_sessions_and_futures_survive_a_restart(data_root: Path, defaults: AdapterDefaults,
                                                       tmp_path: Path) -> None:
    registry = tmp_path / "controller" / "registry.sqlite"
    first = start_plane(data_root, defaults, registry)
    try:
        with httpx.Client(base_url=first.url, headers={"X-API-Key": TOKEN}, trust_env=False, timeout=30) as raw:
            session_id, model_id = create_model(raw)
            done = post_forward_backward(raw, model_id, 1, [datum([2, 3, 4])])
            (model,) = first.call(first.controller.take_client_commands()).models
            run(first, model.work[0])
            queued = post_forward_backward(raw, model_id, 2, [datum([9])])
    finally:
        first.close()

    second = start_plane(data_root, defaults, registry)
    try:
        with httpx.Client(base_url=second.url, headers={"X-API-Key": TOKEN}, trust_env=False, timeout=30) as raw:
            assert raw.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
            assert raw.get(f"/api/v1/sessions/{session_id}").json()["training_run_ids"] == [model_id]
            (status,) = raw.get("/adapter_runs").json()["adapters"]
            assert (status["model_id"], status["kind"], status["state"]) == (model_id, "client", "PENDING")
            answer = raw.post("/api/v1/retrieve_future", json={"request_id": done},
                              headers={"Accept": "application/x-protobuf"})
            assert deserialize_forward_backward_output(answer.content).loss_fn_outputs[0][
                "logprobs"].tolist() == pytest.approx([-0.4, -0.5, -0.1])
            assert post_forward_backward(raw, model_id, 2, [datum([9])]) == queued  # the same future
            (model,) = second.call(second.controller.take_client_commands()).models
            assert [c.future_id for c in model.work] == [queued]
    finally:
        second.close()


def test_checkpoints_custom_losses_and_service_queries(plane: ThreadedController, driver: FakeDriver) -> None:
    import warnings

    rest = tinker.RestClient(base_url=plane.url, api_key=TOKEN)
    (supported,) = rest.get_server_capabilities().result(timeout=30).supported_models
    assert (supported.model_name, supported.trainable) == (BASE, True)
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        trainer = service.create_lora_training_client(BASE, rank=4, train_unembed=False).result(timeout=30)
        assert rest.list_sessions().result(timeout=30).sessions == [service.holder.get_session_id()]

        saved = trainer.save_state("ckpt").result(timeout=30)
        # Refused after its seq_id is known: a failed future, and the client's later calls still run.
        with pytest.raises(tinker.RequestFailedError, match="already has a checkpoint named 'ckpt'"):
            trainer.save_state("ckpt").result(timeout=30)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # load_state is deprecated in the SDK, still served
            loaded = trainer.load_state_with_optimizer(saved.path).result(timeout=30)
        assert (loaded.path, loaded.model_id) == (saved.path, trainer.model_id)
        load = next(c for c in driver.ran if c.kind is ClientCommandKind.LOAD_STATE)
        assert load.request.optimizer and load.request.directory.endswith("weights/ckpt")  # type: ignore[union-attr]

        def loss(data: list[types.Datum], logprobs: list) -> tuple:
            total = sum((-lp).sum() for lp in logprobs)
            return total, {"custom:sum": float(total.detach())}

        custom = trainer.forward_backward_custom([datum([5, 6])], loss).result(timeout=30)
        assert custom.metrics["custom:sum"] == pytest.approx(0.7 + 0.1)
        forward, backward = [c for c in driver.ran if isinstance(c.request, ForwardCommand)][-2:]
        assert (forward.kind, backward.kind) == (ClientCommandKind.FORWARD, ClientCommandKind.FORWARD_BACKWARD)
        assert backward.request.datums[0].inputs["weights"] == pytest.approx([1.0, 1.0])  # type: ignore[union-attr]
        assert trainer.forward([datum([1, 2])], "cross_entropy").result(timeout=30).loss_fn_outputs  # not stuck

        for loss_fn, message in (("custom", "loss_fn 'custom' is not supported"),
                                 ("stable_reinforce", "loss_fn 'stable_reinforce' is not supported")):
            with pytest.raises(tinker.RequestFailedError, match=message):
                trainer.forward_backward([datum([1, 2])], loss_fn).result(timeout=30)  # type: ignore[arg-type]
        assert trainer.forward([datum([3])], "cross_entropy").result(timeout=30).loss_fn_outputs  # still not stuck


def test_bodies_that_cannot_be_read_are_refused(plane: ThreadedController, raw: httpx.Client) -> None:
    _, model_id = create_model(raw)
    proto = {"Content-Type": "application/x-protobuf"}
    garbage = raw.post("/api/v1/forward_backward", content=b"\xff\xff\xff", headers=proto)
    assert garbage.status_code == 400 and garbage.headers["x-should-retry"] == "false"
    zstd = raw.post("/api/v1/forward_backward", content=b"(\xb5/\xfd", headers={**proto, "Content-Encoding": "zstd"})
    assert zstd.status_code == 400 and "Content-Encoding 'zstd'" in zstd.json()["detail"]
    not_json = raw.post("/api/v1/optim_step", content=b"\x80\x03pickle", headers={"Content-Type": "application/json"})
    assert not_json.status_code == 422 and "Malformed body" in not_json.text
    missing = raw.post("/api/v1/optim_step", json={"seq_id": 1})
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "model_id"]
    assert raw.post("/api/v1/telemetry", json={"events": []}).json() == {"status": "accepted"}

    sampler = raw.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "path": "s1", "seq_id": 1})
    (model,) = plane.call(plane.controller.take_client_commands()).models
    assert model.barrier is not None and model.barrier.future_id == sampler.json()["request_id"]
    assert model.barrier.request.tinker_path == f"tinker://{model_id}/sampler_weights/s1"  # type: ignore[union-attr]
    run(plane, model.barrier)
    assert raw.post("/api/v1/retrieve_future", json={"request_id": sampler.json()["request_id"]}).json() == {
        "type": "save_weights_for_sampler", "path": f"tinker://{model_id}/sampler_weights/s1"}


def test_a_training_client_is_made_from_a_saved_state(plane: ThreadedController, driver: FakeDriver) -> None:
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        first = service.create_lora_training_client(BASE, rank=3, seed=11, train_unembed=False).result(timeout=30)
        saved = first.save_state("warm").result(timeout=30)
        resumed = service.create_training_client_from_state_with_optimizer(saved.path).result(timeout=30)
        assert resumed.model_id != first.model_id and resumed.get_info().lora_rank == 3
        load = driver.ran[-1]
        assert (load.model, load.seq_id, load.kind) == (model_name(resumed.model_id), 0, ClientCommandKind.LOAD_STATE)
        assert load.request.optimizer and load.request.tinker_path == saved.path  # type: ignore[union-attr]
        status = plane.call(plane.controller.adapter_status(model_name(resumed.model_id)))
        assert (status.rank, status.seed, status.slot) == (3, 11, 1)
        # Its own calls start at seq_id 1, after the load.
        out = resumed.forward_backward([datum([4, 5])], "cross_entropy").result(timeout=30)
        assert out.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-0.6, -0.1])
        assert driver.ran[-1].seq_id == 1
        started = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match="all 2 slots are in use"):
            service.create_training_client_from_state(saved.path).result(timeout=30)
        assert time.monotonic() - started < 5  # failed at once, not retried

        # The first model unloaded and cleaned up, its checkpoint still loads into a new model.
        with httpx.Client(base_url=plane.url, headers={"X-API-Key": TOKEN}, trust_env=False) as raw:
            assert raw.post("/api/v1/unload_model", json={"model_id": first.model_id}).status_code == 200
        plane.call(plane.controller.apply(RetireAdapters()))
        plane.call(plane.controller.apply(FreeSlots([model_name(first.model_id)])))
        weights_only = service.create_training_client_from_state(saved.path).result(timeout=30)
        assert not driver.ran[-1].request.optimizer  # type: ignore[union-attr]
        assert weights_only.model_id.endswith(":train:3")
        with pytest.raises(tinker.NotFoundError, match="never saved one by that name"):
            service.create_training_client_from_state(saved.path.replace("warm", "cold")).result(timeout=30)


def test_a_new_trainer_fails_what_the_old_one_was_running(plane: ThreadedController, raw: httpx.Client) -> None:
    _, model_id = create_model(raw)
    running = post_forward_backward(raw, model_id, 1, [datum([1, 2])])
    assert not plane.call(plane.controller.take_client_commands()).empty
    queued = post_forward_backward(raw, model_id, 2, [datum([3])])
    plane.call(plane.controller.requeue_for_new_trainer())
    failed = raw.post("/api/v1/retrieve_future", json={"request_id": running}).json()
    assert failed["category"] == "server" and "trainer restarted" in failed["error"]
    (model,) = plane.call(plane.controller.take_client_commands()).models  # the queued one runs next
    assert [c.future_id for c in model.work] == [queued]


def test_bodies_over_the_limit_are_refused_before_they_are_read(raw: httpx.Client) -> None:
    from miles.controller.tinker.routes import MAX_JSON_BYTES

    def stream():
        yield b'{"session_id": "'
        for _ in range(MAX_JSON_BYTES // 65536 + 1):
            yield b"x" * 65536

    response = raw.post("/api/v1/session_heartbeat", content=stream())  # chunked: no Content-Length
    assert response.status_code == 413 and "over 1048576 bytes" in response.json()["detail"]
