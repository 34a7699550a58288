"""Malformed and hostile requests against the Tinker routes (`/api/v1`) on loopback.

Two tables, both against one controller that already holds a session, a live model with
a finished checkpoint, a sampler snapshot and a sampling session, a second session's
model, and an unloaded model:

- `cases()`: each request is a 4xx whose detail names the problem (and never echoes a
  large body back), and nothing changes: registry, sessions, every model's command log
  and the SQLite file are as before;
- `refused_calls()`: calls of a live model whose body cannot run. The SDK has already
  numbered the call (its `seq_id`), so the gateway answers with a future that fails with
  the reason (category `user`); a bare 4xx would leave a hole in the model's `seq_id`
  order and every later call would wait for it forever. The only change is that one
  failed future at that `seq_id`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from miles.controller.tinker.gateway import GatewayConfig
from miles.controller.tinker.models import model_name
from miles.controller.tinker.routes import MAX_FORWARD_BACKWARD_BYTES, MAX_JSON_BYTES
from miles.controller.tinker.sample_wire import MAX_NUM_SAMPLES, MAX_SAMPLE_TOKENS
from miles.utils.adapter_config import AdapterDefaults
from tests.helpers.controller_fakes import LoopbackRouter, ThreadedController, controller_config

TOKEN = "tml-hostile-test-token"
BASE = "tiny-base"
TINKER_HOSTILE_CASES = 168
"""Requests in `cases()`; docs/RELIABILITY.md ("Hostile and malformed input") states this number."""
TINKER_REFUSED_CALLS = 30
"""Calls in `refused_calls()`; docs/RELIABILITY.md states this number too."""
RELIABILITY = Path(__file__).resolve().parents[3] / "docs" / "RELIABILITY.md"
MAX_DETAIL_BYTES = 2048
"""No refusal is longer: a huge name or body is never echoed back."""


@dataclass(frozen=True)
class World:
    """What the controller holds before the hostile requests."""

    session: str
    model: str
    """Live, with a finished checkpoint `ckpt` and sampler snapshot `snap`; its next seq_id is 3."""
    other: str
    """A model of another session."""
    unloaded: str
    """Unloaded after its optim_step (seq_id 1) was queued: that future failed."""
    sampler: str
    """A sampling session of `model`'s snapshot `snap`."""


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults, tmp_path: Path,
          loopback_servers: list[LoopbackRouter]) -> Iterator[ThreadedController]:
    # A router that answers 404 to any sample: a request let through would show as a 200.
    router = LoopbackRouter()
    loopback_servers.append(router)
    config = controller_config(data_root, defaults, n_slots=3, token=TOKEN,
                               registry_path=tmp_path / "controller" / "registry.sqlite",
                               gateway=GatewayConfig(base_model=BASE, retrieve_poll_s=0.0))
    controller = ThreadedController(config, router_url=router.url)
    yield controller
    controller.close()


@pytest.fixture
def http(plane: ThreadedController) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=plane.url, headers={"X-API-Key": TOKEN}, trust_env=False, timeout=30) as client:
        yield client


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def run_commands(plane: ThreadedController) -> None:
    """Play the driver: complete every runnable command (each take ends at a barrier)."""
    from miles.utils.types import WeightsResult

    while not (batch := plane.call(plane.controller.take_client_commands())).empty:
        for model in batch.models:
            assert not model.work and model.barrier is not None
            plane.call(plane.controller.complete_client_command(model.barrier.future_id, WeightsResult()))


def build_world(plane: ThreadedController, http: httpx.Client) -> World:
    def session() -> str:
        return str(ok(http.post("/api/v1/create_session", json={"sdk_version": "test"}))["session_id"])

    def model(session_id: str, seq: int) -> str:
        created = ok(http.post("/api/v1/create_model", json={
            "session_id": session_id, "model_seq_id": seq, "base_model": BASE,
            "lora_config": {"rank": 4, "train_unembed": False}}))
        return str(created["model_id"])

    main, second = session(), session()
    model_id, other = model(main, 0), model(second, 0)
    ok(http.post("/api/v1/save_weights", json={"model_id": model_id, "path": "ckpt", "seq_id": 1}))
    ok(http.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "path": "snap", "seq_id": 2}))
    run_commands(plane)
    sampler = ok(http.post("/api/v1/create_sampling_session", json={
        "session_id": main, "sampling_session_seq_id": 0,
        "model_path": f"tinker://{model_id}/sampler_weights/snap"}))["sampling_session_id"]
    unloaded = model(main, 1)
    queued = ok(http.post("/api/v1/optim_step", json={"model_id": unloaded, "seq_id": 1, "adam_params": {}}))
    ok(http.post("/api/v1/unload_model", json={"model_id": unloaded}))
    assert "was unloaded" in ok(http.post("/api/v1/retrieve_future", json=queued))["error"]
    return World(session=main, model=model_id, other=other, unloaded=unloaded, sampler=sampler)


