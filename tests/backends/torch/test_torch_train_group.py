"""The torch backend's DP group over real Ray actors, orchestrated by the loop's stages.

DP=2 equals DP=1; a push sends only stale adapters' LoRA tensors; cleanup saves and
frees the slot; a new trainer resumes from the latest checkpoint with its step and data
position. The controller side is the real controller class (registry included) as a Ray actor; the
weight receiver and the rollout manager are in-memory actors that record what they get.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import ray
import torch

from miles.backends.base import AdapterSpec, TrainingBackend
from miles.backends.common.checkpoint import latest_checkpoint, read_checkpoint
from miles.backends.common.rank_group import split_prompt_groups
from miles.backends.common.train_group import TrainGroupConfig
from miles.backends.torch.actor import TrainActorConfig
from miles.backends.torch.train_group import torch_train_group
from miles.controller.actor import ControllerConfig, MultiLoRAController
from miles.controller.http_server import HTTPServerConfig
from miles.main.engine_push import EnginePusher
from miles.main.stages import Stages
from miles.utils.adapter_config import AdapterDefaults, resolve_adapter_config
from miles.utils.loss_settings import LossSettings
from miles.utils.types import AdapterState, DataPosition, RolloutBatch
from miles.utils.types.lifecycle_ops import RecordBatch
from tests.helpers.torch_backend_data import make_groups, max_abs_diff, new_actor

pytestmark = pytest.mark.slow


@ray.remote(num_cpus=0)
class RegistryActor(MultiLoRAController):
    """The controller actor's own class (no HTTP), with direct registry access for the tests."""

    def __init__(self, n_slots: int) -> None:
        super().__init__(ControllerConfig(n_slots=n_slots, defaults=AdapterDefaults(lora_rank=4, dp_size=2),
                                          server=HTTPServerConfig(port=0)))

    def register(self, name, config):
        return self.backend.registry.register(name, config)

    def deregister(self, name):
        return self.backend.deregister(name)

    def state(self, name):
        return self.backend.registry.state(name)

    def step(self, name):
        return self.backend.registry.step(name)


@ray.remote(num_cpus=0)
class RecordingRollout:
    """Data positions as a rollout manager reports and restores them."""

    def __init__(self, positions):
        self.positions = dict(positions)
        self.restored = []

    def data_positions(self):
        return dict(self.positions)

    def restore_data_position(self, name, registration_id, position):
        self.restored.append((name, registration_id, position))

    def versions_in_flight(self):
        return {}

    def record_push(self, *pushes):
        pass

    def forget_slot(self, slot):
        pass

    def take_restored(self):
        return self.restored


@ray.remote(num_cpus=0)
class RecordingReceiver:
    def __init__(self) -> None:
        self.received = []

    def push_lora(self, slot, version, peft_config, tensors):
        self.received.append((slot, version, peft_config, tensors))

    def unload_slot(self, slot):
        pass

    def take(self):
        out, self.received = self.received, []
        return out


def test_split_keeps_groups_whole_and_covers_every_sample():
    assert split_prompt_groups([2, 3, 1, 2], 2) == [[0, 1, 5], [2, 3, 4, 6, 7]]
    assert split_prompt_groups([1, 1], 3) == [[0], [1], []]


def _adapter_config(tmp_path, name, rank):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "1+1", "label": "2"}) + "\n")
    raw = {"data": str(data), "rank": rank, "alpha": 8.0, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
           "save": str(tmp_path / name), "rm_type": "math", "lr": 0.02, "lr_decay_style": "cosine", "num_step": 4}
    return resolve_adapter_config(name, raw, AdapterDefaults(lora_rank=4, dp_size=2))


def _batch(rollout_id, groups, step_names):
    groups = sorted(groups, key=lambda g: (g[0].slot, g[0].group_index))
    per_adapter: dict[str, int] = {}
    for g in groups:
        per_adapter[g[0].adapter] = per_adapter.get(g[0].adapter, 0) + 1
    return RolloutBatch(rollout_id=rollout_id, samples=[s for g in groups for s in g],
                        prompt_group_sizes=[len(g) for g in groups], groups_per_adapter=per_adapter,
                        step_names=step_names)


