"""End-to-end: the service scenario of `tests/main/test_service_scenarios.py`, unchanged,
with the trainer on `--train-backend megatron --tensor-model-parallel-size 2`.

Adapters register, train, join, leave, resume from their checkpoints and are saved at
SIGTERM over the HTTP control plane, with two gloo Megatron ranks (one DP replica)
doing the training; the checkpoints load in PEFT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "main"))
import test_service_scenarios as scenarios  # noqa: E402
from driver_harness import write_arithmetic_dataset  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MEGATRON_TP2 = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2"]


def test_service_scenario_on_megatron_tp2(tiny_model_dir, tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    write_arithmetic_dataset(data / "add.jsonl", 400, op="+", seed=1)
    write_arithmetic_dataset(data / "sub.jsonl", 400, op="-", seed=2)
    torch_flags = scenarios.tiny_run_flags
    monkeypatch.setattr(scenarios, "tiny_run_flags", lambda *a, **kw: torch_flags(*a, **kw) + MEGATRON_TP2)
    scenarios.test_service_mode_lifecycle_over_http(tiny_model_dir, tmp_path)
    log = (tmp_path / "trainer.log").read_text()
    assert "Started 2 Megatron rank(s): 1 data-parallel x 2 tensor-parallel" in log