def fingerprint(plane: ThreadedController) -> Any:
    """Everything a refused request must leave as it was: the registry, every session (with
    its sampling sessions), every model's command log, and what the SQLite file holds."""
    async def read() -> Any:
        controller = plane.controller
        gateway = controller.gateway
        assert controller.store is not None
        logs = {model_id: gateway.log.commands(model_name(model_id))
                for session in gateway.sessions.all() for model_id in session.model_ids}
        return ([s.to_json() for s in gateway.sessions.all()], logs, controller.store.load_sessions(),
                controller.store.load_futures())
    return plane.fingerprint(), plane.call(read())


def datum(tokens: list[int], **inputs: Any) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": [*tokens[1:], 0], **inputs})


def forward_backward(model_id: str, seq_id: int, data: list[types.Datum] | None = None,
                     loss_fn: str = "cross_entropy", **config: float) -> bytes:
    """A ForwardBackwardRequest as the SDK serialises it."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum([1, 2, 3])] if data is None else data, loss_fn=loss_fn,  # type: ignore[arg-type]
            loss_fn_config=config or None),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()  # type: ignore[no-any-return]


def proto(raw: bytes, **headers: str) -> dict[str, Any]:
    return {"content": raw, "headers": {"Content-Type": "application/x-protobuf", **headers}}


def body(raw: bytes | str, content_type: str = "application/json") -> dict[str, Any]:
    return {"content": raw.encode() if isinstance(raw, str) else raw, "headers": {"Content-Type": content_type}}


def js(value: Any) -> dict[str, Any]:
    """A JSON body, NaN and Infinity written as Python's json writes them."""
    return body(json.dumps(value))


Case = tuple[str, str, dict[str, Any], int, str | tuple[str, ...]]
"""(label, route under /api/v1, request kwargs, status, the words (or each of the words) the detail
must contain)."""
NO_KEY: dict[str, Any] = {"headers": {"X-API-Key": ""}}
WRONG_KEY: dict[str, Any] = {"headers": {"X-API-Key": "tml-not-the-token"}}


