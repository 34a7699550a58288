"""Chromium for the dashboard's browser test: Debian's `chromium` package, installed once.

Playwright (a dev dependency) drives the system's Chromium, so nothing is downloaded but
the distribution's package. `make test` starts this file in the background before the lint,
so the install overlaps the lint and the first tests; the test waits on the same lock.

    python tests/helpers/chromium.py    # install it now (prints its path)
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache"
INSTALL_COMMANDS = (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"])
INSTALL_TIMEOUT = 900.0
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
"""Headless flags: no sandbox (tests run as root in CI), and none of Chromium's own calls
to the network, which this machine refuses."""


class ChromiumUnavailableError(RuntimeError):
    """No Chromium, and it cannot be installed here; the message says how to get one."""


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def ensure_chromium() -> str:
    """The path of a Chromium, installed from Debian's packages unless one is there.
    Processes that ask at once wait for one install (a file lock)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with (CACHE_DIR / "chromium.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = find_chromium()
        if found:
            return found
        shown = " && ".join(shlex.join(c) for c in INSTALL_COMMANDS)
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            raise ChromiumUnavailableError(f"no chromium on PATH and no apt-get as root to install it: install "
                                           f"Debian's chromium package ({shown}) or put a Chromium on PATH")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in INSTALL_COMMANDS:
            result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, env=env)
            if result.returncode != 0:
                raise ChromiumUnavailableError(f"could not install chromium ({shown}): {shlex.join(command)} exited "
                                               f"{result.returncode}:\n{result.stderr[-2000:]}")
        found = find_chromium()
        if not found:
            raise ChromiumUnavailableError(f"{shown} ran, but no chromium is on PATH")
        return found


if __name__ == "__main__":
    try:
        print(ensure_chromium())
    except ChromiumUnavailableError as error:
        sys.exit(str(error))
