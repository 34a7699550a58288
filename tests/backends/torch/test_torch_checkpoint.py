"""Checkpoint files: atomic placement, picking the latest complete step, exact round trip
(with the gradient of an unfinished step's window); that gradient is saved as the sum of
every rank or not at all, and resumed on the first rank only while it fits the window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from miles.backends.base import SaveRequest
from miles.backends.common.checkpoint import (
    ACCUMULATED_GRAD,
    COMPLETE_MARKERS,
    AccumulatedGrad,
    OptimizerState,
    TrainerState,
    latest_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from miles.backends.common.rank_group import RankGroup, RankLayout, whole_accumulated_grad
from miles.backends.rank.actor import TrainRank
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.export import GradShare
from miles.utils.types import DataPosition
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, make_groups, max_abs_diff, new_actor, spec


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
    state = TrainerState(name="a", step=step, registration_id="r1", rank=2, alpha=4.0,
                         data_position=DataPosition(epoch=1, index=7))
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


def _save_mid_window(save_dir: Path, step: int, groups: int = 3, samples: int = 6) -> tuple[Path, dict]:
    grad = {"layer.lora_A": torch.randn(2, 3, generator=torch.Generator().manual_seed(99))}
    optimizer = OptimizerState(exp_avg={"layer.lora_A": torch.zeros(2, 3)},
                               exp_avg_sq={"layer.lora_A": torch.zeros(2, 3)}, step=step)
    state = TrainerState(name="a", step=step, registration_id="r1", rank=2, alpha=4.0,
                         data_position=DataPosition(epoch=0, index=5), accumulated_groups=groups,
                         accumulated_samples=samples)
    path = write_checkpoint(save_dir, step, write_adapter=_write_peft, optimizer=optimizer, scheduler={},
                            trainer_state=state, accumulated_grad=AccumulatedGrad(grad, groups=groups, samples=samples))
    return path, grad


def test_the_gradient_of_an_unfinished_window_round_trips_next_to_unchanged_peft_files(tmp_path):
    plain = read_checkpoint(_save(tmp_path / "plain", 4))
    assert plain.accumulated_grad is None and plain.trainer_state.accumulated_groups == 0
    path, grad = _save_mid_window(tmp_path / "mid", 4)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [*COMPLETE_MARKERS, ACCUMULATED_GRAD])  # the PEFT pair as always, plus one file
    ckpt = read_checkpoint(path)
    assert ckpt.accumulated_grad is not None
    assert (ckpt.accumulated_grad.groups, ckpt.accumulated_grad.samples) == (3, 6)
    assert torch.equal(ckpt.accumulated_grad.tensors["layer.lora_A"], grad["layer.lora_A"])
    raw = json.loads((path / "trainer_state.json").read_text())
    assert (raw["accumulated_groups"], raw["accumulated_samples"]) == (3, 6)

    # A trainer_state.json written before these fields existed loads as a checkpoint without one.
    del raw["accumulated_groups"], raw["accumulated_samples"]
    (path / "trainer_state.json").write_text(json.dumps(raw))
    old = read_checkpoint(path)
    assert old.accumulated_grad is None and old.trainer_state.step == 4


def test_a_checkpoint_that_counts_groups_without_their_gradient_is_never_picked(tmp_path):
    earlier = _save(tmp_path, 2)
    path, _ = _save_mid_window(tmp_path, 5)
    assert latest_checkpoint(tmp_path) == path
    (path / ACCUMULATED_GRAD).unlink()
    assert latest_checkpoint(tmp_path) == earlier
    with pytest.raises(FileNotFoundError, match=ACCUMULATED_GRAD):
        read_checkpoint(path)


def test_the_trainer_state_must_count_what_the_gradient_covers(tmp_path):
    optimizer = OptimizerState(exp_avg={}, exp_avg_sq={}, step=1)
    state = TrainerState(name="a", step=1, registration_id="r1", rank=2, alpha=4.0, accumulated_groups=2,
                         accumulated_samples=4)
    with pytest.raises(ValueError, match="2 accumulated groups"):
        write_checkpoint(tmp_path, 1, write_adapter=_write_peft, optimizer=optimizer, scheduler={}, trainer_state=state)
    with pytest.raises(ValueError, match="both be 0 or both > 0"):
        TrainerState(name="a", step=1, registration_id="r1", rank=2, alpha=4.0, accumulated_groups=2)
    assert not (tmp_path / "checkpoints" / "step_1").exists()


def _gathered(shares: list[GradShare | BaseException], groups: int, samples: int) -> AccumulatedGrad | None:
    return whole_accumulated_grad(SaveRequest("a", 3, None, accumulated_groups=groups, accumulated_samples=samples),
                                  shares)


async def test_the_saved_gradient_is_the_sum_of_every_rank_or_nothing():
    one, two = GradShare({"w": torch.tensor([1.0, 2.0])}, 4), GradShare({"w": torch.tensor([0.5, -4.0])}, 4)
    summed = _gathered([one, two], groups=2, samples=4)
    assert summed is not None and (summed.groups, summed.samples) == (2, 4)
    assert torch.equal(summed.tensors["w"], torch.tensor([1.5, -2.0]))
    unstarted = RankGroup(TrainRank, TrainActorConfig(hf_checkpoint="unused", n_slots=1, lora_rank=1), RankLayout(),
                          num_cpus=0.0, num_gpus=0.0)
    nothing = SaveRequest("a", 3, None, accumulated_groups=0, accumulated_samples=0)
    assert await unstarted.accumulated_grad(nothing) is None  # nothing accumulated: no rank is asked
    assert _gathered([one, RuntimeError("the rank is gone")], groups=2, samples=4) is None  # a rank is gone
    six = [GradShare(one.tensors, 6), GradShare(two.tensors, 6)]
    assert _gathered(six, groups=2, samples=4) is None  # a batch not committed


def test_a_resumed_gradient_goes_back_on_the_first_rank_only_and_only_if_it_fits(tiny_model_dir, tmp_path):
    actor = new_actor(tiny_model_dir)
    actor.load_adapter(spec("a", 0, global_batch_size=6, rollout_batch_size=3, save_dir=tmp_path))
    samples, advantages = flatten_with_advantages(make_groups("a", 0, 2, 2, seed=5))
    actor.train(samples, advantages, counts(samples))
    share = actor.accumulated_grad("a")
    tensors, n_samples = share.tensors, share.samples
    assert n_samples == 4 and any(float(t.abs().max()) > 0 for t in tensors.values())  # B (A waits for B != 0)
    path = actor.save_adapter("a", 0, None, AccumulatedGrad(tensors, groups=2, samples=n_samples))

    def resumed(rank: int, **kw) -> tuple[int, dict[str, torch.Tensor], dict]:
        other = new_actor(tiny_model_dir, rank=rank, world_size=2)  # of DP replica `rank`
        loaded = other.load_adapter(spec("a", 1, save_dir=tmp_path, **kw), path)
        return loaded.accumulated_groups, other.accumulated_grad("a").tensors, other.schedule_state("a")

    groups, grads, clock = resumed(0, global_batch_size=6, rollout_batch_size=3)
    assert groups == 2 and max_abs_diff(grads, tensors) == 0.0
    assert clock["samples_seen"] - clock["samples_at_last_step"] == 4
    groups, grads, _ = resumed(1, global_batch_size=6, rollout_batch_size=3)  # zeros: the sum stays whole
    assert groups == 2 and all(float(t.abs().max()) == 0 for t in grads.values())
    groups, grads, clock = resumed(0, global_batch_size=4, rollout_batch_size=2)  # a window of 2 groups now
    assert groups == 0 and all(float(t.abs().max()) == 0 for t in grads.values())
    assert clock["samples_seen"] == clock["samples_at_last_step"]
