"""A registration that arrives while the loop generates or trains reaches the engines then.

Through the real `run_loop` over the lifecycle fakes (no Ray): a train call is held open
with the fake backend's gate while adapters register, leave or would resume.
"""

from __future__ import annotations

import asyncio

from miles.utils.types import AdapterState
from tests.helpers.in_process_trainer import Trainer
from tests.helpers.lifecycle_fakes import SavedAdapter
from tests.helpers.waiting import wait_until_async


async def _train_held_open(t: Trainer) -> tuple[asyncio.Task, asyncio.Event]:
    """Start the loop over adapter a and return once its first train call waits on the gate."""
    await t.register("a", num_step=2)
    gate = t.backend.train_gate = asyncio.Event()
    loop = asyncio.create_task(t.run_until_idle())
    await asyncio.wait_for(t.backend.training.wait(), 10)
    return loop, gate


async def test_a_registration_during_train_is_active_before_the_train_call_returns(tmp_path):
    t = Trainer(tmp_path)
    loop, gate = await _train_held_open(t)
    await t.register("b", num_step=2)
    await wait_until_async(lambda: t.status("b").state == AdapterState.ACTIVE, 10, "'b' to become ACTIVE")

    assert not gate.is_set() and ("load", "b") not in t.backend.calls  # the train call still runs
    assert ("fresh_export", "b") in t.backend.calls
    assert t.pushes(1) == [(1, 0.0)]  # slot 1, version 1, the fresh weights
    gate.set()
    await asyncio.wait_for(loop, 10)

    b = t.status("b")
    assert (b.state, b.step) == (AdapterState.COMPLETED, 2)
    assert t.backend.calls.count(("load", "b")) == 1  # loaded once, at the next reconcile
    assert [version for version, _ in t.pushes(1)].count(1) == 1  # and not pushed again before it stepped
    assert t.pushes(1)[1] == (2, 4.0)  # the next push carries its first step (4 samples)


async def test_an_adapter_that_would_resume_waits_for_the_reconcile(tmp_path):
    t = Trainer(tmp_path)
    t.backend.disk[str(tmp_path / "save" / "adapters" / "b")] = {3: SavedAdapter(weights=7.0, data_position=None)}
    loop, gate = await _train_held_open(t)
    await t.register("b", num_step=1)
    await wait_until_async(lambda: t.snapshot().pending.keys() == {"b"}, 10, "'b' to be registered, PENDING")
    gate.set()
    await asyncio.wait_for(loop, 10)

    assert ("fresh_export", "b") not in t.backend.calls
    assert t.pushes(1)[0] == (1, 7.0)  # its first push is the checkpoint's weights, after the load
    assert t.status("b").step == 4


async def test_an_adapter_that_leaves_before_its_load_is_unloaded_from_the_engines(tmp_path):
    t = Trainer(tmp_path)
    loop, gate = await _train_held_open(t)
    await t.register("b", num_step=5)
    await wait_until_async(lambda: t.status("b").state == AdapterState.ACTIVE, 10, "'b' to become ACTIVE")
    t.controller.backend.deregister("b")
    gate.set()
    await asyncio.wait_for(loop, 10)

    assert ("load", "b") not in t.backend.calls and ("cleanup", "b") not in t.backend.calls
    assert t.receiver.unloads.count(1) == 1  # slot 1 left the engines before it was freed
    assert t.status("b").state == AdapterState.COMPLETED
    await t.register("c", num_step=1)  # both slots are free again
    await t.register("d", num_step=1)
    assert {run.slot for run in t.snapshot().pending.values()} == {0, 1}
