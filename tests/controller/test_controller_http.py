"""The control-plane HTTP API against a real uvicorn server on 127.0.0.1.

The controller's loop runs in a background thread; requests go over loopback with the
project's own client and raw httpx. Every rejected request is checked to leave the
registry exactly as it was.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from miles.controller.actor import ControllerConfig, MultiLoRAController
from miles.controller.backend import ControllerHooks, MultiLoRABackend
from miles.controller.client import ControlPlaneClient, ControlPlaneError
from miles.controller.http_server import HTTPServerConfig, MultiLoRAHTTPServer
from miles.controller.tinker.models import LoraLayout
from miles.controller.tinker.sessions import SessionInfo
from miles.utils.adapter_config import ADAPTER_CONFIG_KEYS, AdapterDefaults
from miles.utils.arguments import parse_args
from miles.utils.plugins import load_subclass
from miles.utils.types import (
    AdamStep,
    AdapterFailure,
    AdapterGauges,
    AdapterState,
    ClientCommandKind,
    OptimStepCommand,
)
from miles.utils.types.lifecycle_ops import (
    ActivateClients,
    FailAdapter,
    FreeSlots,
    RecordWeightUpdate,
    RetireAdapters,
    SetStep,
)
from tests.helpers.controller_fakes import ROLLOUT_HOOKS, LoopbackRouter, ThreadedController, controller_config

TOKEN = "s3cret-token"


class ExtraRouteServer(MultiLoRAHTTPServer):
    """A user extension: one more route, the rest inherited (auth included)."""

    def add_routes(self, app) -> None:
        super().add_routes(app)

        @app.get("/slots/free")
        async def free_slots() -> dict:
            return {"free": self.backend.registry.free_slots}


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults,
          loopback_servers: list[LoopbackRouter]) -> Iterator[ThreadedController]:
    router = LoopbackRouter(mode="list_workers")  # plays its own single worker
    loopback_servers.append(router)
    config = controller_config(data_root, defaults, n_slots=2, token=TOKEN,
                               http_server_path=f"{__name__}.ExtraRouteServer")
    controller = ThreadedController(config, router_url=router.url)
    controller.router = router  # type: ignore[attr-defined]
    yield controller
    controller.close()


@pytest.fixture
def client(plane: ThreadedController) -> Iterator[ControlPlaneClient]:
    with ControlPlaneClient(plane.url, token=TOKEN) as cp:
        yield cp


@pytest.fixture
def raw(plane: ThreadedController) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=plane.url, headers={"Authorization": f"Bearer {TOKEN}"}, trust_env=False) as http:
        yield http


def data_path(data_root: Path) -> str:
    return str(data_root / "data" / "train.jsonl")


def test_full_lifecycle_seen_through_state_route(plane: ThreadedController, client: ControlPlaneClient,
                                                 data_root: Path) -> None:
    backend = plane.controller.backend
    assert client.register("a", config={"data": data_path(data_root)}) == 0
    assert client.states(["a", "ghost"]) == {"a": AdapterState.PENDING, "ghost": None}

    plane.call(plane.controller.apply(RecordWeightUpdate(["a"])))
    assert client.states(["a"])["a"] is AdapterState.ACTIVE
    assert client.status("a").version == 1

    client.deregister("a")
    assert client.states(["a"])["a"] is AdapterState.RETIRING
    assert plane.router.aborts == []  # DELETE sends no abort

    assert plane.call(plane.controller.apply(RetireAdapters())).cleanup == {"a"}
    assert client.wait_for_state("a", AdapterState.CLEANUP, timeout=5) is AdapterState.CLEANUP
    assert plane.router.aborts == [{"rid": "a::", "prefix": True}]

    assert plane.call(plane.controller.apply(FreeSlots(["a"]))).completed == {"a"}
    assert client.states(["a"])["a"] is AdapterState.COMPLETED
    assert plane.router.aborts == [{"rid": "a::", "prefix": True}] * 2
    status = client.status("a")
    assert (status.state, status.version, status.slot) == (AdapterState.COMPLETED, None, 0)
    assert [s.name for s in client.list()] == ["a"]
    assert backend.registry.free_slots == [0, 1]


def test_a_failed_adapter_is_seen_with_its_error_over_http_metrics_and_miles_lora(
        plane: ThreadedController, client: ControlPlaneClient, raw: httpx.Client, data_root: Path) -> None:
    from typer.testing import CliRunner

    from miles.controller.cli import app

    client.register("bad", config={"data": data_path(data_root)})
    client.register("good", config={"data": data_path(data_root)})
    plane.call(plane.controller.apply(RecordWeightUpdate(["bad", "good"])))
    registration = client.status("bad").registration_id
    failure = AdapterFailure.from_exception(ZeroDivisionError("division by zero in my_reward"), groups=32)
    assert "bad" in plane.call(plane.controller.apply(FailAdapter("bad", registration, failure))).cleanup
    assert plane.router.aborts == [{"rid": "bad::", "prefix": True}]  # its requests in flight, at once
    during = client.status("bad")
    assert (during.state, during.last_error) == (AdapterState.CLEANUP, failure)
    plane.call(plane.controller.apply(FreeSlots(["bad"])))  # after the trainer's final save

    body = raw.get("/adapter_runs/bad").json()
    assert (body["state"], body["version"]) == ("FAILED", None)
    assert body["last_error"] == {"reason": "errors", "error_type": "ZeroDivisionError",
                                  "message": "division by zero in my_reward", "groups": 32}
    assert raw.get("/adapter_runs/good").json()["last_error"] is None
    assert client.states(["bad", "good"]) == {"bad": AdapterState.FAILED, "good": AdapterState.ACTIVE}
    metrics = client.metrics()
    assert re.search(r'^miles_controller_adapters\{state="FAILED"\} 1\.0$', metrics, flags=re.M)
    assert 'miles_adapter_step{adapter="bad"}' not in metrics  # no slot, no per-adapter series

    def cli(*args: str) -> str:
        result = CliRunner().invoke(app, ["--url", plane.url, "--token", TOKEN, *args])
        assert result.exit_code == 0, result.output
        return result.stdout

    listed = cli("list").splitlines()
    assert [line.split()[:2] for line in listed[1:3]] == [["good", "ACTIVE"], ["bad", "FAILED"]]
    assert listed[3:] == ["bad failed: ZeroDivisionError: division by zero in my_reward (32 groups in a row)"]
    assert 'last_error: {"reason": "errors", "error_type": "ZeroDivisionError", ' in cli("get", "bad")

    # A fixed config registers the name again; the new registration has no error.
    assert client.register("bad", config={"data": data_path(data_root), "rank": 2}) == 0
    again = client.status("bad")
    assert (again.state, again.last_error, again.rank) == (AdapterState.PENDING, None, 2)


def test_status_flattens_run_and_config(client: ControlPlaneClient, raw: httpx.Client, data_root: Path) -> None:
    client.register("a", config={"data": data_path(data_root), "rank": 2, "metadata": {"src": "t"}})
    body = raw.get("/adapter_runs/a").json()
    assert body["name"] == "a" and body["state"] == "PENDING" and body["slot"] == 0 and body["version"] == 0
    assert (body["rank"], body["rollout_batch_size"], body["metadata"]) == (2, 4, {"src": "t"})
    assert body["save"] == str((data_root / "save" / "adapters" / "a").resolve())
    assert len(body["registration_id"]) == 32
    assert raw.get("/adapter_runs").json() == {"adapters": [body], "total": 1}


def test_register_from_yaml_path_and_yaml_body(client: ControlPlaneClient, raw: httpx.Client, data_root: Path) -> None:
    yaml_path = data_root / "y.yaml"
    yaml_path.write_text(f"data: {data_path(data_root)}\nnum_step: 4\nlr: 2e-5\n")
    assert client.register("y", yaml_path=str(yaml_path)) == 0
    assert (client.status("y").num_step, client.status("y").lr) == (4, 2e-5)
    body = f"name: z\nconfig:\n  data: {data_path(data_root)}\n  rank: 1\n  lr: 1e-3\n"
    response = raw.post("/adapter_runs", content=body, headers={"Content-Type": "application/yaml"})
    assert response.status_code == 200 and response.json() == {"name": "z", "slot": 1, "state": "PENDING",
                                                                "queue_position": None}
    assert (client.status("z").rank, client.status("z").lr) == (1, 1e-3)


BILLION_LAUGHS = ("name: b\nconfig:\n  data: x.jsonl\n  metadata:\n"
                  "    a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                  + "".join(f"    {n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
                  ).encode()
"""Nine levels of nine-fold aliases: ~400 bytes that expand to 9**9 strings if aliases are followed."""


def bomb_file(data_root: Path) -> Path:
    path = data_root / "bomb.yaml"
    path.write_text(f"data: {data_path(data_root)}\nmetadata:\n  a: &a [1, 1, 1]\n  b: [*a, *a, *a]\n")
    return path


def _chunks(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    """A streamed body (no Content-Length): the cap must hold while reading too."""
    for start in range(0, len(body), size):
        yield body[start:start + size]


def rejected_cases(data_root: Path) -> list[tuple[dict, int, str]]:
    """(request kwargs, status, words of the detail) of requests that must change nothing."""
    data = data_path(data_root)
    outside = str(data_root.parent)
    return [
        ({"json": {"name": "b", "config": {"data": data}, "yaml_path": "b.yaml"}}, 400, "exactly one of"),
        ({"json": {"name": "b"}}, 400, "exactly one of"),
        ({"json": {"name": "a/b", "config": {"data": data}}}, 400, "Invalid adapter name"),
        ({"json": {"name": "a::b", "config": {"data": data}}}, 400, "Invalid adapter name"),
        ({"json": {"name": "b", "config": {"data": data, "rnk": 2}}}, 422,
         "'type': 'extra_forbidden', 'loc': ['body', 'config', 'rnk']"),
        ({"json": {"name": "b", "config": {"data": data, "rank": "4"}}}, 422, "'loc': ['body', 'config', 'rank']"),
        ({"json": {"name": "b", "config": {"data": data, "lr": "1e-3"}}}, 422, "'loc': ['body', 'config', 'lr']"),
        ({"json": {"name": "b", "config": {"data": data, "metadata": {"blob": "x" * 100_000}}}}, 422,
         "metadata is 100012 bytes as JSON; at most 65536"),
        ({"json": {"name": "n" * 65, "config": {"data": data}}}, 400, "(65 characters): use at most 64"),
        ({"json": {"name": "n" * 256, "config": {"data": data}}}, 400, "(256 characters): use at most 64"),
        ({"json": {"name": "n" * 5000, "config": {"data": data}}}, 400, "(5000 characters): use at most 64"),
        ({"content": BILLION_LAUGHS, "headers": {"Content-Type": "application/yaml"}}, 422,
         "anchors and aliases (&name / *name) are not accepted"),
        ({"json": {"name": "b", "yaml_path": str(bomb_file(data_root))}}, 400, "anchors and aliases"),
        ({"json": {"name": "b", "config": {"data": data, "metadata": {"blob": "x" * (1 << 20)}}}}, 413,
         "Request body larger than 1048576 bytes"),
        ({"content": _chunks(b" " * (1 << 20) + b"{}"), "headers": {"Content-Type": "application/json"}}, 413,
         "Request body larger than 1048576 bytes"),
        ({"json": {"name": "b", "config": {"data": data, "rank": 99}}}, 400, "exceeds the slot width"),
        ({"json": {"name": "b", "config": {"data": data, "rm_type": "nope"}}}, 400, "unknown rm_type"),
        ({"json": {"name": "b", "config": {"data": f"{outside}/x.jsonl"}}}, 400, "outside the allowed roots"),
        ({"json": {"name": "b", "config": {"data": data, "save": f"{outside}/s"}}}, 400, "outside the allowed roots"),
        ({"json": {"name": "b", "yaml_path": "/etc/passwd.yaml"}}, 400, "outside the allowed roots"),
        ({"json": {"name": "taken", "config": {"data": data}}}, 400, "already registered"),
        ({"json": {"name": "b", "config": {"data": data, "save": str(data_root / "save" / "adapters" / "taken")}}},
         400, "already used by live adapter 'taken'"),
        ({"json": {"config": {"data": data}}}, 422, "Field required"),
        ({"json": {"name": "b", "config": {"data": data}, "extra": 1}}, 422, "Extra inputs are not permitted"),
        ({"json": {"name": "b", "config": "data.jsonl"}}, 422, "valid dictionary"),
        ({"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 422, "Malformed body"),
    ]


def test_rejected_registrations_change_nothing(plane: ThreadedController, client: ControlPlaneClient,
                                               raw: httpx.Client, data_root: Path) -> None:
    client.register("taken", config={"data": data_path(data_root)})
    for kwargs, status, words in rejected_cases(data_root):
        before = plane.fingerprint()
        response = raw.post("/adapter_runs", **kwargs)
        assert response.status_code == status, (kwargs, response.text)
        assert words in str(response.json()["detail"]), (kwargs, response.text)
        assert plane.fingerprint() == before, kwargs
        assert raw.get("/health").json() == {"status": "healthy"}


def test_no_free_slot_is_409_with_the_queue_off(data_root: Path, defaults: AdapterDefaults) -> None:
    plane = ThreadedController(controller_config(data_root, defaults, n_slots=2, queue_size=0))
    try:
        with ControlPlaneClient(plane.url) as client:
            client.register("a", config={"data": data_path(data_root)})
            client.register("b", config={"data": data_path(data_root)})
            before = plane.fingerprint()
            with pytest.raises(ControlPlaneError) as err:
                client.register("c", config={"data": data_path(data_root)})
            assert err.value.status_code == 409 and "No free slot for adapter 'c'" in err.value.detail
            assert "--multi-lora-queue-size" in err.value.detail
            assert plane.fingerprint() == before
    finally:
        plane.close()


def test_a_registration_with_every_slot_held_is_queued(plane: ThreadedController, client: ControlPlaneClient,
                                                       raw: httpx.Client, data_root: Path) -> None:
    data = data_path(data_root)
    for name in ["a", "b"]:
        client.register(name, config={"data": data})
    slots_before = [s for s in client.list() if s.state.holds_slot]
    answers = [raw.post("/adapter_runs", json={"name": name, "config": {"data": data}, "priority": priority})
               for name, priority in [("q1", 0), ("q2", 0), ("urgent", 7)]]
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert [r.json() for r in answers] == [
        {"name": "q1", "slot": None, "state": "QUEUED", "queue_position": 1},
        {"name": "q2", "slot": None, "state": "QUEUED", "queue_position": 2},
        {"name": "urgent", "slot": None, "state": "QUEUED", "queue_position": 1},  # ahead of priority 0
    ]
    status = raw.get("/adapter_runs/q1").json()
    assert (status["state"], status["slot"], status["version"], status["queue_position"], status["priority"]) == (
        "QUEUED", None, None, 2, 0)
    assert raw.get("/adapter_runs/a").json()["queue_position"] is None
    assert [(s.name, s.queue_position) for s in client.list()] == [
        ("a", None), ("b", None), ("urgent", 1), ("q1", 2), ("q2", 3)]
    assert client.states(["q2"]) == {"q2": AdapterState.QUEUED}
    text = client.metrics()
    assert re.search(r"^miles_adapter_queue_length 3\.0$", text, flags=re.M)
    assert re.search(r'^miles_controller_adapters\{state="QUEUED"\} 3\.0$', text, flags=re.M)
    assert 'miles_adapter_step{adapter="q1"}' not in text  # no slot, no per-adapter series

    # Registering a queued name again is refused as for a live one.
    again = raw.post("/adapter_runs", json={"name": "q1", "config": {"data": data}})
    assert again.status_code == 400 and "already registered (QUEUED, position 2)" in again.json()["detail"]

    # DELETE of a queued adapter takes it out of the queue (forgotten), every slot as it was.
    assert raw.delete("/adapter_runs/q1").json() == {"status": "ok", "name": "q1", "state": None}
    assert raw.get("/adapter_runs/q1").status_code == 404
    assert [s for s in client.list() if s.state.holds_slot] == slots_before
    assert client.status("q2").queue_position == 2
    assert re.search(r"^miles_adapter_queue_length 2\.0$", client.metrics(), flags=re.M)

    # A slot that frees goes to the head of the queue.
    client.deregister("a")
    plane.call(plane.controller.apply(RetireAdapters()))
    snapshot = plane.call(plane.controller.apply(FreeSlots(["a"])))
    assert snapshot.pending["urgent"].slot == 0 and snapshot.queued == ("q2",)
    assert raw.get("/adapter_runs/urgent").json()["queue_position"] is None


def test_the_list_comes_in_pages_that_follow_every_change(plane: ThreadedController, client: ControlPlaneClient,
                                                          raw: httpx.Client, data_root: Path) -> None:
    """`?limit=&offset=` pages through the same list as the whole answer (live by slot, queued,
    finished), `next_offset` null after the last page; a page shows each status as it is now."""
    data = data_path(data_root)
    for name in ["a", "b", "q1", "q2", "q3"]:
        client.register(name, config={"data": data})
    assert [a["queue_position"] for a in raw.get("/adapter_runs").json()["adapters"]] == [None, None, 1, 2, 3]
    client.deregister("b")
    plane.call(plane.controller.apply(RetireAdapters()))
    plane.call(plane.controller.apply(FreeSlots(["b"])))  # q1 takes slot 1; b is COMPLETED
    whole = raw.get("/adapter_runs").json()
    assert [a["name"] for a in whole["adapters"]] == ["a", "q1", "q2", "q3", "b"] and whole["total"] == 5
    pages, offset = [], 0
    while offset is not None:
        page = raw.get("/adapter_runs", params={"limit": 2, "offset": offset}).json()
        assert page["offset"] == offset and page["total"] == 5
        pages.append(page["adapters"])
        offset = page["next_offset"]
    assert [len(p) for p in pages] == [2, 2, 1] and sum(pages, []) == whole["adapters"]
    assert [s.name for s in client.list(page_size=3)] == ["a", "q1", "q2", "q3", "b"]
    assert raw.get("/adapter_runs", params={"limit": 2, "offset": 9}).json() == {
        "adapters": [], "total": 5, "offset": 9, "next_offset": None}

    plane.call(plane.controller.apply(RecordWeightUpdate(["a"])))  # a's version and state change
    (first,) = raw.get("/adapter_runs", params={"limit": 1}).json()["adapters"]
    assert first == raw.get("/adapter_runs/a").json() and (first["state"], first["version"]) == ("ACTIVE", 1)
    assert [a["queue_position"] for a in whole["adapters"]] == [None, None, 1, 2, None]  # moved up the queue

    for params, field in (({"limit": 0}, "limit"), ({"limit": 1001}, "limit"), ({"offset": -1}, "offset"),
                          ({"limit": "ten"}, "limit")):
        refused = raw.get("/adapter_runs", params=params)
        assert refused.status_code == 422 and field in refused.text, (params, refused.text)


def test_a_full_queue_is_409_and_says_what_to_do(data_root: Path, defaults: AdapterDefaults) -> None:
    plane = ThreadedController(controller_config(data_root, defaults, n_slots=1, queue_size=1))
    try:
        with ControlPlaneClient(plane.url) as client:
            assert client.register("a", config={"data": data_path(data_root)}) == 0
            assert client.register("b", config={"data": data_path(data_root)}) is None
            before = plane.fingerprint()
            with pytest.raises(ControlPlaneError) as err:
                client.register("c", config={"data": data_path(data_root)}, priority=5)
            assert err.value.status_code == 409
            assert "registration queue is full (1 waiting for 1 slots)" in err.value.detail
            assert "raise --multi-lora-queue-size" in err.value.detail
            assert plane.fingerprint() == before
    finally:
        plane.close()


def test_unknown_adapter_is_404(plane: ThreadedController, raw: httpx.Client) -> None:
    before = plane.fingerprint()
    for response in [raw.get("/adapter_runs/ghost"), raw.delete("/adapter_runs/ghost")]:
        assert response.status_code == 404
        assert response.json() == {"detail": "Adapter 'ghost' not registered"}
    assert plane.fingerprint() == before


def test_delete_is_a_noop_after_retiring(plane: ThreadedController, client: ControlPlaneClient,
                                         raw: httpx.Client, data_root: Path) -> None:
    client.register("a", config={"data": data_path(data_root)})
    assert raw.delete("/adapter_runs/a").json() == {"status": "ok", "name": "a", "state": "RETIRING"}
    before = plane.fingerprint()
    assert raw.delete("/adapter_runs/a").json() == {"status": "ok", "name": "a", "state": "RETIRING"}
    assert plane.fingerprint() == before


def test_token_required_on_every_route_but_health(plane: ThreadedController, data_root: Path) -> None:
    with httpx.Client(base_url=plane.url, trust_env=False) as anonymous:
        assert anonymous.get("/health").json() == {"status": "healthy"}
        before = plane.fingerprint()
        attempts = [
            ("GET", "/adapter_runs", {}), ("GET", "/adapter_runs/state", {}), ("GET", "/adapter_runs/a", {}),
            ("POST", "/adapter_runs", {"json": {"name": "a", "config": {"data": data_path(data_root)}}}),
            ("DELETE", "/adapter_runs/a", {}), ("GET", "/metrics", {}), ("GET", "/docs", {}),
            ("GET", "/slots/free", {}),
        ]
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}]:
            for method, path, kwargs in attempts:
                response = anonymous.request(method, path, headers=headers, **kwargs)
                assert response.status_code == 401, (method, path, headers)
                assert response.headers["www-authenticate"] == "Bearer"
        assert plane.fingerprint() == before
        ok = anonymous.get("/slots/free", headers={"Authorization": f"bearer {TOKEN}"})
        assert ok.json() == {"free": [0, 1]}  # the subclass route, loaded by dotted path


def test_metrics(plane: ThreadedController, client: ControlPlaneClient, raw: httpx.Client, data_root: Path) -> None:
    client.register("a", config={"data": data_path(data_root)})
    client.register("b", config={"data": data_path(data_root)})
    plane.call(plane.controller.apply(RecordWeightUpdate(["a"])))
    client.deregister("b")
    raw.post("/adapter_runs", json={"name": "a", "config": {"data": data_path(data_root)}})  # 400
    raw.get("/adapter_runs/ghost")  # 404
    with httpx.Client(base_url=plane.url, trust_env=False) as anonymous:
        anonymous.get("/adapter_runs")  # 401
        anonymous.get("/no/such/path")  # 401 before routing: one shared label

    text = client.metrics()

    def value(metric: str) -> float:
        match = re.search(rf"^{re.escape(metric)} (\S+)$", text, flags=re.M)
        assert match, f"{metric} missing from:\n{text}"
        return float(match.group(1))

    assert value('miles_controller_adapters{state="ACTIVE"}') == 1
    assert value('miles_controller_adapters{state="RETIRING"}') == 1
    assert value('miles_controller_adapters{state="PENDING"}') == 0
    assert value("miles_controller_registrations_total") == 2
    assert value("miles_controller_deregistrations_total") == 1
    assert value('miles_controller_requests_total{method="POST",route="/adapter_runs",status="200"}') == 2
    assert value('miles_controller_requests_total{method="POST",route="/adapter_runs",status="400"}') == 1
    assert value('miles_controller_requests_total{method="GET",route="/adapter_runs/{name}",status="404"}') == 1
    assert value('miles_controller_requests_total{method="GET",route="/adapter_runs",status="401"}') == 1
    assert value('miles_controller_requests_total{method="GET",route="unmatched",status="401"}') == 1


def test_per_adapter_gauges_cover_only_adapters_holding_a_slot(plane: ThreadedController, client: ControlPlaneClient,
                                                               data_root: Path) -> None:
    client.register("a", config={"data": data_path(data_root)})
    client.register("b", config={"data": data_path(data_root)})
    plane.call(plane.controller.apply(RecordWeightUpdate(["a"])))
    plane.call(plane.controller.apply(RecordWeightUpdate(["a"])))
    plane.call(plane.controller.apply(SetStep("a", 4)))
    reg_a, reg_b = client.status("a").registration_id, client.status("b").registration_id
    plane.call(plane.controller.observe_rollout({
        "a": AdapterGauges(registration_id=reg_a, raw_reward_mean=0.75, groups_buffered=3),
        "b": AdapterGauges(registration_id="an-old-registration", raw_reward_mean=0.1, groups_buffered=9),
        "ghost": AdapterGauges(registration_id="x", raw_reward_mean=1.0, groups_buffered=1),
    }))

    def series(text: str, metric: str) -> dict[str, float]:
        return {m[1]: float(m[2]) for m in re.finditer(rf'^{metric}{{adapter="([^"]+)"}} (\S+)$', text, flags=re.M)}

    text = client.metrics()
    assert series(text, "miles_adapter_step") == {"a": 4.0, "b": 0.0}
    assert series(text, "miles_adapter_version") == {"a": 2.0, "b": 0.0}
    # Numbers of another registration of b, or of a name holding no slot, are not served.
    assert series(text, "miles_adapter_reward") == {"a": 0.75}
    assert series(text, "miles_adapter_groups_buffered") == {"a": 3.0}
    plane.call(plane.controller.observe_rollout(
        {"b": AdapterGauges(registration_id=reg_b, raw_reward_mean=None, groups_buffered=2)}))
    text = client.metrics()
    assert series(text, "miles_adapter_reward") == {"a": 0.75}  # b has no step yet
    assert series(text, "miles_adapter_groups_buffered") == {"a": 3.0, "b": 2.0}
    # Once an adapter leaves its slot its series go.
    client.deregister("a")
    assert plane.call(plane.controller.apply(RetireAdapters())).cleanup == {"a"}
    plane.call(plane.controller.apply(FreeSlots(["a"])))
    text = client.metrics()
    assert set(series(text, "miles_adapter_step")) == {"b"} and set(series(text, "miles_adapter_reward")) == set()


def test_client_driven_adapters_are_told_apart_with_their_loss_and_pending_commands(
        plane: ThreadedController, client: ControlPlaneClient, data_root: Path) -> None:
    client.register("rl", config={"data": data_path(data_root)})
    gateway = plane.controller.gateway

    async def create_model_with_two_steps_queued() -> str:
        session = gateway.sessions.create(SessionInfo())
        created = gateway.create_model(session, 0, "base", LoraLayout(rank=4, train_unembed=False), {})
        assert created.model is not None and created.model_id is not None
        for seq_id in (1, 2):
            gateway.submit(created.model_id, seq_id, ClientCommandKind.OPTIM_STEP,
                           lambda: OptimStepCommand(AdamStep(learning_rate=0.1)))
        return created.model

    model = plane.call(create_model_with_two_steps_queued())

    def series(text: str, metric: str) -> dict[str, float]:
        return {m[1]: float(m[2]) for m in re.finditer(rf'^{metric}{{adapter="([^"]+)"}} (\S+)$', text, flags=re.M)}

    text = client.metrics()
    kinds = {m[1]: m[2] for m in re.finditer(r'^miles_adapter_info{adapter="([^"]+)",kind="([^"]+)"} 1\.0$', text,
                                             flags=re.M)}
    assert kinds == {"rl": "server", model: "client"}
    assert series(text, "miles_adapter_step") == {"rl": 0.0, model: 0.0}
    assert series(text, "miles_adapter_client_commands_pending") == {model: 2.0}
    assert series(text, "miles_adapter_client_loss") == {}
    # The trainer takes the first step (a barrier ends a take) and reports the step's loss.
    (taken,) = plane.call(plane.controller.take_client_commands()).models
    assert taken.barrier is not None and taken.barrier.seq_id == 1
    plane.call(plane.controller.observe_rollout({model: AdapterGauges(
        registration_id=client.status(model).registration_id, raw_reward_mean=None, groups_buffered=None,
        client_loss=9.5)}))
    text = client.metrics()
    assert series(text, "miles_adapter_client_commands_pending") == {model: 1.0}
    assert series(text, "miles_adapter_client_loss") == {model: 9.5}
    # A client-driven adapter has no reward and no buffer: no series says it has.
    assert model not in series(text, "miles_adapter_reward") and model not in series(
        text, "miles_adapter_groups_buffered")


def test_a_paged_client_model_is_shown_paged_and_its_command_is_retried_while_no_slot_is_free(
        plane: ThreadedController, client: ControlPlaneClient, raw: httpx.Client, data_root: Path) -> None:
    gateway = plane.controller.gateway

    async def create_model_and_page_it_out() -> tuple[str, str]:
        created = gateway.create_model(gateway.sessions.create(SessionInfo()), 0, "base",
                                       LoraLayout(rank=4, train_unembed=False), {})
        assert created.model is not None and created.model_id is not None
        plane.controller.backend.apply_now(ActivateClients([created.model]))
        assert gateway.idle_models(0.0) == [created.model]
        assert gateway.page_out(created.model, str(data_root / "paged"))
        return created.model, created.model_id

    model, model_id = plane.call(create_model_and_page_it_out())
    status = client.status(model)
    assert (status.state, status.slot, status.step) == (AdapterState.PAGED, None, 0)
    text = client.metrics()
    assert re.search(r"^miles_adapter_client_paged 1\.0$", text, flags=re.M)
    assert re.search(r'^miles_controller_adapters{state="PAGED"} 1\.0$', text, flags=re.M)
    assert f'adapter="{model}"' not in text  # no per-adapter series without a slot
    client.register("a", config={"data": data_path(data_root)})
    client.register("b", config={"data": data_path(data_root)})  # every slot held
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}}
    refused = raw.post("/api/v1/optim_step", json=step)
    assert refused.status_code == 429 and "no slot is free" in refused.json()["detail"]
    assert "x-should-retry" not in refused.headers and refused.headers["retry-after"] == "1"  # the SDK retries it
    assert client.status(model).state is AdapterState.PAGED
    client.deregister("b")  # the lifecycle frees its slot as the trainer would
    plane.call(plane.controller.apply(RetireAdapters()))
    plane.call(plane.controller.apply(FreeSlots(["b"])))
    assert raw.post("/api/v1/optim_step", json=step).status_code == 200  # the same call again pages it in
    assert client.status(model).state is AdapterState.PENDING and client.status(model).slot == 1


def test_openapi_lists_the_routes(raw: httpx.Client) -> None:
    spec = raw.get("/openapi.json").json()
    assert spec["info"]["title"] == "Miles Multi-LoRA Controller"
    assert {"/health", "/adapter_runs", "/adapter_runs/state", "/adapter_runs/{name}", "/metrics"} <= set(spec["paths"])
    schema = spec["paths"]["/adapter_runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) == {"name", "config", "yaml_path", "priority"}
    assert (schema["properties"]["priority"]["type"], schema["properties"]["priority"]["default"]) == ("integer", 0)
    answer = spec["paths"]["/adapter_runs"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": "#/components/schemas/RegisterAdapterResponse"}
    assert {"name", "slot", "state", "queue_position"} == set(
        spec["components"]["schemas"]["RegisterAdapterResponse"]["properties"])
    config_schema = next(s for s in schema["properties"]["config"]["anyOf"] if s.get("type") == "object")
    assert set(config_schema["properties"]) == set(ADAPTER_CONFIG_KEYS)
    assert config_schema["required"] == ["data"] and config_schema["additionalProperties"] is False
    assert "$defs" not in str(spec["paths"]["/adapter_runs"])  # every reference resolvable


def test_subclass_paths_are_checked_at_load() -> None:
    assert load_subclass(None, MultiLoRAHTTPServer, "--flag") is MultiLoRAHTTPServer
    assert load_subclass(f"{__name__}.ExtraRouteServer", MultiLoRAHTTPServer, "--flag") is ExtraRouteServer
    with pytest.raises(ValueError, match="must be a subclass of miles.controller.http_server.MultiLoRAHTTPServer"):
        load_subclass("miles.controller.backend.MultiLoRABackend", MultiLoRAHTTPServer, "--multi-lora-http-server-path")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_subclass("miles.controller.nothing_here.X", MultiLoRAHTTPServer, "--multi-lora-http-server-path")
    with pytest.raises(ValueError, match="dotted path"):
        load_subclass("NoDots", MultiLoRAHTTPServer, "--multi-lora-http-server-path")


class CountingBackend(MultiLoRABackend):
    """A backend extension selected by --multi-lora-backend-path."""


def test_server_config_defaults_and_backend_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 defaults: AdapterDefaults) -> None:
    monkeypatch.setenv("MILES_API_TOKEN", "from-env")
    cfg = parse_args(["--multi-lora-n-adapters", "3", "--save", str(tmp_path / "out"),
                      "--multi-lora-backend-path", f"{__name__}.CountingBackend"])
    server = HTTPServerConfig.from_config(cfg)
    assert (server.host, server.port, server.token) == ("127.0.0.1", 8068, "from-env")
    assert server.allowed_roots == (Path.cwd().resolve(), (tmp_path / "out").resolve())
    explicit = HTTPServerConfig.from_config(cfg.replace(multi_lora_allowed_roots=[str(tmp_path / "only")],
                                                        multi_lora_api_token="flag"))
    assert (explicit.allowed_roots, explicit.token) == (((tmp_path / "only").resolve(),), "flag")

    controller = MultiLoRAController(ControllerConfig.from_config(cfg))
    assert type(controller.backend) is CountingBackend and controller.backend.registry.n_slots == 3
    with pytest.raises(ValueError, match="must be a subclass of miles.controller.backend.MultiLoRABackend"):
        MultiLoRAController(ControllerConfig.from_config(
            cfg.replace(multi_lora_backend_path=f"{__name__}.ExtraRouteServer")))
    with pytest.raises(ValueError, match="set --multi-lora-n-adapters > 0"):
        ControllerConfig.from_config(cfg.replace(multi_lora_n_adapters=0))


def test_plugins_written_for_miles_load_with_their_signatures(data_root: Path) -> None:
    """A backend taking (args, router_url) and a server taking (backend, host, api_port), both
    imported from Miles' module paths: built that way, the server then given the token and the
    limits; Miles' async hooks awaited (init at start, close at stop, validate_adapter)."""
    plugins = "tests.helpers.miles_style_plugins"
    cfg = parse_args(["--multi-lora-n-adapters", "2", "--save", str(data_root / "save"), "--lora-rank", "4",
                      "--rm-type", "math", "--rollout-batch-size", "2", "--multi-lora-api-port", "0",
                      "--multi-lora-api-token", "tok", "--multi-lora-allowed-roots", str(data_root),
                      "--multi-lora-backend-path", f"{plugins}.QuotaBackend",
                      "--multi-lora-http-server-path", f"{plugins}:QuotaServer"])
    plane = ThreadedController(ControllerConfig.from_config(cfg, ROLLOUT_HOOKS))
    backend = plane.controller.backend
    try:
        assert backend.args is not None and backend.args.flags is cfg
        with httpx.Client(base_url=plane.url, headers={"Authorization": "Bearer tok"}, trust_env=False,
                          timeout=10) as http:
            assert http.get("/quota").json() == {"max_rank": 2, "opened": True}
            refused = http.post("/adapter_runs", json={"name": "big", "config": {"data": data_path(data_root)}})
            assert refused.status_code == 400 and refused.json()["detail"] == "Adapter 'big' rank 4 exceeds the quota 2"
            ok = http.post("/adapter_runs", json={"name": "small", "config": {"data": data_path(data_root), "rank": 2}})
            assert ok.status_code == 200, ok.text
            outside = http.post("/adapter_runs", json={"name": "x", "config": {
                "data": data_path(data_root), "rank": 2, "custom_rm_path": "os.system"}})
            assert outside.status_code == 400 and "--multi-lora-allowed-plugin-modules" in outside.text
        with httpx.Client(base_url=plane.url, trust_env=False, timeout=10) as anonymous:
            assert anonymous.get("/quota").status_code == 401  # the trainer's token holds for its routes
    finally:
        plane.close()
    assert backend.opened is False  # close() ran at stop

    with pytest.raises(ValueError, match=r"takes neither this trainer's arguments .* nor Miles' \(args, router_url\)"):
        MultiLoRAController(ControllerConfig.from_config(
            cfg.replace(multi_lora_backend_path=f"{plugins}.ThreeArgumentBackend")))