def _group_config(model_dir, n_workers):
    actor = TrainActorConfig(hf_checkpoint=str(model_dir), n_slots=4, lora_rank=4, micro_batch_size=3,
                             loss=LossSettings(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k3"))
    return TrainGroupConfig(actor=actor, n_workers=n_workers, num_cpus_per_worker=0)


async def _started(model_dir, tmp_path, n_workers, receivers=(), positions=None):
    registry = RegistryActor.remote(4)
    for name, rank in (("a", 4), ("b", 2)):
        await registry.register.remote(name, _adapter_config(tmp_path / f"dp{n_workers}", name, rank))
    group = torch_train_group(_group_config(model_dir, n_workers))
    assert isinstance(group, TrainingBackend)
    await group.start()
    rollout = RecordingRollout.remote(positions or {})
    # Versioned pushes: every receiver gets the export through the object store.
    pusher = EnginePusher(group, receivers, rollout, mode="versioned") if receivers else None
    sync = Stages.build(group, registry, rollout, save_interval=1, pusher=pusher)
    snapshot = await sync.slots.reconcile(await registry.snapshot.remote())
    assert sorted(sync.slots.loaded) == ["a", "b"] and {r.step for r in snapshot.live.values()} == {0}
    return registry, group, sync


def _batches(slots):
    a, b = slots["a"], slots["b"]
    return [
        _batch(0, make_groups("a", a, 2, 2, seed=1) + make_groups("b", b, 1, 2, seed=2), ["a"]),
        _batch(1, make_groups("a", a, 2, 2, seed=3) + make_groups("b", b, 1, 2, seed=4), ["a", "b"]),
    ]


async def _train_and_commit(registry, sync, batch):
    """What one driver iteration does after generation (the collector records the batch)."""
    await registry.apply.remote(RecordBatch(batch.rollout_id, batch.groups_per_adapter, batch.step_names))
    trained = await sync.train.train(batch.rollout_id, batch)
    return trained, await sync.train.commit(batch.rollout_id)


async def test_dp2_equals_dp1_and_pushes_only_stale_lora_tensors(ray_session, tiny_model_dir, tmp_path):
    receiver = RecordingReceiver.remote()
    (reg1, dp1, sync1), (reg2, dp2, sync2) = await asyncio.gather(
        _started(tiny_model_dir, tmp_path, 1), _started(tiny_model_dir, tmp_path, 2, receivers=[receiver])
    )
    slots = dp2.loaded_adapters
    assert slots == {"a": 0, "b": 1}

    snapshot = await sync2.push.update_weights(await reg2.snapshot.remote())
    assert set(snapshot.active) == {"a", "b"} and snapshot == await reg2.snapshot.remote()
    pushed = await receiver.take.remote()
    reference = new_actor(tiny_model_dir)  # a fresh adapter is seeded by name: same tensors anywhere
    for name, rank in (("a", 4), ("b", 2)):
        reference.load_adapter(AdapterSpec(name=name, slot=slots[name], rank=rank, alpha=8.0, global_batch_size=4))
    assert [(p[0], p[1]) for p in pushed] == [(0, 1), (1, 1)]
    for (_, _, peft_config, tensors), name in zip(pushed, ("a", "b")):
        expected = reference.export_adapter(name)
        assert tensors.keys() == expected.keys()
        assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in tensors)
        assert all(torch.equal(tensors[k], expected[k]) for k in tensors)
        assert peft_config["r"] == reference.core.loaded(name).spec.rank
    assert await sync2.push.update_weights(snapshot) == snapshot  # nothing changed since
    assert await receiver.take.remote() == []
    await sync1.push.update_weights(await reg1.snapshot.remote())

    for batch in _batches(slots):
        t1, _ = await _train_and_commit(reg1, sync1, batch)
        t2, snapshot = await _train_and_commit(reg2, sync2, batch)
        a1, a2 = t1.result.adapters["a"], t2.result.adapters["a"]
        for field_name in ("loss", "kl", "clip_fraction"):
            assert getattr(a1, field_name) == pytest.approx(getattr(a2, field_name), abs=1e-5)
        assert t1.steps["a"].grad_norm == pytest.approx(t2.steps["a"].grad_norm, abs=1e-5)
        assert t2.steps["a"].lr == t1.steps["a"].lr and a2.samples == 4
        assert set(t2.steps) == set(batch.step_names)
        if batch.rollout_id == 0:
            assert snapshot.active["a"].step == 1 and snapshot.active["b"].step == 0
            snapshot = await sync2.push.update_weights(snapshot)  # only the adapter that stepped
            (slot, version, _, tensors), = await receiver.take.remote()
            assert (slot, version) == (0, 2) and snapshot.active["a"].version == 2
            assert max_abs_diff(tensors, await dp2.actors[1].export_adapter.remote("a")) == 0.0
    for name in ("a", "b"):
        w1 = await dp1.actors[0].export_adapter.remote(name)
        w2 = await dp2.actors[0].export_adapter.remote(name)
        assert max_abs_diff(w1, w2) <= 1e-5
        assert max_abs_diff(w2, await dp2.actors[1].export_adapter.remote(name)) == 0.0  # ranks agree
    await dp1.shutdown()
    await dp2.shutdown()


async def test_reconcile_saves_cleans_up_and_resumes(ray_session, tiny_model_dir, tmp_path):
    positions = {"a": DataPosition(epoch=0, index=4), "b": DataPosition(epoch=1, index=0)}
    registry, group, sync = await _started(tiny_model_dir, tmp_path, 1, positions=positions)
    await sync.push.update_weights(await registry.snapshot.remote())
    batches = _batches(group.loaded_adapters)
    _, snapshot = await _train_and_commit(registry, sync, batches[0])
    assert await sync.slots.save(snapshot) == ["a"]  # a is at step 1
    assert await sync.slots.save(snapshot) == []     # once per step
    _, snapshot = await _train_and_commit(registry, sync, batches[1])
    assert await sync.slots.save(snapshot) == ["a", "b"]
    save_a = tmp_path / "dp1" / "a"
    assert latest_checkpoint(save_a).name == "step_2"
    weights_a = await group.actors[0].export_adapter.remote("a")

    # Retire b while it holds retained gradient of a partial batch.
    await _train_and_commit(registry, sync, _batch(2, make_groups("b", 1, 1, 2, seed=9), []))
    await registry.deregister.remote("b")
    snapshot = await sync.slots.reconcile(await registry.snapshot.remote())
    assert set(snapshot.live) == {"a"} and snapshot.completed == {"b"}
    assert snapshot == await registry.snapshot.remote()
    assert await registry.state.remote("b") is AdapterState.COMPLETED
    assert group.loaded_adapters == {"a": 0} and sorted(sync.slots.loaded) == ["a"]
    assert await group.actors[0].loaded_adapters.remote() == {"a": 0}
    await group.shutdown()

    # A new trainer with a new controller resumes a from its latest checkpoint.
    registry2 = RegistryActor.remote(4)
    await registry2.register.remote("a", _adapter_config(tmp_path / "dp1", "a", 4))
    group2 = torch_train_group(_group_config(tiny_model_dir, 1))
    await group2.start()
    rollout2 = RecordingRollout.remote({})
    sync2 = Stages.build(group2, registry2, rollout2, save_interval=1)
    snapshot = await sync2.slots.reconcile(await registry2.snapshot.remote())
    assert snapshot.pending["a"].step == 2 and await registry2.step.remote("a") == 2
    registration = snapshot.pending["a"].registration_id
    assert await rollout2.take_restored.remote() == [("a", registration, DataPosition(epoch=0, index=4))]
    assert max_abs_diff(await group2.actors[0].export_adapter.remote("a"), weights_a) == 0.0
    state = read_checkpoint(latest_checkpoint(save_a))
    assert state.trainer_state.step == 2 and state.trainer_state.rank == 4
    assert state.trainer_state.data_position == DataPosition(epoch=0, index=4)
    assert read_checkpoint(latest_checkpoint(tmp_path / "dp1" / "b")).trainer_state.data_position == \
        DataPosition(epoch=1, index=0)
    assert await sync2.slots.save_all() == []  # nothing new since the checkpoint it resumed from
    await group2.shutdown()


def _window_config(tmp_path, name, rollout_batch_size):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "1+1", "label": "2"}) + "\n")
    raw = {"data": str(data), "rank": 4, "alpha": 8.0, "rollout_batch_size": rollout_batch_size,
           "n_samples_per_prompt": 2, "save": str(tmp_path / name), "rm_type": "math", "lr": 0.02,
           "weight_decay": 0.01, "lr_warmup_steps": 3}
    return resolve_adapter_config(name, raw, AdapterDefaults(lora_rank=4, dp_size=2))


