"""`python -m miles.main.control_plane` as a subprocess: serves the API, stops cleanly on signals."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from waiting import wait_until

from miles.controller.client import ControlPlaneClient, ControlPlaneError
from miles.utils.types import AdapterState

URL_LINE = re.compile(r"Control plane listening on (http://127\.0\.0\.1:\d+) \(OpenAPI at /docs")


def start(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, queue.Queue]:
    """The controller's process, its URL (from the line it logs) and its further stderr lines
    (`None` after the last: the process closed its stderr)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "miles.main.control_plane", *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
        text=True, env={**os.environ, **(env or {})},
    )
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []

    def logged_url() -> str | None:
        for line in drain(lines):
            if line is None:
                raise AssertionError(f"exited with {process.wait()} before logging its URL: {''.join(seen)}")
            seen.append(line)
            if match := URL_LINE.search(line):
                return match.group(1)
        return None

    try:
        return process, wait_until(logged_url, 60, "the controller to log its URL"), lines
    except BaseException:
        process.kill()
        raise


def drain(lines: queue.Queue) -> list[str | None]:
    """The lines read so far."""
    out = []
    while True:
        try:
            out.append(lines.get_nowait())
        except queue.Empty:
            return out


def stop(process: subprocess.Popen, sig: int, lines: queue.Queue) -> str:
    """Signal the controller; its exit code must be 0. Returns what it wrote to stderr since it logged its URL."""
    process.send_signal(sig)
    rc = process.wait(timeout=20)
    tail: list[str | None] = []

    def read_to_the_end() -> bool:
        tail.extend(drain(lines))
        return tail[-1:] == [None]

    wait_until(read_to_the_end, 20, "the end of the controller's stderr")
    text = "".join(tail[:-1])
    assert rc == 0, text
    return text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serves_and_stops_cleanly(sig: int, data_root: Path) -> None:
    args = ["--multi-lora-n-adapters", "1", "--multi-lora-api-port", "0", "--save", str(data_root / "save"),
            "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--lora-rank", "4", "--multi-lora-allowed-roots", str(data_root), "--multi-lora-queue-size", "1"]
    process, url, lines = start(args, env={"MILES_API_TOKEN": "tok"})
    tail = ""
    try:
        with ControlPlaneClient(url, token="tok") as client:
            assert client.health()
            # The trainer's registration checks: rewards, plug-in modules, generate functions.
            for config, words in [({"rm_type": "no_such_reward"}, "unknown rm_type"),
                                  ({"custom_rm_path": "os.system"}, "is outside the modules"),
                                  ({"custom_generate_function_path": "miles.utils.plugins.plugin_module"},
                                   "must be an async function")]:
                with pytest.raises(ControlPlaneError) as err:
                    client.register("b", config={"data": str(data_root / "data" / "train.jsonl"), **config})
                assert err.value.status_code == 400 and words in err.value.detail, (config, err.value)
            assert client.register("a", config={"data": str(data_root / "data" / "train.jsonl")}) == 0
            status = client.status("a")
            assert (status.state, status.rank, status.rollout_batch_size) == (AdapterState.PENDING, 4, 2)
            assert status.num_step == 2  # the dataset was read: 4 rows, 2 groups a step
            # The one slot is held: b waits in the queue, and c finds it full (--multi-lora-queue-size 1).
            assert client.register("b", config={"data": str(data_root / "data" / "train.jsonl")}) is None
            assert (client.status("b").state, client.status("b").queue_position) == (AdapterState.QUEUED, 1)
            with pytest.raises(ControlPlaneError) as err:
                client.register("c", config={"data": str(data_root / "data" / "train.jsonl")})
            assert err.value.status_code == 409 and "registration queue is full" in err.value.detail
        with ControlPlaneClient(url) as anonymous, pytest.raises(ControlPlaneError) as err:
            anonymous.list()
        assert err.value.status_code == 401
    finally:
        if process.poll() is None:
            tail = stop(process, sig, lines)
    assert "Stopping the control plane" in tail


def test_refuses_to_start_without_slots() -> None:
    result = subprocess.run([sys.executable, "-m", "miles.main.control_plane", "--multi-lora-api-port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "set --multi-lora-n-adapters" in result.stderr
