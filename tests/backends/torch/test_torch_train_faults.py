"""Train faults in the torch backend: a failed train call counts nowhere, a dead rank is named.

A train call that raises (injected by the test rank of `fault_injection`, a
`TorchTrainActor` subclass; the group runs it through `--train-actor-path`) takes its
batch back: gradients, LR clock and optimizer state are as before the call, on every rank,
so training the batch again gives exactly the update of a run that never failed. A killed
rank makes `train` raise `TrainRankLostError`; the adapters are still saved from a
surviving rank and the group shuts down.
"""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from miles.backends.base import SaveRequest, TrainRankLostError
from miles.backends.common.train_group import TrainGroup, TrainGroupConfig
from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.actor import TorchTrainActor
from miles.backends.torch.train_group import torch_train_group
from miles.utils.types import RolloutBatch
from tests.helpers.fault_injection import RANK_1_FAILS_FIRST, FaultInjectingTrainActor, InjectedTrainFault
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, make_groups, spec


def _actor(model_dir, faults=frozenset()) -> TorchTrainActor:
    """A rank whose train calls `faults` ((rank, call), rank -1: any) fail after the first micro-batch."""
    return FaultInjectingTrainActor.failing(faults)(TrainActorConfig(hf_checkpoint=str(model_dir), n_slots=4,
                                                                     lora_rank=4, micro_batch_size=3))


def _loaded(actor: TorchTrainActor) -> TorchTrainActor:
    actor.load_adapter(spec("a", 0, global_batch_size=8))
    actor.load_adapter(spec("b", 1, rank=2, global_batch_size=8))
    return actor


def _batch(seed: int):
    return flatten_with_advantages(make_groups("a", 0, 2, 2, seed=seed) + make_groups("b", 1, 2, 2, seed=seed + 1))


def _state(actor: TorchTrainActor) -> dict[str, torch.Tensor]:
    """Everything a batch may change: gradients, weights, moments, step counts, LR clocks."""
    out = {}
    for slot in (0, 1):
        for i, g in enumerate(actor.core.optimizer.slot_grads(slot)):
            out[f"grad.{slot}.{i}"] = g.clone()
        exp_avg, exp_avg_sq, step = actor.core.optimizer.slot_state(slot)
        for i, (m, v) in enumerate(zip(exp_avg, exp_avg_sq)):
            out[f"exp_avg.{slot}.{i}"], out[f"exp_avg_sq.{slot}.{i}"] = m.clone(), v.clone()
        out[f"step.{slot}"] = torch.tensor(step)
    for name in ("a", "b"):
        out.update({f"{name}.{k}": v.clone() for k, v in actor.export_adapter(name).items()})
        out[f"{name}.clock"] = torch.tensor(actor.core.adapters[name].schedule.samples_seen)
    return out


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"changed: {different[:5]}"


def test_failed_train_call_takes_its_batch_back_and_the_retry_counts_once(tiny_model_dir):
    faulty = _loaded(_actor(tiny_model_dir, {(-1, 2)}))
    clean = _loaded(_actor(tiny_model_dir))
    first, second = _batch(1), _batch(3)
    for actor in (faulty, clean):
        actor.train(*first, counts(first[0]))
    before = _state(faulty)
    with pytest.raises(InjectedTrainFault):
        faulty.train(*second, counts(second[0]))
    _assert_equal(_state(faulty), before)  # the first batch's gradients are kept, the second's are gone

    # The same batch again (no fault this time), then a step: exactly the run that never failed.
    faulty.train(*second, counts(second[0]))
    clean.train(*second, counts(second[0]))
    faulty.step_adapters(["a", "b"])
    clean.step_adapters(["a", "b"])
    _assert_equal(_state(faulty), _state(clean))


