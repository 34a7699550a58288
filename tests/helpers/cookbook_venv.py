"""The `tinker-cookbook` test's virtualenv: the cookbook pinned, from the package registry.

The cookbook pins a `transformers` other than ours and needs none of our packages, so it
gets an environment of its own under `.cache/`, made once and reused while the pins stay the
same. `make test` starts this file in the background before the lint, so the minute the
install takes overlaps the lint and the first tests; the test waits on the same lock.

    python tests/helpers/cookbook_venv.py    # make it now (prints its path)
"""

from __future__ import annotations

import fcntl
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache"
PINS = ("tinker-cookbook[math-rl]==0.5.8", "tinker==0.38.0", "torch==2.13.0")
"""`math-rl`: the extra the math_rl recipe imports (sympy, pylatexenc, math-verify). torch is
pinned to the release the project's own environment uses (its CPU build)."""
INSTALL_TIMEOUT = 900.0


class CookbookVenvError(RuntimeError):
    """The virtualenv could not be made; the message names the commands to run by hand."""


def venv_dir() -> Path:
    key = "-".join(pin.replace("[", "_").replace("]", "").replace("==", "_") for pin in PINS)
    return CACHE_DIR / f"cookbook-venv-{key}"


def venv_commands(venv: Path) -> list[list[str]]:
    return [[sys.executable, "-m", "venv", str(venv)], [str(venv / "bin" / "pip"), "install", "--quiet", *PINS]]


def pins_installed(venv: Path) -> bool:
    """Whether `venv` has each pinned distribution at its pinned version (a local build tag
    such as torch's `+cpu` counts as that version)."""
    python = venv / "bin" / "python"
    if not python.exists():
        return False
    wanted = {pin.split("==")[0].split("[")[0]: pin.split("==")[1] for pin in PINS}
    probe = ("import importlib.metadata as m, json, sys; "
             "print(json.dumps({n: m.version(n) for n in json.loads(sys.argv[1])}))")
    result = subprocess.run([str(python), "-c", probe, json.dumps(list(wanted))], capture_output=True, text=True,
                            timeout=120)
    if result.returncode != 0:
        return False
    found = json.loads(result.stdout)
    return all(found[name].split("+")[0] == version for name, version in wanted.items())


def ensure_cookbook_venv() -> Path:
    """The cookbook's virtualenv, made (about a minute) unless one with the pinned versions is
    there. Processes that ask at once wait for one build (a file lock)."""
    venv = venv_dir()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with (CACHE_DIR / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if pins_installed(venv):
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        commands = venv_commands(venv)
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
            if result.returncode != 0:
                shown = " && ".join(shlex.join(c) for c in commands)
                raise CookbookVenvError(
                    f"could not make the tinker-cookbook virtualenv (it needs the package registry once); make it "
                    f"with:\n  {shown}\n{shlex.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return venv


if __name__ == "__main__":
    try:
        print(ensure_cookbook_venv())
    except CookbookVenvError as error:
        sys.exit(str(error))
