"""`miles-lora` against the standalone control plane (`python -m miles.main.control_plane` in a
subprocess on loopback): every command, JSON output, and the message and exit code of
each failure (unknown adapter, a 4xx with the server's message, no token, connection
refused, a usage error)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from miles.controller.cli import app
from tests.helpers.controller_fakes import write_dataset
from tests.helpers.controller_process import start, stop

TOKEN = "cli-token"


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    write_dataset(root / "data" / "train.jsonl")
    args = ["--multi-lora-n-adapters", "2", "--multi-lora-api-port", "0", "--save", str(root / "save"),
            "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--lora-rank", "4", "--multi-lora-allowed-roots", str(root)]
    process, url, lines = start(args, env={"MILES_API_TOKEN": TOKEN})
    try:
        yield url, root
    finally:
        stop(process, signal.SIGTERM, lines)


def cli(url: str, *args: str, token: str | None = TOKEN, env: dict[str, str] | None = None):
    options = ["--url", url] + (["--token", token] if token is not None else [])
    result = CliRunner().invoke(app, [*options, *args], env={"MILES_API_TOKEN": None, **(env or {})})
    return result.exit_code, result.stdout, result.stderr


def test_register_list_get_retire(control_plane):
    url, root = control_plane
    data = root / "data" / "train.jsonl"
    assert cli(url, "list")[:2] == (0, "No adapters registered.\n")

    code, out, _ = cli(url, "register", "math", "--set", f"data={data}", "--set", "num_step=3",
                       "--set", "lr=1e-4", "--set", "metadata={source: cli}")
    assert code == 0 and out == "Registered 'math' in slot 0 (PENDING until its weights reach the engines).\n"

    yaml_file = root / "other.yaml"
    yaml_file.write_text(f"data: {data}\nrank: 2\n")
    code, out, _ = cli(url, "--json", "register", "other", "--yaml", str(yaml_file))
    assert code == 0 and json.loads(out) == {"name": "other", "slot": 1, "state": "PENDING", "queue_position": None}

    code, out, _ = cli(url, "list")
    header, first, second = out.splitlines()
    assert header.split() == ["NAME", "STATE", "SLOT", "VERSION", "STEP", "RANK", "DATA"]
    assert first.split() == ["math", "PENDING", "0", "0", "0/3", "4", str(data)]
    assert second.split()[:3] == ["other", "PENDING", "1"] and second.split()[5] == "2"

    code, out, _ = cli(url, "--json", "get", "math")
    status = json.loads(out)
    assert code == 0 and (status["num_step"], status["lr"], status["metadata"]) == (3, 1e-4, {"source": "cli"})
    code, out, _ = cli(url, "get", "math")
    assert code == 0 and "state: PENDING" in out.splitlines() and 'metadata: {"source": "cli"}' in out.splitlines()

    code, out, _ = cli(url, "retire", "other")
    assert code == 0 and out.startswith("Retiring 'other'")
    assert json.loads(cli(url, "--json", "get", "other")[1])["state"] != "PENDING"

    code, out, _ = cli(url, "--json", "watch", "--count", "2", "--interval", "0.05")
    polls = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(polls) == 2
    assert [a["name"] for a in polls[-1]["adapters"]][0] == "math"

    # --json also after the command's name, as users type it.
    listed = cli(url, "list", "--json")
    assert listed[0] == 0 and [a["name"] for a in json.loads(listed[1])] == ["math", "other"]
    assert json.loads(listed[1]) == json.loads(cli(url, "--json", "list")[1])
    assert json.loads(cli(url, "get", "math", "--json")[1])["num_step"] == 3
    code, out, _ = cli(url, "watch", "--json", "--count", "1", "--interval", "0.05")
    assert code == 0 and [a["name"] for a in json.loads(out)["adapters"]][0] == "math"


def test_errors_have_messages_and_exit_codes(control_plane, tmp_path):
    url, root = control_plane
    code, _, err = cli(url, "get", "nobody")
    assert code == 4 and err.startswith("Error: no adapter named 'nobody'")
    assert cli(url, "retire", "nobody")[0] == 4

    code, _, err = cli(url, "register", "bad", "--set", f"data={root / 'data' / 'train.jsonl'}", "--set", "rank=64")
    assert code == 1 and "HTTP 400" in err and "exceeds the slot width --lora-rank 4" in err  # the server's message

    code, _, err = cli(url, "register", "outside", "--set", f"data={tmp_path / 'x.jsonl'}")
    assert code == 1 and "HTTP 400" in err

    code, _, err = cli(url, "list", token=None)
    assert code == 1 and "unauthorized" in err and "MILES_API_TOKEN" in err
    assert cli(url, "list", token=None, env={"MILES_API_TOKEN": TOKEN})[0] == 0  # token from the environment

    code, _, err = cli(url, "register", "x")
    assert code == 2 and "exactly one of --yaml FILE or --set" in err
    code, _, err = cli(url, "register", "x", "--set", "no-equals-sign")
    assert code == 2 and "expected key=value" in err

    with socket.socket() as sock:  # a port nobody listens on: held (bound, not listening) while the CLI tries it
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
        code, _, err = cli(closed, "list")
    assert code == 3 and f"cannot reach the control plane at {closed}" in err


def test_a_queued_registration_in_register_list_get_watch_and_retire(control_plane):
    url, root = control_plane
    data = root / "data" / "train.jsonl"
    for i in range(3):  # fill the two slots (whatever the tests before left), then one waits
        code, out, _ = cli(url, "register", f"wait{i}", "--set", f"data={data}")
        assert code == 0
        if out.startswith("Queued"):
            break
    waiting = f"wait{i}"
    assert out.startswith(f"Queued '{waiting}' at position 1: every slot is held. It takes the next free slot")
    code, out, _ = cli(url, "--json", "register", "vip", "--set", f"data={data}", "--priority", "3")
    assert code == 0 and json.loads(out) == {"name": "vip", "slot": None, "state": "QUEUED", "queue_position": 1}

    code, out, _ = cli(url, "list")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["vip"][1:4] == ["QUEUED", "#1", "-"] and rows[waiting][1:4] == ["QUEUED", "#2", "-"]
    code, out, _ = cli(url, "get", waiting)
    assert code == 0 and {"state: QUEUED", "queue_position: 2", "slot: None", "priority: 0"} <= set(out.splitlines())
    code, out, _ = cli(url, "watch", "--count", "1", "--interval", "0.05")
    assert code == 0 and any(line.split()[:3] == ["vip", "QUEUED", "#1"] for line in out.splitlines())

    code, out, _ = cli(url, "retire", waiting)
    assert code == 0 and out.startswith(f"Removed '{waiting}' from the queue: it never held a slot")
    assert cli(url, "get", waiting)[0] == 4  # forgotten
    code, out, _ = cli(url, "--json", "retire", "vip")
    assert code == 0 and json.loads(out) == {"name": "vip", "status": "removed from the queue"}
    assert "QUEUED" not in cli(url, "list")[1]


def test_console_script_is_installed(control_plane):
    url, _ = control_plane
    script = Path(sys.executable).parent / "miles-lora"
    done = subprocess.run([str(script), "--url", url, "--json", "list"], capture_output=True, text=True,
                          env={**os.environ, "MILES_API_TOKEN": TOKEN}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert isinstance(json.loads(done.stdout), list)


def test_a_tinker_model_is_listed_with_its_model_id(tmp_path, monkeypatch):
    """The standalone control plane serves the Tinker routes too; `list` shows a model as an adapter."""
    import tinker

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    token = "tml-cli-token"
    args = ["--multi-lora-n-adapters", "1", "--multi-lora-api-port", "0", "--save", str(tmp_path / "save"),
            "--lora-rank", "4"]
    process, url, lines = start(args, env={"MILES_API_TOKEN": token})
    try:
        service = tinker.ServiceClient(base_url=url, api_key=token)
        model_id = service.create_lora_training_client("any-base", rank=2, train_unembed=False).result(
            timeout=30).model_id
        code, out, _ = cli(url, "list", token=token)
        header, row = out.splitlines()
        assert code == 0 and row.split() == [model_id.replace(":", "."), "PENDING", "0", "0", "0", "2",
                                             "(client)", model_id]
        service.close("success").result(timeout=30)
        assert cli(url, "--json", "get", model_id.replace(":", "."), token=token)[1].count('"RETIRING"') == 1
    finally:
        stop(process, signal.SIGTERM, lines)