def cases(w: World) -> list[Case]:
    m, s = w.model, w.session
    big = "n" * 100_000
    ckpt, snap = f"tinker://{m}/weights/ckpt", f"tinker://{m}/sampler_weights/snap"
    key = "Missing or invalid token"

    def step(**adam: Any) -> dict[str, Any]:
        return js({"model_id": m, "seq_id": 3, "adam_params": adam})

    def sample(**fields: Any) -> dict[str, Any]:
        request = {"sampling_session_id": w.sampler, "seq_id": 0, "num_samples": 1,
                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                   "sampling_params": {"max_tokens": 4}}
        return js({**request, **fields})

    def params(**sampling: Any) -> dict[str, Any]:
        return sample(sampling_params={"max_tokens": 4, **sampling})

    def sampling_session(**fields: Any) -> dict[str, Any]:
        return js({"session_id": s, "sampling_session_seq_id": 5, **fields})

    def load(path: str, **fields: Any) -> dict[str, Any]:
        return js({"model_id": m, "seq_id": 3, "path": path, "optimizer": False, **fields})

    def from_state(path: str, **fields: Any) -> dict[str, Any]:
        return js({"session_id": s, "model_seq_id": 7, "path": path, "optimizer": False, **fields})

    def create(**fields: Any) -> dict[str, Any]:
        request = {"session_id": s, "model_seq_id": 9, "base_model": BASE,
                   "lora_config": {"rank": 4, "train_unembed": False}}
        return js({**request, **fields})

    def lora(**fields: Any) -> dict[str, Any]:
        return create(lora_config={"rank": 4, "train_unembed": False, **fields})

    auth = [
        (f"{label} {route}", route, kwargs, 401, key)
        for route in ["create_session", "session_heartbeat", "create_model", "get_info", "unload_model",
                      "forward_backward", "optim_step", "save_weights", "load_weights", "save_weights_for_sampler",
                      "create_sampling_session", "asample", "retrieve_future"]
        for label, kwargs in [("no key", NO_KEY), ("wrong key", WRONG_KEY)]
    ]
    return auth + [
        # -- create_session / session_heartbeat
        ("session: JSON list", "create_session", js([1, 2]), 422, "valid dictionary"),
        ("session: tags not a list", "create_session", js({"tags": "a"}), 422, "'tags'"),
        ("session: metadata a list", "create_session", js({"user_metadata": [1]}), 422, "'user_metadata'"),
        ("session: body over the cap", "create_session",
         body(b'{"tags": ["' + b"x" * MAX_JSON_BYTES + b'"]}'), 413, "over 1048576 bytes"),
        ("heartbeat: unknown session", "session_heartbeat", js({"session_id": "s-ghost"}), 404,
         "Unknown session 's-ghost'"),
        ("heartbeat: session_id of 100,000 characters", "session_heartbeat", js({"session_id": big}), 422,
         ("'session_id'", "at most 512 characters")),
        ("heartbeat: missing session_id", "session_heartbeat", js({}), 422, "'session_id'"),
        ("heartbeat: session_id a number", "session_heartbeat", js({"session_id": 5}), 422, "'session_id'"),
        ("heartbeat: not JSON", "session_heartbeat", body("{session_id: x"), 422, "Malformed body"),
        ("heartbeat: invalid UTF-8", "session_heartbeat", body(b'{"session_id": "\xff"}'), 422, "Malformed body"),
        ("heartbeat: form encoded", "session_heartbeat",
         body("session_id=x", "application/x-www-form-urlencoded"), 422, "Malformed body"),
        # -- create_model
        ("create: missing base_model", "create_model", js({"session_id": s, "model_seq_id": 9}), 422,
         "'base_model'"),
        ("create: unknown session", "create_model", create(session_id="s-ghost"), 404, "Unknown session 's-ghost'"),
        ("create: negative model_seq_id", "create_model", create(model_seq_id=-1), 422,
         ("'model_seq_id'", "greater than or equal to 0")),
        ("create: model_seq_id a float", "create_model", create(model_seq_id=1.5), 422, "'model_seq_id'"),
        ("create: model_seq_id 2**64", "create_model", create(model_seq_id=2**64), 422,
         ("'model_seq_id'", "less than or equal to 9223372036854775807")),
        ("create: another base model", "create_model", create(base_model="other-base"), 400,
         "'other-base' is not served here"),
        ("create: base model of 100,000 characters", "create_model", create(base_model=big), 422,
         ("'base_model'", "at most 512 characters")),
        ("create: no lora_config", "create_model", create(lora_config=None), 400, "lora_config is required"),
        ("create: rank 0", "create_model", lora(rank=0), 400, "rank 0 must be in 1..8"),
        ("create: negative rank", "create_model", lora(rank=-4), 400, "rank -4 must be in 1..8"),
        ("create: rank 10**9", "create_model", lora(rank=10**9), 400, "must be in 1..8"),
        ("create: rank a list", "create_model", lora(rank=[4]), 422, "'lora_config', 'rank'"),
        ("create: rank not a number", "create_model", lora(rank="eight"), 422, "'lora_config', 'rank'"),
        ("create: train_unembed without --lora-unembed", "create_model", lora(train_unembed=True), 400,
         ("train_unembed=True", "--lora-unembed")),
        ("create: every layer frozen", "create_model", lora(train_attn=False, train_mlp=False), 400,
         "trains nothing"),
        ("create: another optimizer", "create_model", create(optimizer_config={"type": "sgd"}), 400,
         "optimizer_config.type 'sgd'"),
        ("create: optimizer name of 100,000 characters", "create_model", create(optimizer_config={"type": big}),
         422, ("'optimizer_config', 'type'", "at most 512 characters")),
        ("create: metadata a string", "create_model", create(user_metadata="x"), 422, "'user_metadata'"),
        # -- get_info / unload_model
        ("get_info: unknown model", "get_info", js({"model_id": "s-ghost:train:0"}), 404,
         "Unknown model 's-ghost:train:0'"),
        ("get_info: traversal model id", "get_info", js({"model_id": "../../etc"}), 404, "Unknown model '../../etc'"),
        ("get_info: model id of 100,000 characters", "get_info", js({"model_id": big}), 422,
         ("'model_id'", "at most 512 characters")),
        ("get_info: model_id a list", "get_info", js({"model_id": [m]}), 422, "'model_id'"),
        ("unload: unknown model", "unload_model", js({"model_id": "s-ghost:train:0"}), 404,
         "Unknown model 's-ghost:train:0'"),
        ("unload: registry name, not model id", "unload_model", js({"model_id": model_name(m)}), 404,
         "Unknown model"),
        ("unload: missing model_id", "unload_model", js({}), 422, "'model_id'"),
        # -- forward_backward (protobuf)
        ("fwdbwd: garbage", "forward_backward", proto(b"\xff\xff\xff"), 400, "varint"),
        ("fwdbwd: truncated", "forward_backward", proto(forward_backward(m, 3)[:-5]), 400, "truncated"),
        ("fwdbwd: JSON body (tinker 0.24 without the config)", "forward_backward",
         {"json": {"model_id": m, "seq_id": 3}}, 400, ("JSON forward_backward body is not served", "x-protobuf")),
        ("fwdbwd: protobuf sent as JSON", "forward_backward", body(forward_backward(m, 3)), 400,
         "JSON forward_backward body is not served"),
        ("forward: the JSON route (tinker 0.24 without the config)", "forward", js({"model_id": m, "seq_id": 3}), 400,
         ("/api/v1/forward is not served", "forward_only")),
        ("fwdbwd: model_id not UTF-8", "forward_backward", proto(b"\x0a\x02\xff\xfe"), 400, "not UTF-8"),
        ("fwdbwd: zstd", "forward_backward", proto(forward_backward(m, 3), **{"Content-Encoding": "zstd"}), 400,
         "Content-Encoding 'zstd'"),
        ("fwdbwd: gzip", "forward_backward", proto(forward_backward(m, 3), **{"Content-Encoding": "gzip"}), 400,
         "Content-Encoding 'gzip'"),
        ("fwdbwd: over the cap", "forward_backward",
         proto(b"\x0a" + b"\x80" * 3 + b"x" * (MAX_FORWARD_BACKWARD_BYTES + 1)), 413, "over 67108864 bytes"),
        ("fwdbwd: unknown model", "forward_backward", proto(forward_backward("s-ghost:train:0", 3)), 404,
         "Unknown model 's-ghost:train:0'"),
        ("fwdbwd: model id of 100,000 characters", "forward_backward", proto(forward_backward(big, 3)), 400,
         "a string field of 100000 bytes: ids and names take at most 512"),
        ("fwdbwd: no model id", "forward_backward", proto(forward_backward("", 3)), 404, "Unknown model ''"),
        ("fwdbwd: negative seq_id", "forward_backward", proto(forward_backward(m, -1)), 400,
         "seq_id -1 is behind the model's log (next expected 3)"),
        ("fwdbwd: seq_id 0", "forward_backward", proto(forward_backward(m, 0)), 400,
         "seq_id 0 is behind the model's log"),
        ("fwdbwd: seq_id of a save", "forward_backward", proto(forward_backward(m, 1)), 400,
         "seq_id 1 was already used by a save_state request, not forward_backward"),
        ("fwdbwd: unloaded model", "forward_backward", proto(forward_backward(w.unloaded, 2)), 404, "was unloaded"),
        ("fwdbwd: seq_id of a sampler save", "forward_backward", proto(forward_backward(m, 2, loss_fn="ppo")), 400,
         "seq_id 2 was already used by a save_weights_for_sampler request"),
        # -- optim_step
        ("optim: unknown model", "optim_step", js({"model_id": "s-ghost:train:0", "seq_id": 3, "adam_params": {}}),
         404, "Unknown model 's-ghost:train:0'"),
        ("optim: unloaded model", "optim_step", js({"model_id": w.unloaded, "seq_id": 2, "adam_params": {}}),
         404, "was unloaded"),
        ("optim: unloaded model, again", "optim_step", js({"model_id": w.unloaded, "seq_id": 3, "adam_params": {}}),
         404, "was unloaded"),
        ("optim: missing model_id", "optim_step", js({"seq_id": 3, "adam_params": {}}), 422, "'model_id'"),
        ("optim: missing seq_id", "optim_step", js({"model_id": m, "adam_params": {}}), 400, "seq_id is required"),
        ("optim: seq_id a string", "optim_step", js({"model_id": m, "seq_id": "three", "adam_params": {}}), 422,
         "'seq_id'"),
        ("optim: seq_id a float", "optim_step", js({"model_id": m, "seq_id": 3.5, "adam_params": {}}), 422,
         "'seq_id'"),
        ("optim: negative seq_id", "optim_step", js({"model_id": m, "seq_id": -3, "adam_params": {}}), 422,
         ("'seq_id'", "greater than or equal to 0")),
        ("optim: seq_id 2**64", "optim_step", js({"model_id": m, "seq_id": 2**64, "adam_params": {}}), 422,
         ("'seq_id'", "less than or equal to 9223372036854775807")),
        ("optim: seq_id behind the log", "optim_step", js({"model_id": m, "seq_id": 0, "adam_params": {}}), 400,
         "seq_id 0 is behind the model's log"),
        ("optim: seq_id of a save", "optim_step", js({"model_id": m, "seq_id": 1, "adam_params": {}}), 400,
         "seq_id 1 was already used by a save_state request, not optim_step"),
        ("optim: lr a string", "optim_step", step(learning_rate="fast"), 422, "'learning_rate'"),
        ("optim: adam_params a list", "optim_step", js({"model_id": m, "seq_id": 3, "adam_params": [1]}), 422,
         "'adam_params'"),
        ("optim: not JSON", "optim_step", body(b"\x80\x03pickle"), 422, "Malformed body"),
        ("optim: protobuf body", "optim_step", proto(forward_backward(m, 3)), 422, "Malformed body"),
        # -- save_weights / save_weights_for_sampler
        ("save: unknown model", "save_weights", js({"model_id": "s-ghost:train:0", "path": "a", "seq_id": 3}),
         404, "Unknown model 's-ghost:train:0'"),
        ("save: unloaded model", "save_weights", js({"model_id": w.unloaded, "path": "a", "seq_id": 2}),
         404, "was unloaded"),
        ("save: path a number", "save_weights", js({"model_id": m, "path": 5, "seq_id": 3}), 422, "'path'"),
        ("save: overwrite a string", "save_weights", js({"model_id": m, "path": "a", "seq_id": 3,
                                                        "overwrite": "maybe"}), 422, "'overwrite'"),
        ("save: metadata of numbers", "save_weights", js({"model_id": m, "path": "a", "seq_id": 3,
                                                         "user_metadata": {"a": [1]}}), 422, "'user_metadata'"),
        ("save: negative seq_id", "save_weights", js({"model_id": m, "path": "a", "seq_id": -1}), 422, "'seq_id'"),
        ("sampler save: inflight kind", "save_weights_for_sampler",
         js({"model_id": m, "path": "a", "seq_id": 3, "kind": "inflight"}), 400, "kind 'inflight' is not served"),
        ("sampler save: kind of 100,000 characters", "save_weights_for_sampler",
         js({"model_id": m, "path": "a", "seq_id": 3, "kind": big}), 422, ("'kind'", "at most 512 characters")),
        ("sampler save: unknown model", "save_weights_for_sampler",
         js({"model_id": "s-ghost:train:0", "path": "a", "seq_id": 3}), 404, "Unknown model 's-ghost:train:0'"),
        ("sampler save: unloaded model", "save_weights_for_sampler",
         js({"model_id": w.unloaded, "path": "a", "seq_id": 2}), 404, "was unloaded"),
        ("sampler save: negative sampling seq", "save_weights_for_sampler",
         js({"model_id": m, "seq_id": 3, "sampling_session_seq_id": -1}), 422, "'sampling_session_seq_id'"),
        # -- load_weights
        ("load: missing path", "load_weights", js({"model_id": m, "seq_id": 3, "optimizer": False}), 422, "'path'"),
        ("load: missing optimizer", "load_weights", js({"model_id": m, "seq_id": 3, "path": ckpt}), 422,
         "'optimizer'"),
        ("load: unknown model", "load_weights", load(ckpt, model_id="s-ghost:train:0"), 404,
         "Unknown model 's-ghost:train:0'"),
        ("load: unloaded model", "load_weights", load(ckpt, model_id=w.unloaded, seq_id=2), 404, "was unloaded"),
        ("load: neither model nor session", "load_weights", js({"path": ckpt, "optimizer": False}), 400,
         "needs model_id (and seq_id), or session_id and model_seq_id"),
        ("from state: unknown session", "load_weights", from_state(ckpt, session_id="s-ghost"), 404,
         "Unknown session 's-ghost'"),
        ("from state: negative model_seq_id", "load_weights", from_state(ckpt, model_seq_id=-2), 422,
         ("'model_seq_id'", "greater than or equal to 0")),
        ("from state: taken model_seq_id", "load_weights", from_state(ckpt, model_seq_id=0), 400,
         "already exists"),
        ("from state: traversal", "load_weights", from_state(f"tinker://{m}/weights/../../../etc"), 400,
         "is not a training checkpoint"),
        ("from state: dot-dot name", "load_weights", from_state(f"tinker://{m}/weights/.."), 400,
         "checkpoint name '..'"),
        ("from state: absolute path", "load_weights", from_state("/etc/passwd"), 400,
         "is not a training checkpoint"),
        ("from state: file URL", "load_weights", from_state("file:///etc/passwd"), 400,
         "is not a training checkpoint"),
        ("from state: unknown model's path", "load_weights", from_state("tinker://s-ghost:train:0/weights/ckpt"),
         404, "Unknown model 's-ghost:train:0'"),
        ("from state: another model's unsaved name", "load_weights",
         from_state(f"tinker://{w.other}/weights/ckpt"), 404, "never saved one by that name"),
        ("from state: a sampler path", "load_weights", from_state(snap), 400, "is not a training checkpoint"),
        ("from state: another optimizer", "load_weights", from_state(ckpt, optimizer_config={"type": "sgd"}), 400,
         "only AdamW"),
        ("from state: path of 100,000 characters", "load_weights", from_state(f"tinker://{m}/weights/{big}"),
         422, ("'path'", "at most 512 characters")),
        # -- create_sampling_session
        ("sampling session: unknown session", "create_sampling_session", sampling_session(
            session_id="s-ghost", model_path=snap), 404, "Unknown session 's-ghost'"),
        ("sampling session: neither path nor base", "create_sampling_session", sampling_session(), 400,
         "needs model_path"),
        ("sampling session: missing seq id", "create_sampling_session", js({"session_id": s, "base_model": BASE}),
         422, "'sampling_session_seq_id'"),
        ("sampling session: negative seq id", "create_sampling_session",
         sampling_session(sampling_session_seq_id=-1, base_model=BASE), 422, "'sampling_session_seq_id'"),
        ("sampling session: seq id 2**64", "create_sampling_session",
         sampling_session(sampling_session_seq_id=2**64, base_model=BASE), 422, "'sampling_session_seq_id'"),
        ("sampling session: another base model", "create_sampling_session", sampling_session(base_model="gpt"), 400,
         "'gpt' is not served here"),
        ("sampling session: unknown model", "create_sampling_session",
         sampling_session(model_path="tinker://s-ghost:train:0/sampler_weights/snap"), 404,
         "model 's-ghost:train:0' is unknown here"),
        ("sampling session: unsaved name", "create_sampling_session",
         sampling_session(model_path=f"tinker://{m}/sampler_weights/nope"), 404,
         "never ran save_weights_for_sampler('nope')"),
        ("sampling session: another model's name", "create_sampling_session",
         sampling_session(model_path=f"tinker://{w.other}/sampler_weights/snap"), 404,
         "never ran save_weights_for_sampler('snap')"),
        ("sampling session: a training checkpoint", "create_sampling_session", sampling_session(model_path=ckpt),
         400, "is not a sampler snapshot path"),
        ("sampling session: traversal", "create_sampling_session",
         sampling_session(model_path=f"tinker://{m}/sampler_weights/../../weights/ckpt"), 400,
         "is not a sampler snapshot path"),
        ("sampling session: absolute path", "create_sampling_session", sampling_session(model_path="/etc/passwd"),
         400, "is not a sampler snapshot path"),
        ("sampling session: path of 100,000 characters", "create_sampling_session",
         sampling_session(model_path=f"tinker://{m}/sampler_weights/{big}"), 422,
         ("'model_path'", "at most 512 characters")),
        # -- asample
        ("sample: unknown sampling session", "asample", sample(sampling_session_id="s-ghost:sample:0"), 404,
         "Unknown sampling session 's-ghost:sample:0'"),
        ("sample: sampling session of 100,000 characters", "asample", sample(sampling_session_id=big), 400,
         "sampling_session_id: String should have at most 512 characters"),
        ("sample: num_samples 0", "asample", sample(num_samples=0), 400, "num_samples: Input should be greater"),
        ("sample: num_samples 10**6", "asample", sample(num_samples=10**6), 400,
         f"num_samples: Input should be less than or equal to {MAX_NUM_SAMPLES}"),
        ("sample: num_samples a string", "asample", sample(num_samples="many"), 400, "num_samples"),
        ("sample: negative max_tokens", "asample", params(max_tokens=-1), 400, "sampling_params.max_tokens"),
        ("sample: max_tokens 10**12", "asample", params(max_tokens=10**12), 400,
         f"sampling_params.max_tokens: Input should be less than or equal to {MAX_SAMPLE_TOKENS}"),
        ("sample: negative temperature", "asample", params(temperature=-1.0), 400, "sampling_params.temperature"),
        ("sample: NaN temperature", "asample", params(temperature=float("nan")), 400,
         "sampling_params.temperature"),
        ("sample: top_p 0", "asample", params(top_p=0.0), 400, "sampling_params.top_p"),
        ("sample: top_p 2", "asample", params(top_p=2.0), 400, "sampling_params.top_p"),
        ("sample: top_k -5", "asample", params(top_k=-5), 400, "sampling_params.top_k"),
        ("sample: mixed stop", "asample", params(stop=["a", 1]), 400, "stop"),
        ("sample: negative top-k logprobs", "asample", sample(topk_prompt_logprobs=-1), 400,
         "topk_prompt_logprobs"),
        ("sample: prompt_logprobs_last_n 0", "asample", sample(prompt_logprobs_last_n=0), 400,
         "prompt_logprobs_last_n"),
        ("sample: no prompt", "asample", sample(prompt=None), 400, "prompt"),
        ("sample: no tokens", "asample", sample(prompt={"chunks": []}), 400, "prompt has no tokens"),
        ("sample: negative token", "asample", sample(prompt={"chunks": [{"tokens": [1, -2]}]}), 400,
         "prompt.chunks.0.tokens.1: Input should be greater than or equal to 0"),
        ("sample: tokens as text", "asample", sample(prompt={"chunks": [{"tokens": "hello"}]}), 400,
         "prompt.chunks.0.tokens"),
        ("sample: image chunk", "asample", sample(prompt={"chunks": [{"type": "image", "data": "x"}]}), 400,
         "prompt chunks of type 'image'"),
        ("sample: no model named", "asample", sample(sampling_session_id=None), 400,
         "give sampling_session_id, model_path"),
        ("sample: another base model", "asample", sample(sampling_session_id=None, base_model="gpt"), 400,
         "'gpt' is not served here"),
        ("sample: traversal model_path", "asample",
         sample(sampling_session_id=None, model_path=f"tinker://{m}/sampler_weights/../x"), 400,
         "is not a sampler snapshot path"),
        ("sample: unsaved model_path", "asample",
         sample(sampling_session_id=None, model_path=f"tinker://{w.other}/sampler_weights/snap"), 404,
         "never ran save_weights_for_sampler"),
        ("sample: target_prompt_logprobs", "asample", sample(target_prompt_logprobs=[1]), 400,
         "target_prompt_logprobs is not served"),
        ("sample: not JSON", "asample", body("{num_samples: 1"), 422, "Malformed body"),
        ("sample: over the cap", "asample", body(b'{"x": "' + b"x" * MAX_JSON_BYTES + b'"}'), 413,
         "over 1048576 bytes"),
        # -- retrieve_future
        ("retrieve: unknown future", "retrieve_future", js({"request_id": "nope"}), 404, "Unknown future 'nope'"),
        ("retrieve: unknown sample future", "retrieve_future", js({"request_id": "sample-nope"}), 404,
         "Unknown sample future 'sample-nope'"),
        ("retrieve: future id of 100,000 characters", "retrieve_future", js({"request_id": big}), 422,
         ("'request_id'", "at most 512 characters")),
        ("retrieve: missing request_id", "retrieve_future", js({}), 422, "'request_id'"),
        ("retrieve: request_id a number", "retrieve_future", js({"request_id": 7}), 422, "'request_id'"),
        ("retrieve: JSON string", "retrieve_future", js("nope"), 422, "valid dictionary"),
    ]


