"""The driver's stages and loops over the backend contract, with no Ray: a fake backend, a
fake rollout manager and the real controller (registry included) in-process.

Covers register -> train -> retire -> re-register -> resume through the real
`run_loop`, the data position carried by checkpoints, the snapshot each stage hands
down, the progress line of a re-registered adapter, metrics of an adapter named like the
loop's own, a Tinker client's model trained alone and then beside an RL adapter, and the
prefetch of `train_async` when training fails.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from miles.backends.base import TrainingBackend
from miles.controller.tinker.models import LoraLayout
from miles.controller.tinker.sessions import SessionInfo
from miles.main import train_async, train_multi_lora_async
from miles.rollout.buffers import AdapterBuffers
from miles.rollout.collection import BatchCollector, CollectionConfig
from miles.utils.arguments import MilesConfig
from miles.utils.tracking import read_metrics
from miles.utils.types import (
    AdamStep,
    AdapterState,
    ClientCommandKind,
    ClientDatum,
    ClientLoss,
    DataPosition,
    ForwardCommand,
    MultiLoRASnapshot,
    OptimStepCommand,
    RolloutBatch,
    next_slot_version,
)
from miles.utils.types.lifecycle_ops import FreeSlots, RecordWeightUpdate, SetStep
from tests.helpers.in_process_trainer import Trainer
from tests.helpers.lifecycle_fakes import (
    FakeBackend,
    FakeRollout,
    InProcessHandle,
)
from tests.helpers.waiting import wait_until_async


@dataclass
class StallingRollout(FakeRollout):
    """Its first batch is FakeRollout's; later ones come from a real `BatchCollector` over buffers
    that nothing fills: a collection waiting for groups (up to its 30 s empty wait)."""

    collecting: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False

    async def generate(self, rollout_id: int, snapshot: MultiLoRASnapshot | None = None) -> RolloutBatch:
        if rollout_id == 0:
            return await super().generate(rollout_id, snapshot)
        config = CollectionConfig(global_batch_size=4, dp_size=1, max_weight_staleness=None,
                                  max_coalesce_wait_s=0.5, max_empty_wait_s=30.0)
        collector = BatchCollector(config, AdapterBuffers(), self.controller, producer=_HealthyProducer())
        self.collecting.set()
        try:
            return await collector.collect(rollout_id, snapshot)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class _HealthyProducer:
    def raise_if_failed(self) -> None:
        pass

    def gave_up(self, registration_id: str) -> bool:
        return False


async def test_a_stop_ends_a_waiting_collection_within_two_seconds_then_the_adapter_is_saved(tmp_path):
    t = Trainer(tmp_path, rollout_cls=StallingRollout)
    t.stages.slots.save_interval = None  # only the save at shutdown writes
    await t.register("a")
    stop = asyncio.Event()
    loop = asyncio.create_task(train_multi_lora_async.run_loop(MilesConfig(multi_lora_n_adapters=2),
                                                               t.components, stop, t.progress))
    await wait_until_async(t.rollout.collecting.is_set, 30, "the second collection to wait for groups")
    assert t.status("a").step == 1 and not t.backend.disk
    stop.set()  # what SIGTERM and SIGINT do
    await asyncio.wait_for(loop, timeout=2.0)
    assert t.rollout.cancelled  # the collection stopped waiting, not only the loop
    assert await t.stages.slots.save_all() == ["a"]  # shutdown's save, as before
    assert [max(steps) for steps in t.backend.disk.values()] == [1]


def test_fake_backend_implements_the_contract():
    """Each method of the `TrainingBackend` Protocol, a coroutine function where the Protocol's is, with the
    same parameters (names, kinds, defaults): a contract change the fake does not follow
    fails here rather than as a loop test's puzzling error."""
    assert isinstance(FakeBackend(), TrainingBackend)
    contract = {name: member for name, member in vars(TrainingBackend).items()
                if inspect.isfunction(member) and not name.startswith("_")}
    assert {"start", "train", "step_adapters", "save_adapter", "shutdown"} <= set(contract)

    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    for name, method in contract.items():
        fake = getattr(FakeBackend, name)
        assert inspect.iscoroutinefunction(fake) == inspect.iscoroutinefunction(method), name
        assert parameters(fake) == parameters(method), name


