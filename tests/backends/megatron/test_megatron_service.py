"""End-to-end: the service scenario of `tests/main/test_service_scenarios.py`
(`tests/helpers/service_scenario.py`), unchanged, with the trainer on
`--train-backend megatron --tensor-model-parallel-size 2`.

Adapters register, train, join, leave, resume from their checkpoints and are saved at
SIGTERM over the HTTP control plane, with two gloo Megatron ranks (one DP replica)
doing the training; the checkpoints load in PEFT.
"""

from __future__ import annotations

import pytest

from tests.helpers.service_scenario import run_service_lifecycle, write_scenario_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MEGATRON_TP2 = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2"]


def test_service_scenario_on_megatron_tp2(tiny_model_dir, tmp_path):
    write_scenario_data(tmp_path)
    run_service_lifecycle(tiny_model_dir, tmp_path, extra_flags=MEGATRON_TP2)
    log = (tmp_path / "trainer.log").read_text()
    assert "Started 2 Megatron rank(s): 1 data-parallel x 2 tensor-parallel" in log
