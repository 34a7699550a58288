"""Run a trainer as a user would: a subprocess with its own Ray, polled over HTTP.

Used by the end-to-end tests of `tests/main/`. The tiny random model and the small
arithmetic datasets are made by the tests themselves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinker import types

from miles.controller.actor import API_URL_LINE
from tests.helpers.waiting import WaitTimeout, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_arithmetic_dataset(path: Path, n: int, *, op: str = "+", seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            answer = a + b if op == "+" else a - b
            fh.write(json.dumps({"text": f"{a}{op}{b}=", "label": str(answer)}) + "\n")
    return path


def cycle_datum(offset: int, length: int = 12) -> types.Datum:
    """A Tinker SFT datum: next-token prediction over the cycle 5, 6, 7, 5, ... from `offset`."""
    tokens = [5 + (offset + i) % 3 for i in range(length + 1)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length})


def tiny_run_flags(model_dir: Path, save: Path, *, n_adapters: int, port: int = 0) -> list[str]:
    """Small, fast settings: two prompt groups of two samples per step, short answers. `port`
    0: the control plane binds a port the OS picks (`DriverProcess.wait_for_api_url` reads it)."""
    return [
        "--hf-checkpoint", str(model_dir),
        "--multi-lora-n-adapters", str(n_adapters),
        "--multi-lora-api-port", str(port),
        "--multi-lora-allowed-roots", str(save.parent),
        "--multi-lora-idle-poll-s", "0.5",
        "--multi-lora-max-empty-wait-s", "20",
        "--multi-lora-max-coalesce-wait-s", "0.2",
        "--lora-rank", "4",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2",
        "--global-batch-size", "4",
        "--rollout-max-response-len", "6",
        "--rollout-num-engines", "1",
        "--rm-type", "random",  # a random policy never answers: random rewards still move the weights
        "--lr", "1e-3",
        "--save", str(save),
    ]


class DriverProcess:
    """A trainer subprocess whose output goes to a log file (read on failure)."""

    def __init__(self, module: str, args: list[str], log_path: Path) -> None:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str, **kwargs: Any) -> Any:
        """`waiting.wait_until` that gives up as soon as the trainer exits, and quotes its log."""
        try:
            return wait_until(predicate, timeout, what, poll_s=0.2, alive=lambda: self.proc.poll() is None, **kwargs)
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; trainer exit code {self.proc.poll()}, its log:\n{self.log_tail()}") from None

    def wait_for_api_url(self, timeout: float = 240.0) -> str:
        """The control plane's URL, from the line the trainer logs once it listens (with
        `--multi-lora-api-port 0`, on the port the OS picked), once it answers /health."""
        deadline = time.monotonic() + timeout
        found = self.wait_until(lambda: API_URL_LINE.search(self.log_path.read_text(errors="replace")), timeout,
                                "the trainer to log its control plane's address")
        self.wait_for_http(found.group(1), timeout=max(1.0, deadline - time.monotonic()))
        return found.group(1)

    def wait_for_http(self, url: str, timeout: float = 240.0) -> None:
        import httpx

        self.wait_until(lambda: httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200,
                        timeout, f"the trainer to serve {url}/health", retry_on=(httpx.HTTPError,))

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"trainer still running after {timeout}s:\n{self.log_tail()}") from None

    def terminate(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL to the driver's session and to every process below it (Ray's own processes
        may sit in sessions of their own), then wait until all of them are gone, so that none
        writes after this returns."""
        if self.proc.poll() is None:
            below = descendant_pids(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in below:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(timeout=timeout)
            wait_until(lambda: not any(_alive(pid) for pid in below), timeout,
                       f"the trainer's processes {below} to exit after SIGKILL")
        self._log.close()


def descendant_pids(root_pid: int) -> list[int]:
    """Every process below `root_pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed child of a killed parent is reaped by init)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
