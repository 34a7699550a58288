"""Small native libraries built on first use with the system compiler and cached.

    path = build_library(source, "lora_rowwise", c_compiler(), [FLAGS + NATIVE_FLAGS, FLAGS],
                         key=cpu_fingerprint())

The library is built into `$MILES_KERNEL_CACHE` (default `~/.cache/miles/kernels`), one
file per source, flags, compiler and `key` (what else the build depends on: the CPU for
`-march=native`, torch for a library linked against it), under a file lock so that
concurrent processes build it once. Each flag set is tried in order; the first that builds
wins. Raises `RuntimeError` (with the compiler's last error) where none builds.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def switched_off(variable: str) -> bool:
    """Whether the environment switches a native piece off (`0`, `false`, `no`, `off`)."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


def c_compiler() -> str:
    return _first_compiler("CC", ("cc", "gcc", "clang"), "C")


def cxx_compiler() -> str:
    return _first_compiler("CXX", ("c++", "g++", "clang++"), "C++")


def _first_compiler(variable: str, names: tuple[str, ...], language: str) -> str:
    compiler = os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)
    if not compiler:
        raise RuntimeError(f"no {language} compiler found (set {variable}, or install {' or '.join(names[1:])})")
    return compiler


def cache_dir() -> Path:
    return Path(os.environ.get("MILES_KERNEL_CACHE") or Path.home() / ".cache" / "miles" / "kernels")


def cpu_fingerprint() -> str:
    """The CPU model and its instruction-set flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return platform.machine() + "\n".join(sorted(set(wanted)))


def build_library(source: Path, name: str, compiler: str, flag_sets: Sequence[Sequence[str]], *,
                  key: str = "") -> Path:
    """The shared library built from `source` with the first flag set that compiles (each set
    holds every flag, given after the source so that libraries link; `-o` is added), from
    the cache when built before."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256(b"\0".join([source.read_bytes(), repr([list(f) for f in flag_sets]).encode(),
                                        version.encode(), key.encode()])).hexdigest()[:16]
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{name}-{digest}.so"
    if target.exists():
        return target
    with open(cache / f"{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # another process built it while this one waited
            return target
        errors = []
        for flags in flag_sets:
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / target.name
                result = subprocess.run([compiler, str(source), *flags, "-o", str(built)],
                                        capture_output=True, text=True, timeout=120)
                if result.returncode == 0:
                    os.replace(built, target)  # atomic: a reader sees the whole file or none
                    logger.info("built %s: %s", source.name, target)
                    return target
                errors.append(result.stderr.strip()[-500:])
        raise RuntimeError(f"{compiler} could not build {source.name}: {errors[-1]}")
