"""Child server processes (inference servers, the router): launch, wait for health, stop.

    proc, url = await ServerProcess.start([sys.executable, "-m", "...", "--port", "0"], url_line=URL_LINE,
                                          log_path=work / "server.log", timeout_s=120)
    proc.terminate()

Each child runs in its own process group with its output in a log file, so stopping it
stops everything it spawned, and a child that dies before answering raises an error
that quotes the last lines of its log.

Ports: a child that can bind port 0 does, and writes the URL it got in its log (the
builtin server; `ServerProcess.start` reads it back), so nothing can take the port in
between. A child that needs its port on the command line (SGLang, the sglang-router) gets
one probed free with `free_port`; another process may take it before the child binds it,
so its launcher runs under `on_probed_ports`, which starts the child again on fresh ports
when it died of that (`PortTakenError`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ServerStartError(RuntimeError):
    """A child server exited or never answered its health route."""


class PortTakenError(ServerStartError):
    """A child server exited because another process held the port it was given."""


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM the child when its parent dies (e.g. a killed Ray actor)."""
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass  # not Linux/glibc: the owner's terminate() remains the only stop


PORT_ATTEMPTS = 3
"""Starts of a child on probed ports before giving up (each after another process took one)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host`, for a child that cannot bind port 0 itself (see the module docstring)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


async def on_probed_ports(start: Callable[[], Awaitable[T]], what: str) -> T:
    """`start()` launches a child on ports probed with `free_port`, waits until it is ready and
    stops it if it is not; when the child died because another process took one of its ports
    first (`PortTakenError`), start it again, on fresh ports, up to `PORT_ATTEMPTS` times."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return await start()
        except PortTakenError:
            if attempt == PORT_ATTEMPTS:
                raise
            logger.warning("%s could not bind a port another process took first; starting it on other ports", what)
    raise AssertionError("unreachable")


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"


class ServerProcess:
    def __init__(self, popen: subprocess.Popen, command: list[str], log_path: Path, log_offset: int = 0):
        self.popen = popen
        self.command = command
        self.log_path = log_path
        self.log_offset = log_offset
        """Where this child's output starts in `log_path` (a restarted server appends to its predecessor's log)."""

    @classmethod
    def launch(cls, command: list[str], *, log_path: Path, env: dict[str, str] | None = None,
               cwd: str | None = None) -> ServerProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            offset = log.seek(0, os.SEEK_END)
            popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        return cls(popen, command, log_path, offset)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    async def start(cls, command: list[str], *, log_path: Path, url_line: re.Pattern[str], timeout_s: float,
                    what: str = "server", env: dict[str, str] | None = None) -> tuple[ServerProcess, str]:
        """Launch a child that binds port 0 and reports its URL in a line matching `url_line`
        (group 1), then wait until that URL answers `/health`; the child is stopped if it never does."""
        process = cls.launch(command, log_path=log_path, env=env)
        deadline = time.monotonic() + timeout_s
        try:
            url = (await process.wait_for_line(url_line, timeout_s=timeout_s, what=what)).group(1)
            await process.wait_ready(url + "/health", timeout_s=max(1.0, deadline - time.monotonic()), what=what)
        except BaseException:
            process.terminate()
            raise
        return process, url

    def alive(self) -> bool:
        return self.popen.poll() is None

    def died_error(self, what: str) -> ServerStartError:
        error = PortTakenError if self.port_in_use() else ServerStartError
        return error(
            f"{what} exited with code {self.popen.returncode} before it was ready.\n"
            f"command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def output(self) -> str:
        """What this child wrote to its log so far."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def port_in_use(self) -> bool:
        """Whether the child says it could not bind its port because another process holds it
        (uvicorn's and the Rust router's messages both read "address already in use")."""
        return "address already in use" in self.output().lower()

    async def wait_for_line(self, pattern: re.Pattern[str], *, timeout_s: float, what: str = "server") -> re.Match[str]:
        """Wait until the child's output matches `pattern` (e.g. the line that reports the port it
        bound); raise with the log's tail if the child dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = pattern.search(self.output())
            if match:
                return match
            if not self.alive():
                raise self.died_error(what)
            await asyncio.sleep(0.1)
        raise ServerStartError(
            f"{what} did not write a line matching {pattern.pattern!r} within {timeout_s:.0f} s.\n"
            f"command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    async def wait_ready(self, url: str, *, timeout_s: float, what: str = "server") -> None:
        """Poll `url` until it answers 200; raise with the log's tail if the child dies or times out."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise self.died_error(what)
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
