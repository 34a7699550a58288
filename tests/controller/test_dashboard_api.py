"""The dashboard's server side: the records read incrementally from `metrics.jsonl`, the
rollout dump, the page served with its security headers and the data behind the token, and
`python -m miles.dashboard RUN_DIR` over a finished run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

import miles.dashboard
from miles.controller.registry import AdapterRegistry
from miles.controller.store import RegistryStore
from miles.dashboard.__main__ import create_app
from miles.dashboard.data import RunFiles, UnknownRolloutError
from miles.dashboard.routes import CONTENT_SECURITY_POLICY
from miles.utils.adapter_config import AdapterDefaults
from tests.helpers.controller_fakes import ThreadedController, controller_config, make_config
from tests.helpers.waiting import wait_until

TOKEN = "dashboard-token"


def loop_record(rollout_id: int) -> dict:
    return {"kind": "loop", "rollout_id": rollout_id, "time": 100.0 + rollout_id,
            "metrics": {"perf/train_time": 0.5, "perf/iteration_time": 1.0},
            "batch": {"a": {"groups": 2, "samples": 8}}}


def adapter_record(name: str, step: int, reward: float) -> dict:
    return {"kind": "adapter", "adapter": name, "adapter_kind": "server", "step": step, "time": 100.0 + step,
            "metrics": {"raw_reward_mean": reward}}


def append(path: Path, *records: dict) -> None:
    with open(path, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def dump_rollout(dump_dir: Path, adapter: str, rollout_id: int, step: int) -> dict:
    document = {"adapter": adapter, "rollout_id": rollout_id, "step": step, "registration_id": "r1", "time": 5.0,
                "groups": [{"group_index": 0, "version": 1, "prompt": "<script>alert(1)</script>", "label": "2",
                            "samples": [{"index": 0, "response": "2", "reward": 1.0, "advantage": 0.5,
                                         "status": "completed", "truncated": False, "aborted": False,
                                         "tokens": ["2"], "logprobs": [-0.1], "loss_mask": None}]}]}
    folder = dump_dir / adapter
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rollout_{rollout_id:08d}.json").write_text(json.dumps(document))
    return document


def test_records_are_read_incrementally_by_byte_offset(tmp_path: Path) -> None:
    files = RunFiles(tmp_path)
    assert files.records() == {"offset": 0, "records": [], "more": False, "reset": False}  # no file yet
    path = tmp_path / "metrics.jsonl"
    append(path, loop_record(0), adapter_record("a", 1, 0.25))
    first = files.records()
    assert first["records"] == [loop_record(0), adapter_record("a", 1, 0.25)]
    assert first["offset"] == path.stat().st_size and not first["more"] and not first["reset"]
    assert files.records(first["offset"])["records"] == []  # nothing new: nothing sent again

    append(path, adapter_record("a", 2, 0.5))
    with open(path, "a") as f:
        f.write('{"kind": "loop", "rollout_id": 1')  # a line still being written is not sent yet
    second = files.records(first["offset"])
    assert second["records"] == [adapter_record("a", 2, 0.5)]
    with open(path, "a") as f:
        f.write(', "time": 1.0, "metrics": {}}\n{torn\n')  # the line completes; a torn line is skipped
    third = files.records(second["offset"])
    assert third["records"] == [{"kind": "loop", "rollout_id": 1, "time": 1.0, "metrics": {}}]
    assert third["offset"] == path.stat().st_size


def test_records_page_with_a_limit_and_reset_when_the_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    append(path, *(adapter_record("a", step, step / 10) for step in range(1, 8)))
    files = RunFiles(tmp_path)
    pages, offset = [], 0
    while True:
        page = files.records(offset, limit=3)
        pages.append([r["step"] for r in page["records"]])
        offset = page["offset"]
        if not page["more"]:
            break
    assert pages == [[1, 2, 3], [4, 5, 6], [7]]

    path.write_text(json.dumps(adapter_record("b", 1, 0.0)) + "\n")  # a new run in the same directory
    page = files.records(offset)
    assert page["reset"] and [r["adapter"] for r in page["records"]] == ["b"]
    with pytest.raises(ValueError, match="offset"):
        files.records(-1)


def test_rollouts_listed_oldest_first_and_names_checked(tmp_path: Path) -> None:
    dump = tmp_path / "details" / "rollouts"
    for rollout_id, step in ((12, 3), (4, 1), (9, 2)):
        dump_rollout(dump, "a", rollout_id, step)
    (dump / "a" / ".rollout_00000013.json.tmp").write_text("{partial")  # a file being written is not listed
    files = RunFiles(tmp_path, dump)
    listed = [(r["rollout_id"], r["step"], r["groups"]) for r in files.rollouts("a")]
    assert listed == [(4, 1, 1), (9, 2, 1), (12, 3, 1)]
    assert files.rollout("a", 9)["step"] == 2
    assert files.dumped_adapters() == ["a"]
    for bad in ("..", "a/../a", "b", "/etc", "a\x00"):
        with pytest.raises(UnknownRolloutError):
            files.rollouts(bad)
    with pytest.raises(UnknownRolloutError, match="--dump-details-keep"):
        files.rollout("a", 5)
    with pytest.raises(UnknownRolloutError, match="--dump-details DIR"):
        RunFiles(tmp_path).rollouts("a")


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults) -> Iterator[ThreadedController]:
    run_dir = data_root / "run"
    run_dir.mkdir()
    controller = ThreadedController(controller_config(data_root, defaults, n_slots=2, token=TOKEN, run_dir=run_dir,
                                                      dump_dir=run_dir / "details" / "rollouts"))
    yield controller
    controller.close()


def test_the_page_is_public_and_its_data_needs_the_token(plane: ThreadedController) -> None:
    run_dir = plane.controller.config.server.run_dir
    assert run_dir is not None
    append(run_dir / "metrics.jsonl", loop_record(0))
    dump_rollout(run_dir / "details" / "rollouts", "a", 0, 1)
    with httpx.Client(base_url=plane.url, trust_env=False) as anonymous:
        page = anonymous.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert page.headers["x-content-type-options"] == "nosniff"
        for asset in re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', page.text):
            assert anonymous.get(asset).status_code == 200, asset
        for path in ("/ui/static/../../pyproject.toml", "/ui/static/%2e%2e%2fdata.py", "/ui/static/data.py",
                     "/ui/static/nothing.js"):
            assert anonymous.get(path).status_code in (401, 404), path  # never a file outside the page's
        for path in ("/ui/api/info", "/ui/api/records", "/ui/api/rollouts?adapter=a", "/ui/api/rollouts/a/0"):
            refused = anonymous.get(path)
            assert refused.status_code == 401 and "token" in refused.json()["detail"], path
    with httpx.Client(base_url=plane.url, trust_env=False, headers={"Authorization": f"Bearer {TOKEN}"}) as user:
        info = user.get("/ui/api/info").json()
        assert info["mode"] == "live" and info["controls"] is True and info["run_dir"] == str(run_dir)
        assert info["dump_dir"] == str(run_dir / "details" / "rollouts")
        assert user.get("/ui/api/records").json()["records"] == [loop_record(0)]
        assert user.get("/ui/api/rollouts", params={"adapter": "a"}).json()["rollouts"][0]["rollout_id"] == 0
        document = user.get("/ui/api/rollouts/a/0")
        assert document.json()["groups"][0]["prompt"] == "<script>alert(1)</script>"  # data, shown as text
        assert document.headers["content-type"] == "application/json"
        missing = user.get("/ui/api/rollouts/..%2f..%2fetc/0")
        assert missing.status_code == 404
        assert user.get("/ui/api/records", params={"offset": -1}).status_code == 422
        assert user.get("/ui/api/rollouts/a/7").json()["detail"].startswith("Rollout 7 of adapter 'a'")


def write_registry(run_dir: Path) -> None:
    registry = AdapterRegistry(2)
    registry.register("math", make_config("math"))
    store = RegistryStore(run_dir / "controller" / "registry.sqlite")
    store.save(registry.export_state())
    store.close()


def test_a_finished_run_is_served_read_only(tmp_path: Path) -> None:
    append(tmp_path / "metrics.jsonl", adapter_record("a", 1, 0.1), adapter_record("b", 1, 0.2),
           adapter_record("a", 2, 0.3))
    with TestClient(create_app(tmp_path)) as client:
        info = client.get("/ui/api/info").json()
        assert info["mode"] == "run_dir" and info["controls"] is False and info["dump_dir"] is None
        # No registry file: the adapters the records name, at their latest step.
        assert [(a["name"], a["step"]) for a in client.get("/adapter_runs").json()["adapters"]] == [("a", 2), ("b", 1)]
        assert client.post("/adapter_runs", json={"name": "c"}).status_code == 405
        assert client.delete("/adapter_runs/a").status_code in (404, 405)
    write_registry(tmp_path)
    with TestClient(create_app(tmp_path, token=TOKEN)) as client:
        assert client.get("/ui").status_code == 200
        assert client.get("/adapter_runs").status_code == 401
        listed = client.get("/adapter_runs", headers={"Authorization": f"Bearer {TOKEN}"}).json()["adapters"]
        assert [(a["name"], a["state"]) for a in listed] == [("math", "PENDING")]


def test_the_command_serves_a_run_directory_on_the_port_it_reports(tmp_path: Path) -> None:
    missing = subprocess.run([sys.executable, "-m", "miles.dashboard", str(tmp_path)], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "metrics.jsonl does not exist" in missing.stderr
    append(tmp_path / "metrics.jsonl", adapter_record("a", 1, 0.5))
    dump_rollout(tmp_path / "details" / "rollouts", "a", 3, 1)
    process = subprocess.Popen([sys.executable, "-m", "miles.dashboard", str(tmp_path), "--port", "0"],
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = ""
        while "Dashboard of" not in line:
            line = process.stderr.readline()
            assert line, "the dashboard exited before it listened"
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/ui", line)
        assert url is not None, line
        with httpx.Client(base_url=url.group(1), trust_env=False) as client:
            wait_until(lambda: client.get("/ui").status_code == 200, timeout=30, what="the dashboard to answer",
                       retry_on=(httpx.HTTPError,))
            assert client.get("/ui/api/info").json()["dump_dir"] == str(tmp_path / "details" / "rollouts")
            assert client.get("/ui/api/rollouts/a/3").json()["step"] == 1
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_page_has_no_html_sinks_inline_code_or_other_hosts() -> None:
    """Model output reaches the page as data: no script may turn a string into markup, and the
    markup holds nothing the CSP would have to allow (inline scripts, styles, handlers)."""
    static = Path(miles.dashboard.__file__).parent / "static"
    scripts = {p.name: p.read_text() for p in static.glob("*.js")}
    assert {"app.js", "dom.js", "rollouts.js"} <= set(scripts)
    sinks = re.compile(r"\.innerHTML|\.outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|"
                       r"\.srcdoc|createContextualFragment|DOMParser")
    for name, text in scripts.items():
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))
        assert not sinks.search(code), (name, sinks.search(code))
        hosts = set(re.findall(r"\w+://[^\s\"'`)]+", code)) - {"http://www.w3.org/2000/svg"}
        assert not hosts, (name, hosts)
    page = (static / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", page), "an inline script"
    assert not re.search(r"<style|\sstyle=|\son[a-z]+=", page, re.I), "inline style or handler"
    assert not re.search(r"(src|href)=\"(?!/ui/static/|data:|#)", page), "a file from elsewhere"