async def _window_trainer(group, save_root, positions):
    """A new registry and adapter sync over a started DP-2 group: a steps every 3 groups, b every 2."""
    registry = RegistryActor.remote(4)
    for name, groups in (("a", 3), ("b", 2)):
        await registry.register.remote(name, _window_config(save_root, name, groups))
    rollout = RecordingRollout.remote(positions)
    sync = Stages.build(group, registry, rollout, save_interval=1)
    snapshot = await sync.slots.reconcile(await registry.snapshot.remote())
    await sync.push.update_weights(snapshot)  # ACTIVE: only ACTIVE adapters count groups
    return registry, rollout, sync, snapshot


async def test_a_stop_mid_window_keeps_its_gradient_and_the_resumed_step_equals_an_uninterrupted_run(
        ray_session, tiny_model_dir, tmp_path):
    """A save mid-window changes nothing in memory, so the trainer that saved goes on as the
    uninterrupted run; a fresh DP-2 group with a new registry resumes from the save."""
    # Batch 0: a's groups land on both ranks (2 of 3), b's on rank 0 (1 of 2); batch 1 completes both.
    first = _batch(0, make_groups("a", 0, 2, 2, seed=1) + make_groups("b", 1, 1, 2, seed=2), [])
    second = _batch(1, make_groups("a", 0, 1, 2, seed=3) + make_groups("b", 1, 1, 2, seed=4), ["a", "b"])
    positions = {"a": DataPosition(epoch=0, index=2), "b": DataPosition(epoch=0, index=1)}
    group, fresh = (torch_train_group(_group_config(tiny_model_dir, 2)) for _ in range(2))
    await asyncio.gather(group.start(), fresh.start())
    registry, _, sync, _ = await _window_trainer(group, tmp_path, positions)
    _, snapshot = await _train_and_commit(registry, sync, first)
    assert {n: (r.step, r.accumulated_groups) for n, r in snapshot.live.items()} == {"a": (0, 2), "b": (0, 1)}
    assert await sync.slots.save(snapshot) == []  # nothing stepped: no save on the cadence
    assert await sync.slots.save_all() == ["a", "b"]  # what a stop does
    assert await sync.slots.save_all() == []  # nothing new since
    for name, groups in (("a", 2), ("b", 1)):
        ckpt = read_checkpoint(latest_checkpoint(tmp_path / name))
        assert ckpt.path.name == "step_0" and ckpt.accumulated_grad is not None
        assert (ckpt.trainer_state.accumulated_groups, ckpt.trainer_state.accumulated_samples) == (groups, 2 * groups)
        assert ckpt.trainer_state.data_position == positions[name]
    trained, snapshot = await _train_and_commit(registry, sync, second)
    assert {n: (r.step, r.accumulated_groups) for n, r in snapshot.live.items()} == {"a": (1, 0), "b": (1, 0)}

    # The new trainer: the count, the data position and the gradient come back.
    registry_r, rollout_r, sync_r, snapshot = await _window_trainer(fresh, tmp_path, {})
    assert {n: (r.step, r.accumulated_groups) for n, r in snapshot.live.items()} == {"a": (0, 2), "b": (0, 1)}
    assert {(name, position) for name, _, position in await rollout_r.take_restored.remote()} == \
        set(positions.items())
    trained_r, snapshot = await _train_and_commit(registry_r, sync_r, second)
    assert {n: (r.step, r.accumulated_groups) for n, r in snapshot.live.items()} == {"a": (1, 0), "b": (1, 0)}
    for name in ("a", "b"):
        assert trained_r.steps[name].lr == trained.steps[name].lr
        assert trained_r.steps[name].grad_norm == pytest.approx(trained.steps[name].grad_norm, rel=1e-6)
        expected = await group.actors[0].export_adapter.remote(name)
        for rank in (0, 1):
            assert max_abs_diff(await fresh.actors[rank].export_adapter.remote(name), expected) <= 1e-6
    await asyncio.gather(group.shutdown(), fresh.shutdown())
