"""Child server processes (inference servers, the router): launch, wait for health, stop.

    proc = ServerProcess.launch([sys.executable, "-m", "..."], log_path=work / "server.log")
    await proc.wait_ready("http://127.0.0.1:30000/health", timeout_s=120)
    proc.terminate()

Each child runs in its own process group with its output in a log file, so stopping it
stops everything it spawned, and a child that dies before answering raises an error
that quotes the last lines of its log.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """A child server exited or never answered its health route."""


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM the child when its parent dies (e.g. a killed Ray actor)."""
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass  # not Linux/glibc: the owner's terminate() remains the only stop


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"


class ServerProcess:
    def __init__(self, popen: subprocess.Popen, command: list[str], log_path: Path):
        self.popen = popen
        self.command = command
        self.log_path = log_path

    @classmethod
    def launch(cls, command: list[str], *, log_path: Path, env: dict[str, str] | None = None,
               cwd: str | None = None) -> ServerProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        return cls(popen, command, log_path)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def _died_error(self, what: str) -> ServerStartError:
        return ServerStartError(
            f"{what} exited with code {self.popen.returncode} before it was ready.\n"
            f"command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    async def wait_ready(self, url: str, *, timeout_s: float, what: str = "server") -> None:
        """Poll `url` until it answers 200; raise with the log's tail if the child dies or times out."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise self._died_error(what)
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                await asyncio.sleep(0.25)
        raise ServerStartError(
            f"{what} did not answer {url} within {timeout_s:.0f} s.\n"
            f"command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def terminate(self, grace_s: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL after `grace_s`; idempotent."""
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=grace_s)
