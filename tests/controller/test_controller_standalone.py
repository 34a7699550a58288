"""`python -m miles.controller` as a subprocess: serves the API, stops cleanly on signals."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from miles.controller.client import ControlPlaneClient, ControlPlaneError
from miles.utils.types import AdapterState

URL_LINE = re.compile(r"Control plane listening on (http://127\.0\.0\.1:\d+) \(OpenAPI at /docs\)")


def start(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, queue.Queue]:
    process = subprocess.Popen(
        [sys.executable, "-m", "miles.controller", *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
        text=True, env={**os.environ, **(env or {})},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert process.poll() is None, f"exited early with {process.returncode}: {''.join(seen)}"
            continue
        seen.append(line)
        match = URL_LINE.search(line)
        if match:
            return process, match.group(1), lines
    process.kill()
    raise AssertionError(f"no URL logged within 60 s: {''.join(seen)}")


def stop(process: subprocess.Popen, sig: int, lines: queue.Queue) -> str:
    process.send_signal(sig)
    rc = process.wait(timeout=20)
    time.sleep(0.05)
    tail = "".join(lines.queue)
    assert rc == 0, tail
    return tail


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serves_and_stops_cleanly(sig: int, data_root: Path) -> None:
    args = ["--multi-lora-n-adapters", "1", "--multi-lora-api-port", "0", "--save", str(data_root / "save"),
            "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--lora-rank", "4", "--multi-lora-allowed-roots", str(data_root)]
    process, url, lines = start(args, env={"MILES_API_TOKEN": "tok"})
    tail = ""
    try:
        with ControlPlaneClient(url, token="tok") as client:
            assert client.health()
            assert client.register("a", config={"data": str(data_root / "data" / "train.jsonl")}) == 0
            status = client.status("a")
            assert (status.state, status.rank, status.rollout_batch_size) == (AdapterState.PENDING, 4, 2)
            with pytest.raises(ControlPlaneError) as err:
                client.register("b", config={"data": str(data_root / "data" / "train.jsonl")})
            assert err.value.status_code == 409
        with ControlPlaneClient(url) as anonymous, pytest.raises(ControlPlaneError) as err:
            anonymous.list()
        assert err.value.status_code == 401
    finally:
        if process.poll() is None:
            tail = stop(process, sig, lines)
    assert "Stopping the control plane" in tail


def test_refuses_to_start_without_slots() -> None:
    result = subprocess.run([sys.executable, "-m", "miles.controller", "--multi-lora-api-port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "set --multi-lora-n-adapters" in result.stderr