def refused_calls(w: World) -> list[tuple[str, str, Any, str]]:
    """(label, route, body builder of the call's seq_id, words its failed future's error contains)."""
    m = w.model

    def fb(**kwargs: Any) -> Any:
        return lambda seq: proto(forward_backward(m, seq, **kwargs))

    def step(**adam: Any) -> Any:
        return lambda seq: js({"model_id": m, "seq_id": seq, "adam_params": adam})

    def save(name: str, route: str = "save_weights") -> tuple[str, Any]:
        return route, lambda seq: js({"model_id": m, "path": name, "seq_id": seq})

    def load(path: str) -> Any:
        return lambda seq: js({"model_id": m, "seq_id": seq, "path": path, "optimizer": True})

    name_problem = "use 1-128 letters, digits"
    names = [("traversal", "../../escape"), ("absolute", "/etc/cron.d/x"), ("slash", "a/b"), ("dot-dot", ".."),
             ("NUL", "a\x00b"), ("newline", "a\nb"), ("unicode", "ädäpter"), ("300 characters", "n" * 300)]
    return [
        ("fwdbwd: unknown loss", "forward_backward", fb(loss_fn="mystery"), "loss_fn 'mystery' is not supported"),
        ("fwdbwd: no datums", "forward_backward", fb(data=[]), "at least one datum"),
        ("fwdbwd: empty model_input", "forward_backward", fb(data=[datum([])]), "data[0].model_input is empty"),
        ("fwdbwd: no target_tokens", "forward_backward",
         fb(data=[types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"weights": [1, 1]})]),
         "data[0].loss_fn_inputs needs target_tokens"),
        ("fwdbwd: weights of the wrong length", "forward_backward", fb(data=[datum([1, 2, 3], weights=[1.0])]),
         "data[0].loss_fn_inputs['weights'] has shape [1]"),
        ("optim: NaN lr", "optim_step", step(learning_rate=float("nan")), "['learning_rate'] must be finite"),
        ("optim: infinite lr", "optim_step", step(learning_rate=float("inf")), "['learning_rate'] must be finite"),
        ("optim: negative lr", "optim_step", step(learning_rate=-1e-3), "['learning_rate'] must be finite and >= 0"),
        ("optim: beta1 1.5", "optim_step", step(beta1=1.5), "beta1 1.5 must be in [0, 1)"),
        ("optim: beta1 1", "optim_step", step(beta1=1.0), "beta1 1.0 must be in [0, 1)"),
        ("optim: negative beta2", "optim_step", step(beta2=-0.1), "['beta2'] must be finite and >= 0"),
        ("optim: eps 0", "optim_step", step(eps=0.0), "eps must be > 0"),
        ("optim: negative weight decay", "optim_step", step(weight_decay=-1.0), "['weight_decay'] must be finite"),
        ("optim: NaN clip norm", "optim_step", step(grad_clip_norm=float("nan")), "['grad_clip_norm'] must be"),
        ("optim: another optimizer", "optim_step",
         lambda seq: js({"model_id": m, "seq_id": seq, "optimizer_params": {"type": "dimuon"}}),
         "optim_step needs adam_params"),
        *[(f"save: {label} name", *save(name), name_problem) for label, name in names],
        ("save: taken name", *save("ckpt"), "already has a checkpoint named 'ckpt'"),
        *[(f"sampler save: {label} name", *save(name, "save_weights_for_sampler"), name_problem)
          for label, name in names[:3]],
        ("sampler save: taken name", *save("snap", "save_weights_for_sampler"),
         "already has sampler weights named 'snap'"),
        ("load: traversal", "load_weights", load(f"tinker://{m}/weights/../../x"), "is not a training checkpoint"),
        ("load: another model's unsaved name", "load_weights", load(f"tinker://{w.other}/weights/ckpt"),
         "never saved one by that name"),
    ]