async def test_register_train_retire_reregister_resume(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    t = Trainer(tmp_path)
    await t.register("a", num_step=2)
    await t.register("b", num_step=3)
    await t.run_until_idle()

    # Each adapter trained num_step steps of 2 groups x 2 samples, retired, left its slot.
    a, b = t.status("a"), t.status("b")
    assert (a.state, a.step, b.state, b.step) == (AdapterState.COMPLETED, 2, AdapterState.COMPLETED, 3)
    assert t.backend.slots == {} and t.backend.specs == {}
    assert sorted(t.receiver.unloads) == [0, 1], "a retired adapter's slot stays loaded on the engines"
    save_a, save_b = str(tmp_path / "save" / "adapters" / "a"), str(tmp_path / "save" / "adapters" / "b")
    disk = t.backend.disk
    assert sorted(disk[save_a]) == [1, 2] and sorted(disk[save_b]) == [1, 2, 3]
    assert disk[save_a][2].weights == 8.0 and disk[save_b][3].weights == 12.0
    # Every save records where the adapter's dataset stood: 2 groups per step.
    positions = [disk[save_b][s].data_position for s in (1, 2, 3)]
    assert positions == [DataPosition(0, 2), DataPosition(0, 4), DataPosition(0, 6)]
    # Pushes: at load and after every step that is not the last; versions from the registry's rule.
    assert t.pushes(0) == [(1, 0.0), (2, 4.0)]
    assert t.pushes(1) == [(1, 0.0), (2, 4.0), (3, 8.0)]
    # The driver handed its snapshot to every generate call.
    assert t.rollout.snapshots_given == 3

    # Re-registered, `a` resumes: its step, its weights and its dataset where it stopped.
    await t.register("a", num_step=2)
    registration = t.snapshot().pending["a"].registration_id
    await t.run_until_idle()
    a = t.status("a")
    assert a.registration_id == registration and (a.state, a.step) == (AdapterState.COMPLETED, 4)
    assert t.rollout.restores == [("a", registration, DataPosition(0, 4))]
    assert t.rollout.group_indices["a"] == list(range(8))  # 0..3 before, 4..7 after the resume
    assert sorted(disk[save_a]) == [1, 2, 3, 4] and disk[save_a][4].weights == 16.0
    assert disk[save_a][4].data_position == DataPosition(0, 8)
    # Slot 0's versions go on from where the first registration left them (never reused).
    assert t.pushes(0) == [(1, 0.0), (2, 4.0), (3, 8.0), (4, 12.0)]
    assert f"Adapter 'a' resumed from {save_a}/checkpoints/step_2 (step 2)" in caplog.text
    # The progress line counts to the step this registration ends at, not the first one's num_step.
    assert "a: step 3/4 " in caplog.text and "a: step 3/2" not in caplog.text
    assert [c for c in t.backend.calls if c[0] in ("load", "cleanup")] == [
        ("load", "a"), ("load", "b"), ("cleanup", "a"), ("cleanup", "b"), ("load", "a"), ("cleanup", "a")]


async def test_a_queued_adapter_is_active_in_the_iteration_that_frees_its_slot(tmp_path, monkeypatch):
    """One slot: 'b' waits in the registration queue while 'a' trains. The loop iteration whose
    reconcile frees a's slot also loads 'b' there and pushes it (ACTIVE) before it generates:
    0 iterations from the slot freeing to the queued adapter being ACTIVE."""
    t = Trainer(tmp_path, n_slots=1)
    await t.register("a", num_step=2)
    await t.register("b", num_step=1)
    assert (t.status("b").state, t.status("b").slot, t.status("b").queue_position) == (AdapterState.QUEUED, None, 1)
    backend = t.controller.backend
    events: list[tuple[str, str, int]] = []  # (what, adapter, generate calls so far)
    apply = backend.apply

    async def apply_and_note(op):
        result = await apply(op)
        if isinstance(op, FreeSlots):
            events.extend(("freed", n, t.rollout.snapshots_given) for n, slot in zip(op.names, result) if slot >= 0)
        if isinstance(op, RecordWeightUpdate):
            events.extend(("active", n, t.rollout.snapshots_given) for n in op.names
                          if backend.registry.state(n) is AdapterState.ACTIVE)
        return result

    monkeypatch.setattr(backend, "apply", apply_and_note)
    await t.run_until_idle()

    freed = next(generated for what, name, generated in events if (what, name) == ("freed", "a"))
    active = next(generated for what, name, generated in events if (what, name) == ("active", "b"))
    assert (freed, active - freed) == (2, 0)  # a trained 2 batches; b ACTIVE before the next generate
    b = t.status("b")
    assert (b.state, b.slot, b.step) == (AdapterState.COMPLETED, 0, 1)
    assert [c for c in t.backend.calls if c[0] in ("load", "cleanup")] == [
        ("load", "a"), ("cleanup", "a"), ("load", "b"), ("cleanup", "b")]


async def test_a_new_trainer_resumes_from_the_disk_and_saves_at_shutdown(tmp_path):
    first = Trainer(tmp_path)
    await first.register("a", num_step=5)
    s = first.stages
    snapshot = await s.push.update_weights(await s.slots.reconcile(first.snapshot()))
    for rollout_id in range(2):
        batch = await first.rollout.generate(rollout_id, snapshot)
        await s.train.train(rollout_id, batch)
        snapshot = await s.train.commit(rollout_id)
        assert await s.slots.save(snapshot) == ["a"]
    assert snapshot.active["a"].step == 2
    assert await s.slots.save_all() == []  # saved on its cadence already
    # Between two saves: no periodic save at step 3, so the shutdown save writes it.
    s.slots.save_interval = 10
    batch = await first.rollout.generate(2, snapshot)
    await s.train.train(2, batch)
    await s.train.commit(2)
    assert await s.slots.save_all() == ["a"]
    save_a = str(tmp_path / "save" / "adapters" / "a")
    assert first.backend.disk[save_a][3].data_position == DataPosition(0, 6)

    second = Trainer(tmp_path, disk=first.backend.disk)
    await second.register("a", num_step=1)
    snapshot = await second.stages.slots.reconcile(second.snapshot())
    assert snapshot.pending["a"].step == 3 and second.snapshot().pending["a"].step == 3
    assert snapshot.pending["a"].final_step == 4
    assert second.backend.weights["a"] == 12.0
    assert second.rollout.restores[0][2] == DataPosition(0, 6)


async def test_a_restored_step_without_a_checkpoint_follows_the_weights(tmp_path):
    trainer = Trainer(tmp_path)  # its backend's disk is empty: no checkpoint of "a"
    await trainer.register("a", num_step=5)
    trainer.controller.backend.apply_now(SetStep("a", 3))  # what a registry restored from --save may hold
    snapshot = await trainer.stages.slots.reconcile(trainer.snapshot())
    assert snapshot.pending["a"].step == 0 and trainer.snapshot().pending["a"].step == 0


async def test_adapter_named_like_the_loop_metrics_gets_its_own_records(tmp_path):
    t = Trainer(tmp_path)
    await t.register("perf", num_step=1)
    await t.run_until_idle()
    t.metrics.close()
    records = read_metrics(t.metrics.path)
    loop = [r for r in records if r["kind"] == "loop"]
    adapter = [r for r in records if r["kind"] == "adapter"]
    assert loop and adapter
    assert all(r["adapter"] == "perf" and r["step"] == 1 for r in adapter)
    assert {"raw_reward_mean", "loss", "grad_norm", "lr"} <= set(adapter[0]["metrics"])
    # The loop's records hold the loop's metrics only: none of the adapter's.
    assert not any(key.startswith(("perf/raw_reward", "perf/loss", "perf/grad_norm"))
                   for r in loop for key in r["metrics"])
    assert {"perf/train_time", "perf/generate_time", "perf/commit_time"} <= set(loop[0]["metrics"])


async def test_iterations_of_client_work_alone_keep_their_times_and_record_each_client_step(tmp_path):
    """A Tinker client's model trains while no RL adapter is sampleable: each of its
    optim_steps has its adapter record, and those iterations write no loop record and leave
    no time behind: the RL batch trained later carries only its own stage times."""
    t = Trainer(tmp_path)
    gateway = t.controller.gateway
    session = gateway.sessions.create(SessionInfo())
    created = gateway.create_model(session, 0, "base", LoraLayout(rank=4, train_unembed=False), {})
    model, model_id = created.model, created.model_id
    assert model is not None and model_id is not None
    datum = ClientDatum(tokens=[5, 6, 7], inputs={"target_tokens": [6, 7, 5]})
    gateway.submit(model_id, 1, ClientCommandKind.FORWARD,  # no gradient: not in the step's numbers
                   lambda: ForwardCommand([datum], ClientLoss("cross_entropy")))
    for seq_id in (2, 4):
        gateway.submit(model_id, seq_id, ClientCommandKind.FORWARD_BACKWARD,
                       lambda: ForwardCommand([datum, datum], ClientLoss("cross_entropy")))
        gateway.submit(model_id, seq_id + 1, ClientCommandKind.OPTIM_STEP,
                       lambda: OptimStepCommand(AdamStep(learning_rate=0.5)))
    stop = asyncio.Event()
    loop = asyncio.create_task(train_multi_lora_async.run_loop(MilesConfig(multi_lora_n_adapters=2),
                                                               t.components, stop, t.progress))
    try:
        await wait_until_async(lambda: t.status(model).step == 2, 30, "the client model's two optim_steps")
        await t.register("a", num_step=2)
        await wait_until_async(lambda: t.status("a").state is AdapterState.COMPLETED, 30, "the RL adapter's run")
    finally:
        stop.set()
        await loop
    t.metrics.close()
    records = read_metrics(t.metrics.path)
    client = [r for r in records if r["kind"] == "adapter" and r["adapter"] == model]
    assert [(r["adapter_kind"], r["step"]) for r in client] == [("client", 1), ("client", 2)]
    # The fake backend's loss of a datum is its token count: 2 datums of 3 tokens per step.
    assert all((r["metrics"]["loss:sum"], r["metrics"]["train_datums"], r["metrics"]["train_tokens"],
                r["metrics"]["lr"]) == (6.0, 2.0, 6.0, 0.5) for r in client)
    assert {r["adapter_kind"] for r in records if r["kind"] == "adapter" and r["adapter"] == "a"} == {"server"}
    loop_records = [r["metrics"] for r in records if r["kind"] == "loop"]
    assert len(loop_records) == 2  # the RL adapter's two batches; the clients' iterations have none
    assert not any("perf/client_time" in m for m in loop_records), loop_records


async def test_loop_records_time_the_whole_iteration_and_push_only_what_stepped(tmp_path):
    t = Trainer(tmp_path)
    await t.register("a", num_step=3)
    await t.register("b", num_step=3)
    await t.run_until_idle()
    t.metrics.close()
    loop = [r["metrics"] for r in read_metrics(t.metrics.path) if r["kind"] == "loop"]
    assert [m["perf/stepped_adapters"] for m in loop] == [2.0, 2.0, 2.0]
    # The first push loads both; each later one re-sends exactly the adapters the previous batch stepped
    # (after the third step both retire: nothing more is pushed).
    assert [m.get("perf/push_adapters") for m in loop] == [2.0, 2.0, 2.0]
    assert len(t.receiver.pushes) == 6
    for m in loop:
        stages = sum(v for k, v in m.items()
                     if k.endswith("_time") and k not in ("perf/iteration_time", "perf/push_time"))
        assert m["perf/iteration_time"] >= stages > 0
        assert m["perf/push_time"] <= m["perf/update_weights_time"]


async def test_a_new_adapter_is_pushed_and_active_before_the_stepped_ones_are_pushed(tmp_path):
    t = Trainer(tmp_path, n_slots=2)
    s = t.stages
    await t.register("a", num_step=5)
    snapshot = await s.push.update_weights(await s.slots.reconcile(t.snapshot()))
    await s.train.train(0, await t.rollout.generate(0, snapshot))
    await s.train.commit(0)  # a stepped: stale
    await t.register("b", num_step=5)
    states_at_push = []
    push = t.receiver.push

    async def recording_push(pushes):
        states_at_push.append((pushes[0][0], t.status("b").state))
        return await push(pushes)

    t.receiver.push = recording_push
    snapshot = await s.push.update_weights(await s.slots.reconcile(t.snapshot()))
    assert snapshot == t.snapshot() and set(snapshot.active) == {"a", "b"}
    # b (slot 1) alone first, then a (slot 0), by which time b is already ACTIVE.
    assert states_at_push == [(1, AdapterState.PENDING), (0, AdapterState.ACTIVE)]
    assert s.push.pop_push_metrics()["perf/push_adapters"] == 3.0  # a's first push, then b, then a


async def _stepped_once_with_the_push_behind(tmp_path) -> Trainer:
    """Adapter "a" pushed (ACTIVE) and stepped once, with `overlap_push`."""
    t = Trainer(tmp_path, n_slots=1, overlap_push=True)
    s = t.stages
    await t.register("a", num_step=5)
    snapshot = await s.push.update_weights(await s.slots.reconcile(t.snapshot()))
    assert snapshot == t.snapshot() and "a" in snapshot.active  # a first push is never behind the loop
    await s.train.train(0, await t.rollout.generate(0, snapshot))
    await s.train.commit(0)
    return t


def _held(call, gate: asyncio.Event):
    """`call` that first waits for `gate`."""

    async def held(*args):
        await gate.wait()
        return await call(*args)

    return held


async def test_an_overlapped_push_runs_behind_the_next_train_call_with_the_exported_weights(tmp_path):
    t = await _stepped_once_with_the_push_behind(tmp_path)
    s = t.stages
    served = t.snapshot().active["a"].version
    exported = t.backend.weights["a"]
    gate = asyncio.Event()
    t.receiver.push = _held(t.receiver.push, gate)
    snapshot = await s.push.update_weights(t.snapshot())
    # Back with the push held: the engines serve the old version, the registry names the one
    # under way (staleness counts against the trainer's weights).
    assert snapshot == t.snapshot()
    assert snapshot.active["a"].version == served
    assert snapshot.active["a"].pushing_version == snapshot.active["a"].trainer_version == next_slot_version(served)
    await s.train.train(1, await t.rollout.generate(1, snapshot))
    await s.train.commit(1)
    assert t.backend.weights["a"] != exported  # the train call ran while the push was held
    gate.set()
    settled = await s.push.settle(t.snapshot())
    assert settled == t.snapshot() and settled.active["a"].version == next_slot_version(served)
    assert settled.active["a"].pushing_version is None
    assert t.pushes(0)[-1] == (next_slot_version(served), exported)  # the weights as exported

    async def failing_push(pushes):
        raise RuntimeError("engine push failed")

    t.receiver.push = failing_push
    await s.push.update_weights(t.snapshot())  # a stepped again: its push fails behind the loop
    with pytest.raises(RuntimeError, match="engine push failed"):
        await s.push.settle()
    assert await s.push.settle() is None  # raised once; nothing left behind the loop


async def test_the_next_train_call_waits_for_the_export_behind_the_loop(tmp_path):
    """The stage returns before the stepped adapters are exported; a train call started
    meanwhile holds until the export is done, so the push carries the weights the snapshot
    names, not the ones that train call makes."""
    t = await _stepped_once_with_the_push_behind(tmp_path)
    s = t.stages
    before_train = t.backend.weights["a"]
    gate = asyncio.Event()
    t.backend.export_adapter = _held(t.backend.export_adapter, gate)
    mark = len(t.backend.calls)
    snapshot = await s.push.update_weights(t.snapshot())  # returns with the export held
    train = asyncio.create_task(s.train.train(1, await t.rollout.generate(1, snapshot)))
    # The export is released only once train 1 is under way; had the train call not waited
    # for it, the backend would have trained before it exported.
    gate.set()
    await train
    calls = [c for c in t.backend.calls[mark:] if c in (("export", "a"), ("train", "1"))]
    assert calls == [("export", "a"), ("train", "1")]
    assert t.backend.weights["a"] != before_train
    await s.train.commit(1)
    await s.push.settle(t.snapshot())
    assert t.pushes(0)[-1][1] == before_train  # the weights as they were before train 1


async def test_the_loop_pushes_and_steps_the_same_with_the_push_behind_it(tmp_path):
    runs = {}
    for overlap in (False, True):
        (tmp_path / str(overlap)).mkdir()
        t = Trainer(tmp_path / str(overlap), overlap_push=overlap)
        await t.register("a", num_step=3)
        await t.register("b", num_step=4)
        await t.run_until_idle()
        t.metrics.close()
        loop = [r["metrics"] for r in read_metrics(t.metrics.path) if r["kind"] == "loop"]
        saved = {Path(save_dir).name: steps for save_dir, steps in t.backend.disk.items()}
        runs[overlap] = (t.receiver.pushes, [t.status(n).step for n in "ab"], saved,
                         [m.get("perf/push_adapters") for m in loop])
        assert all("perf/push_wait_time" in m for m in loop)
    assert runs[True] == runs[False]


class BlockingRollout(FakeRollout):
    """Rollout 0 comes at once; later ones start, then wait until cancelled (and say so)."""

    cancelled: bool = False
    started: asyncio.Event

    async def generate(self, rollout_id, snapshot=None):
        if rollout_id == 0:
            return await super().generate(rollout_id, snapshot)
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_train_async_cancels_and_awaits_its_prefetch_when_training_fails(tmp_path):
    t = Trainer(tmp_path, n_slots=1)
    t.rollout = BlockingRollout(t.rollout.controller)
    t.rollout.started = t.backend.train_gate = asyncio.Event()  # train fails once the prefetch runs
    t.components.rollout_manager = InProcessHandle(t.rollout)
    t.stages.slots.rollout_manager = InProcessHandle(t.rollout)
    await t.register(train_async.POLICY, num_step=train_async.NEVER_RETIRE)
    t.backend.fail_train = True
    cfg = MilesConfig(multi_lora_n_adapters=1, num_rollout=5)
    with pytest.raises(RuntimeError, match="training rollout 0 failed"):
        await train_async.run_loop(cfg, t.components, asyncio.Event(), t.progress)
    assert t.rollout.cancelled  # the prefetch of rollout 1 was cancelled, and awaited before the error surfaced
    assert t.status(train_async.POLICY).step == 0  # nothing committed for a batch that did not train


async def test_each_stage_returns_the_registrys_own_snapshot(tmp_path):
    """The driver passes the snapshot down instead of re-reading it: every call that changes
    the registry answers with the registry's snapshot after it, so it is exact."""
    t = Trainer(tmp_path, n_slots=3)
    s = t.stages
    await t.register("a", num_step=1)
    await t.register("b", num_step=5)
    await t.register("c", num_step=5)
    snapshot = await s.slots.reconcile(t.snapshot())
    assert snapshot == t.snapshot() and sorted(s.slots.loaded) == ["a", "b", "c"]
    snapshot = await s.push.update_weights(snapshot)
    assert snapshot == t.snapshot() and set(snapshot.active) == {"a", "b", "c"}
    await s.train.train(0, await t.rollout.generate(0, snapshot))
    snapshot = await s.train.commit(0)
    assert snapshot == t.snapshot() and set(snapshot.retiring) == {"a"}  # reached num_step
    t.controller.backend.deregister("c")
    snapshot = await s.slots.reconcile(t.snapshot())  # retires a and c, saves, frees both slots
    assert snapshot == t.snapshot() and snapshot.completed == {"a", "c"} and sorted(s.slots.loaded) == ["b"]
    await t.register("a", num_step=2)  # the lowest free slot again, resumed from step 1
    snapshot = await s.push.update_weights(await s.slots.reconcile(t.snapshot()))
    assert snapshot == t.snapshot()
    assert (snapshot.active["a"].step, snapshot.active["a"].start_step, snapshot.active["a"].final_step) == (1, 1, 3)
    assert snapshot.active["a"].version == 2  # slot 0 was pushed once before


class ClientDriver:
    """One Tinker model on a `Trainer`, driven command by command through the real stages:
    `reconcile` (which pages idle models out) and `run_alone` (which runs what is logged)."""

    def __init__(self, t: Trainer, idle_evict_s: float = 0.0) -> None:
        self.t, self.now, self.seq_id, self.rollout = t, 1000.0, 1, 0
        t.stages.slots.idle_evict_s = idle_evict_s
        self.gateway = t.controller.gateway
        self.gateway.clock = lambda: self.now
        self.session = self.gateway.sessions.create(SessionInfo())
        created = self.gateway.create_model(self.session, 0, "base", LoraLayout(rank=4, train_unembed=False), {})
        assert created.model is not None and created.model_id is not None
        self.model, self.model_id = created.model, created.model_id

    def submit(self, kind: ClientCommandKind):
        datum = ClientDatum(tokens=[5, 6, 7], inputs={"target_tokens": [6, 7, 5]})
        build = ((lambda: OptimStepCommand(AdamStep(learning_rate=0.5))) if kind is ClientCommandKind.OPTIM_STEP
                 else (lambda: ForwardCommand([datum, datum], ClientLoss("cross_entropy"))))
        future = self.gateway.submit(self.model_id, self.seq_id, kind, build)
        self.seq_id += 1
        return future

    async def reconcile(self, after_s: float = 0.0) -> None:
        self.now += after_s
        self.gateway.sessions.heartbeat(self.session)  # the SDK's heartbeats go on while the model is idle
        await self.t.stages.slots.reconcile(self.t.snapshot())

    async def run(self) -> None:
        """Load what is due, then run every logged command of the model."""
        await self.reconcile()
        while self.gateway.log.busy(self.model):
            assert await self.t.stages.clients.run_alone(self.rollout, self.t.stages.train)
            self.rollout += 1

    def result(self, future):
        return self.gateway.log.get(future.future_id).result


async def test_an_idle_client_model_is_paged_out_and_its_next_command_pages_it_back_in_exactly(tmp_path):
    """Idle for --multi-lora-idle-evict-s with nothing in flight: its state (weights, pending
    gradient) goes to {save}/paged and its slot to whoever needs it; its next command is refused
    retryably while no slot is free, then pages it in, and it goes on as a model never paged out."""
    from miles.controller.tinker.errors import GatewayBusyError

    for sub in ("kept", "paged"):
        (tmp_path / sub).mkdir()
    kept, paged = ClientDriver(Trainer(tmp_path / "kept", n_slots=1)), \
        ClientDriver(Trainer(tmp_path / "paged", n_slots=1), idle_evict_s=60)
    for d in (kept, paged):
        d.submit(ClientCommandKind.FORWARD_BACKWARD)
        await d.run()
    t, model = paged.t, paged.model
    await paged.reconcile(after_s=59)
    assert t.status(model).state is AdapterState.ACTIVE  # not idle long enough yet
    pending = paged.submit(ClientCommandKind.FORWARD_BACKWARD)
    await paged.reconcile(after_s=3600)
    assert t.status(model).state is AdapterState.ACTIVE  # a command in flight: never paged out
    await paged.run()
    kept.submit(ClientCommandKind.FORWARD_BACKWARD)
    await kept.run()
    assert paged.result(pending) == kept.result(kept.gateway.log.commands(kept.model)[-1])

    await paged.reconcile(after_s=60)
    status = t.status(model)
    assert (status.state, status.slot, status.version) == (AdapterState.PAGED, None, None)
    assert t.backend.slots == {} and t.controller.backend.registry.free_slots == [0]
    directory = str(tmp_path / "paged" / "save" / "adapters" / model / "paged")
    assert t.backend.client_disk[directory] == (0.0, 4)  # its weights and the gradient of 4 datums not stepped
    assert t.snapshot().clients == {}  # the trainer neither loads nor runs it

    await t.register("a")  # the freed slot serves an RL adapter
    logged = len(paged.gateway.log.commands(model))
    with pytest.raises(GatewayBusyError, match="no slot is free to page it back in") as refused:
        paged.submit(ClientCommandKind.OPTIM_STEP)
    assert refused.value.status == 429 and refused.value.retryable
    assert len(paged.gateway.log.commands(model)) == logged and t.status(model).state is AdapterState.PAGED
    t.controller.backend.deregister("a")
    await paged.reconcile()  # "a" retires: its slot is free again
    # the client sends the refused call again (at the same seq_id)
    for d in (kept, paged):
        d.submit(ClientCommandKind.OPTIM_STEP)
        d.submit(ClientCommandKind.FORWARD_BACKWARD)
    assert t.status(model).state is AdapterState.PENDING  # paged in by the command
    for d in (kept, paged):
        await d.run()
    assert ("load_client_state", model) in t.backend.calls
    assert t.status(model).state is AdapterState.ACTIVE and t.status(model).step == 1
    assert t.backend.weights[model] == kept.t.backend.weights[kept.model] == 2.0  # 4 datums at lr 0.5
    want, got = (d.gateway.log.commands(d.model)[-1] for d in (kept, paged))
    assert paged.result(got) == kept.result(want)
    assert t.backend.pending[model] == kept.t.backend.pending[kept.model] == 2


async def test_a_command_that_comes_while_its_model_is_paged_out_keeps_it_in_its_slot(tmp_path):
    """The page-out is checked again after the state is written: a command logged meanwhile keeps
    the model ACTIVE, loaded back exactly as it was, and the command runs."""
    d = ClientDriver(Trainer(tmp_path, n_slots=1), idle_evict_s=60)
    d.submit(ClientCommandKind.FORWARD_BACKWARD)
    await d.run()
    t = d.t
    save = t.backend.save_client_state
    late = []

    async def save_while_a_command_comes(name: str, directory: str, *, pending: bool = False):
        late.append(d.submit(ClientCommandKind.OPTIM_STEP))
        return await save(name, directory, pending=pending)

    t.backend.save_client_state = save_while_a_command_comes  # type: ignore[method-assign]
    await d.reconcile(after_s=600)
    assert late and t.status(d.model).state is AdapterState.ACTIVE and t.status(d.model).slot == 0
    assert t.backend.slots == {0: d.model} and t.backend.pending[d.model] == 2
    await d.run()
    assert t.status(d.model).step == 1 and t.backend.weights[d.model] == 1.0


async def test_a_page_out_that_cannot_be_written_keeps_the_model_in_its_slot(tmp_path, caplog):
    d = ClientDriver(Trainer(tmp_path, n_slots=1), idle_evict_s=60)
    d.submit(ClientCommandKind.FORWARD_BACKWARD)
    await d.run()

    async def full_disk(name: str, directory: str, *, pending: bool = False):
        raise OSError("No space left on device")

    d.t.backend.save_client_state = full_disk  # type: ignore[method-assign]
    await d.reconcile(after_s=600)
    assert d.t.status(d.model).state is AdapterState.ACTIVE and d.t.backend.slots == {0: d.model}
    assert d.t.backend.pending[d.model] == 2
    assert "could not be paged out (OSError: No space left on device); it keeps its slot" in caplog.text