def test_a_failed_first_call_after_a_step_leaves_zero_gradients(tiny_model_dir):
    """The take-back of a call that began on all-zero gradients (kept as no copy) zeroes them."""
    faulty = _loaded(_actor(tiny_model_dir, {(-1, 1)}))
    before, batch = _state(faulty), _batch(5)
    assert all(not v.any() for k, v in before.items() if k.startswith("grad."))
    with pytest.raises(InjectedTrainFault):  # raised after the first micro-batch's backward
        faulty.train(*batch, counts(batch[0]))
    _assert_equal(_state(faulty), before)


def test_without_taking_back_the_fault_leaves_partial_gradients(tiny_model_dir):
    """The hook fires after a backward, so the test above would see a double count if
    `discard_batch` did nothing."""
    actor = _loaded(_actor(tiny_model_dir, {(-1, 1)}))
    before = _state(actor)
    actor.core.take_back.discard = lambda: None
    batch = _batch(1)
    with pytest.raises(InjectedTrainFault):
        actor.train(*batch, counts(batch[0]))
    after = _state(actor)
    assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith("grad."))


def _rollout(rollout_id: int, seed: int, slots: dict[str, int]) -> RolloutBatch:
    groups = make_groups("a", slots["a"], 2, 2, seed=seed) + make_groups("b", slots["b"], 2, 2, seed=seed + 1)
    return RolloutBatch(rollout_id=rollout_id, samples=[s for g in groups for s in g],
                        prompt_group_sizes=[len(g) for g in groups], groups_per_adapter={"a": 2, "b": 2},
                        step_names=["a", "b"])


async def _group(model_dir, tmp_path, actor_path: str | None = None) -> TrainGroup:
    actor = TrainActorConfig(hf_checkpoint=str(model_dir), n_slots=4, lora_rank=4, micro_batch_size=3)
    group = torch_train_group(TrainGroupConfig(actor=actor, n_workers=2, num_cpus_per_worker=0, actor_path=actor_path))
    await group.start()
    await group.load_adapter(spec("a", 0, global_batch_size=8, save_dir=tmp_path / "a"))
    await group.load_adapter(spec("b", 1, rank=2, global_batch_size=8, save_dir=tmp_path / "b"))
    return group


async def _weights(group: TrainGroup, name: str) -> dict[str, torch.Tensor]:
    return ray.get((await group.export_adapter(name)).tensors)


@pytest.mark.slow
async def test_a_rank_that_fails_makes_every_rank_take_the_batch_back_and_a_dead_rank_is_named(
        ray_session, tiny_model_dir, tmp_path):
    # Rank 1 fails its first train call; rank 0 trained its share and must drop it too.
    faulty = await _group(tiny_model_dir, tmp_path / "faulty", RANK_1_FAILS_FIRST)
    clean = await _group(tiny_model_dir, tmp_path / "clean")
    slots = {"a": 0, "b": 1}
    try:
        with pytest.raises(InjectedTrainFault):
            await faulty.train(0, _rollout(0, 1, slots))
        for group in (faulty, clean):
            await group.train(1, _rollout(1, 1, slots))
            await group.step_adapters(["a", "b"])
        for name in ("a", "b"):
            got, want = await _weights(faulty, name), await _weights(clean, name)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in got), f"adapter {name} differs from the clean run"
            assert any(float(v.abs().sum()) > 0 for k, v in got.items() if "lora_B" in k)  # it did step

        # Rank 0 dies: training names the lost rank; saving falls back to rank 1, which holds the same weights.
        before = await _weights(clean, "a")
        ray.kill(clean.actors[0])
        with pytest.raises(TrainRankLostError, match="train rank died"):
            await clean.train(2, _rollout(2, 5, slots))
        path = await clean.save_adapter(SaveRequest("a", 1))
        saved = load_file(str(path / "adapter_model.safetensors"))
        assert sorted(saved) == sorted(before)
        assert all(torch.equal(saved[k], before[k]) for k in saved)
    finally:
        await clean.shutdown()  # with a dead rank: warns, does not raise
        await faulty.shutdown()