def detail_of(response: httpx.Response) -> str:
    if response.headers.get("content-type") == "application/json":
        return str(response.json().get("detail"))
    return response.text


def test_every_hostile_tinker_request_is_a_4xx_naming_the_problem_and_changes_nothing(
        plane: ThreadedController, http: httpx.Client) -> None:
    world = build_world(plane, http)
    table = cases(world)
    # Every case counted, none twice; docs/RELIABILITY.md states the same number.
    assert len({label for label, *_ in table}) == len(table) == TINKER_HOSTILE_CASES
    assert f"`tests/controller/tinker/test_tinker_hostile_input.py`, {TINKER_HOSTILE_CASES} cases" \
        in RELIABILITY.read_text()
    failures = []
    for label, route, kwargs, status, named in table:
        words = (named,) if isinstance(named, str) else named
        before = fingerprint(plane)
        response = http.post(f"/api/v1/{route}", **kwargs)
        detail = detail_of(response)
        if response.status_code != status or not all(w in detail for w in words):
            failures.append(f"{label}: HTTP {response.status_code} {detail[:300]}")
        if len(response.content) > MAX_DETAIL_BYTES:
            failures.append(f"{label}: a {len(response.content)}-byte answer")
        if response.status_code != 401 and response.headers.get("x-should-retry") != "false" \
                and response.status_code != 422:
            failures.append(f"{label}: not marked final (x-should-retry)")
        if fingerprint(plane) != before:
            failures.append(f"{label}: the state changed")
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}, label
    assert not failures, "\n".join(failures)


