"""Checkpoint files: atomic placement, picking the latest complete step, exact round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from miles.backends.torch.checkpoint import (
    OptimizerState,
    TrainerState,
    latest_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from miles.utils.types import DataPosition


def _write_peft(path: Path) -> None:
    path.mkdir()
    save_file({"w": torch.ones(2)}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": 2}))


def _save(save_dir: Path, step: int, write_adapter=_write_peft) -> Path:
    g = torch.Generator().manual_seed(step)
    optimizer = OptimizerState(
        exp_avg={"layer.lora_A": torch.randn(2, 3, generator=g)},
        exp_avg_sq={"layer.lora_A": torch.rand(2, 3, generator=g)},
        step=step,
        hyper={"lr": 0.1},
    )
    state = TrainerState(name="a", step=step, registration_id="r1", rank=2, alpha=4.0, data_position=DataPosition(epoch=1, index=7))
    return write_checkpoint(save_dir, step, write_adapter=write_adapter, optimizer=optimizer,
                            scheduler={"samples_seen": 8 * step}, trainer_state=state)


def test_round_trip_and_latest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _save(tmp_path, 2)
    path10 = _save(tmp_path, 10)
    # A partial step directory and a leftover temp directory are never picked.
    (tmp_path / "checkpoints" / "step_11").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step_12-x").mkdir()
    assert latest_checkpoint(tmp_path) == path10  # 10 > 2 numerically, not as text
    ckpt = read_checkpoint(path10)
    g = torch.Generator().manual_seed(10)
    assert torch.equal(ckpt.optimizer.exp_avg["layer.lora_A"], torch.randn(2, 3, generator=g))
    assert torch.equal(ckpt.optimizer.exp_avg_sq["layer.lora_A"], torch.rand(2, 3, generator=g))
    assert ckpt.optimizer.step == 10 and ckpt.optimizer.hyper == {"lr": 0.1}
    assert ckpt.scheduler == {"samples_seen": 80}
    assert ckpt.trainer_state == TrainerState("a", 10, "r1", 2, 4.0, DataPosition(epoch=1, index=7))
    assert json.loads((path10 / "trainer_state.json").read_text())["data_position"] == {"epoch": 1, "index": 7}


def test_failed_write_leaves_no_directory_and_keeps_the_previous_one(tmp_path):
    good = _save(tmp_path, 3)

    def broken(path: Path) -> None:
        path.mkdir()
        (path / "adapter_config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 3, write_adapter=broken)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3"]
    assert latest_checkpoint(tmp_path) == good
    assert read_checkpoint(good).optimizer.step == 3


def test_rewriting_a_step_replaces_it(tmp_path):
    _save(tmp_path, 1)
    path = _save(tmp_path, 1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    assert read_checkpoint(path).trainer_state.step == 1


def test_incomplete_directory_is_rejected_with_what_is_missing(tmp_path):
    (tmp_path / "step_1").mkdir()
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        read_checkpoint(tmp_path / "step_1")
