"""`make gpu-check`: refuses without CUDA; its checks pass when the builtin engine stands in for SGLang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_without_cuda_it_says_so_and_fails():
    done = run(timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stdout


@pytest.mark.slow
def test_cpu_rehearsal_passes_every_check(tmp_path):
    done = run("--cpu-rehearsal", "--work", str(tmp_path), timeout=480)
    verdicts = [line for line in done.stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    checks = {line.split(" ", 2)[1].rstrip(":"): line.split(" ", 1)[0] for line in verdicts}
    assert checks == {"install": "SKIP", "adapters": "PASS", "sglang-peft": "PASS", "sglang-trainer": "PASS",
                      "push-in-flight": "PASS", "in-place": "PASS", "service": "SKIP",
                      "megatron-tp1": "PASS", "megatron-tp2": "SKIP"}
