"""`python -m miles.main.control_plane` as a subprocess: started until it logs its URL, stopped by a signal.

    from tests.helpers.controller_process import start, stop
    process, url, lines = start(["--multi-lora-n-adapters", "2", ...])
    stderr_tail = stop(process, signal.SIGTERM, lines)
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading

from tests.helpers.waiting import wait_until

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