def test_server_answers_while_a_dataset_is_validated(data_root: Path, defaults: AdapterDefaults) -> None:
    started, release = threading.Event(), threading.Event()

    def slow_validate(path: str, input_key: str, label_key: str | None) -> int:
        started.set()
        assert release.wait(timeout=30)
        return 4

    plane = ThreadedController(controller_config(data_root, defaults,
                                                  hooks=ControllerHooks(validate_dataset=slow_validate)))
    try:
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=plane.url, trust_env=False, timeout=10) as http:
            pending = pool.submit(http.post, "/adapter_runs",
                                  json={"name": "a", "config": {"data": data_path(data_root)}})
            assert started.wait(timeout=30)
            with httpx.Client(base_url=plane.url, trust_env=False, timeout=10) as other:
                assert other.get("/health").json() == {"status": "healthy"}
                assert other.get("/adapter_runs/state", params={"names": "a"}).json() == {"states": {"a": None}}
            assert plane.call(plane.controller.snapshot()).all_adapters_cleaned_up  # an actor call, meanwhile
            release.set()
            response = pending.result(timeout=30)
        assert response.status_code == 200 and response.json()["slot"] == 0
        assert plane.call(plane.controller.adapter_status("a")).num_step == 1
    finally:
        release.set()
        plane.close()