def test_calls_whose_body_cannot_run_fail_their_future_and_change_nothing_else(
        plane: ThreadedController, http: httpx.Client) -> None:
    world = build_world(plane, http)
    table = refused_calls(world)
    assert len({label for label, *_ in table}) == len(table) == TINKER_REFUSED_CALLS
    assert f"{TINKER_REFUSED_CALLS} calls of a live model" in RELIABILITY.read_text()
    name = model_name(world.model)
    failures = []
    for seq_id, (label, route, make, words) in enumerate(table, start=3):
        (registry, (sessions, logs, stored_sessions, futures)) = fingerprint(plane)
        answer = http.post(f"/api/v1/{route}", **make(seq_id))
        if answer.status_code != 200:
            failures.append(f"{label}: HTTP {answer.status_code} {detail_of(answer)[:300]}")
            continue
        future = http.post("/api/v1/retrieve_future", json={"request_id": answer.json()["request_id"]})
        outcome = future.json()
        if future.status_code != 200 or outcome.get("category") != "user" or words not in outcome.get("error", ""):
            failures.append(f"{label}: {str(outcome)[:300]}")
        if len(future.content) > MAX_DETAIL_BYTES:
            failures.append(f"{label}: a {len(future.content)}-byte error")
        # The one change: the failed future at this seq_id, which the driver never takes.
        after_registry, (after_sessions, after_logs, after_stored, after_futures) = fingerprint(plane)
        added = [f for f in after_logs[world.model] if f not in logs[world.model]]
        if [(f.seq_id, f.status.value, f.request) for f in added] != [(seq_id, "failed", None)]:
            failures.append(f"{label}: logged {added}")
        if (after_registry, after_sessions, after_stored) != (registry, sessions, stored_sessions) \
                or len(after_futures) != len(futures) + 1:
            failures.append(f"{label}: more than its future changed")
        assert plane.call(plane.controller.take_client_commands()).empty, label
    assert not failures, "\n".join(failures)
    assert plane.call(plane.controller.adapter_status(name)).step == 0
