"""The registry on disk: a backend reopened over the same SQLite file answers as before.

Every change the backend makes is written through in one transaction, so a controller
that restarts (a new process, or the actor restarted by Ray) rebuilds every adapter,
slot, slot version, step, start step, accumulated group count, registration id, batch
record and the completed records.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from miles.controller.backend import MultiLoRABackend
from miles.controller.registry import AdapterAlreadyRegisteredError, AdapterRegistry, NoFreeSlotError
from miles.controller.store import RegistryStore, RegistryStoreError
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.types import AdapterState, ClientModelConfig
from miles.utils.types.lifecycle_ops import (
    FailAdapter,
    FreeSlots,
    MarkBatchTrained,
    RecordBatch,
    RecordWeightUpdate,
    RequeueForNewTrainer,
    RetireAdapters,
    SetStep,
)
from tests.helpers.controller_fakes import ROLLOUT_HOOKS, write_dataset


def full_picture(backend: MultiLoRABackend) -> tuple:
    registry = backend.registry
    return (backend.snapshot(), [s.model_dump() for s in backend.statuses()], registry.free_slots,
            registry.slot_versions, registry.export_state())


def open_backend(path: Path, defaults: AdapterDefaults, n_slots: int = 4) -> MultiLoRABackend:
    return MultiLoRABackend(n_slots, defaults, hooks=ROLLOUT_HOOKS, store=RegistryStore(path))


async def drive_through_every_state(backend: MultiLoRABackend, data: str) -> None:
    """Adapters left in PENDING, ACTIVE (stepped, mid-accumulation), RETIRING, CLEANUP and
    COMPLETED, a re-registered name, and one batch recorded but not trained."""
    for name in ["a", "b", "c", "d"]:
        await backend.register(name, config={"data": data, "rollout_batch_size": 2, "num_step": 100})
    backend.apply_now(RecordWeightUpdate(["a", "b", "c"]))
    backend.apply_now(SetStep("a", 3))
    backend.apply_now(RecordBatch(0, {"a": 2, "b": 1}, ["a"]))
    assert backend.apply_now(MarkBatchTrained(0)) == ["a"]
    backend.apply_now(RecordBatch(1, {"a": 1, "b": 1}, []))
    backend.apply_now(MarkBatchTrained(1))
    backend.apply_now(RecordBatch(2, {"a": 1}, ["a"]))  # recorded, not yet trained
    backend.deregister("b")
    assert await backend.apply(RetireAdapters()) == ["b"]
    assert await backend.apply(FreeSlots(["b"])) == [1]
    await backend.register("b", config={"data": data, "num_step": 5})  # a new registration of the name
    backend.deregister("c")
    backend.deregister("d")
    assert await backend.apply(RetireAdapters()) == ["c", "d"]
    assert await backend.apply(FreeSlots(["d"])) == [3]
    backend.apply_now(RecordWeightUpdate(["b"]))
    backend.deregister("b")  # RETIRING


async def test_reopened_backend_has_the_identical_registry(tmp_path: Path, defaults: AdapterDefaults,
                                                           data_root: Path) -> None:
    path = tmp_path / "controller" / "registry.sqlite"
    backend = open_backend(path, defaults)
    await drive_through_every_state(backend, str(data_root / "data" / "train.jsonl"))
    before = full_picture(backend)
    states = {s.name: s.state for s in backend.statuses()}
    assert states == {"a": AdapterState.ACTIVE, "b": AdapterState.RETIRING, "c": AdapterState.CLEANUP,
                      "d": AdapterState.COMPLETED}
    backend.store.close()

    reopened = open_backend(path, defaults)
    assert full_picture(reopened) == before
    assert reopened.adapter_status("a").step == 4 and reopened.adapter_status("a").accumulated_groups == 1

    # It carries on where the first left off: the recorded batch commits, versions keep rising.
    assert reopened.apply_now(MarkBatchTrained(2)) == ["a"]
    assert reopened.apply_now(RecordWeightUpdate(["a"])) == {"a": before[3][0] + 1}
    with pytest.raises(AdapterAlreadyRegisteredError, match="already registered"):
        await reopened.register("a", config={"data": str(data_root / "data" / "train.jsonl")})


async def test_a_new_trainer_completes_what_the_previous_one_left_retiring(
        tmp_path: Path, defaults: AdapterDefaults, data_root: Path) -> None:
    """A new trainer never loads a RETIRING or CLEANUP adapter of the restored registry, so their
    slots are free as soon as it starts, not only after its engines are up and its first reconcile
    ran: a Tinker model unloaded just before the previous trainer stopped (its client's session
    closed) does not make the next client's `create_model` fail with no free slot."""
    path = tmp_path / "controller" / "registry.sqlite"
    first = open_backend(path, defaults)
    await drive_through_every_state(first, str(data_root / "data" / "train.jsonl"))  # b RETIRING, c CLEANUP
    def model_config(session: str) -> ClientModelConfig:
        return ClientModelConfig(model_id=f"{session}:train:0", session_id=session, base_model="tiny", rank=4,
                                 alpha=8.0, seed=3, save=tmp_path / "adapters" / f"{session}.train.0")

    model = model_config("s-1")
    assert first.register_client("s-1.train.0", model) == 3
    first.deregister("s-1.train.0")  # its session closed, then the trainer stopped
    first.store.close()

    restored = open_backend(path, defaults)
    with pytest.raises(NoFreeSlotError):  # until the new trainer starts, the slots stay taken
        restored.register_client("s-2.train.0", model_config("s-2"))
    assert restored.apply_now(RequeueForNewTrainer()) == ["a"]
    states = {s.name: s.state for s in restored.statuses()}
    assert states == {"a": AdapterState.PENDING, "b": AdapterState.COMPLETED, "c": AdapterState.COMPLETED,
                      "d": AdapterState.COMPLETED, "s-1.train.0": AdapterState.COMPLETED}
    assert restored.registry.free_slots == [1, 2, 3]
    assert restored.registry.client_config("s-1.train.0") == model  # kept with the completed record
    assert restored.register_client("s-2.train.0", model_config("s-2")) == 1
    assert full_picture(open_backend(path, defaults)) == full_picture(restored)


async def test_every_change_is_on_disk_before_the_call_returns(tmp_path: Path, defaults: AdapterDefaults,
                                                               data_root: Path) -> None:
    """Read with a second connection after each change (no close, no flush in between)."""
    path = tmp_path / "registry.sqlite"
    backend = open_backend(path, defaults)
    data = str(data_root / "data" / "train.jsonl")

    def on_disk() -> AdapterRegistry:
        return AdapterRegistry.from_state(RegistryStore(path).load(), 4)

    await backend.register("a", config={"data": data})
    assert on_disk().snapshot() == backend.snapshot()
    backend.apply_now(RecordWeightUpdate(["a"]))
    assert on_disk().slot_versions == [1, 0, 0, 0]
    backend.apply_now(RecordBatch(7, {"a": 4}, ["a"]))
    backend.apply_now(MarkBatchTrained(7))
    assert on_disk().step("a") == 1
    backend.deregister("a")
    assert on_disk().state("a") is AdapterState.RETIRING
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_rejected_registration_writes_nothing(tmp_path: Path, defaults: AdapterDefaults,
                                                    data_root: Path) -> None:
    path = tmp_path / "registry.sqlite"
    backend = open_backend(path, defaults)
    await backend.register("a", config={"data": str(data_root / "data" / "train.jsonl")})
    with sqlite3.connect(path) as db:
        rows_before = db.execute("SELECT name, record FROM adapters").fetchall()
    with pytest.raises(ValueError):
        await backend.register("b", config={"data": str(data_root / "missing.jsonl")})
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT name, record FROM adapters").fetchall() == rows_before


def test_completed_records_keep_their_order_and_retention(tmp_path: Path, defaults: AdapterDefaults) -> None:
    from tests.helpers.controller_fakes import make_config

    registry = AdapterRegistry(n_slots=1, completed_retention=3)
    for i in range(5):
        name = f"r{i}"
        registry.register(name, make_config(name))
        registry.deregister(name)
        registry.retire_adapters()
        registry.free_slot(name)
    store = RegistryStore(tmp_path / "r.sqlite")
    store.save(registry.export_state())
    restored = AdapterRegistry.from_state(RegistryStore(tmp_path / "r.sqlite").load(), 1, completed_retention=3)
    assert list(restored.snapshot().completed) == list(registry.snapshot().completed)
    assert [s.name for s in restored.statuses()] == ["r2", "r3", "r4"]


def test_fewer_slots_than_a_live_adapter_holds_is_a_clear_error(tmp_path: Path) -> None:
    from tests.helpers.controller_fakes import make_config

    registry = AdapterRegistry(n_slots=4)
    for name in "abc":
        registry.register(name, make_config(name))
    store = RegistryStore(tmp_path / "r.sqlite")
    store.save(registry.export_state())
    with pytest.raises(ValueError, match=r"start with at least 3 slots"):
        AdapterRegistry.from_state(store.load(), 2)
    grown = AdapterRegistry.from_state(store.load(), 6)  # more slots is fine
    assert grown.free_slots == [3, 4, 5]


def test_a_file_that_is_not_a_registry_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "registry.sqlite"
    bad.write_bytes(b"not a database at all" * 100)
    with pytest.raises(RegistryStoreError, match="move it away"):
        RegistryStore(bad)


async def test_restarted_trainer_keeps_the_start_step_of_a_running_adapter(
        tmp_path: Path, defaults: AdapterDefaults, data_root: Path) -> None:
    """A trainer restarted over the saved registry reloads an ACTIVE adapter from its
    checkpoint: its step goes back to the checkpoint's, `num_step` still counts from where
    the registration began, and groups accumulated toward the lost step are dropped."""
    data = str(write_dataset(data_root / "data" / "steps.jsonl", rows=40))
    backend = open_backend(tmp_path / "r.sqlite", defaults)
    await backend.register("a", config={"data": data, "num_step": 6, "rollout_batch_size": 1})
    backend.apply_now(SetStep("a", 2))  # resumed from a step-2 checkpoint before its first push
    backend.apply_now(RecordWeightUpdate(["a"]))
    for rollout_id in range(3):
        backend.apply_now(RecordBatch(rollout_id, {"a": 1}, ["a"]))
        backend.apply_now(MarkBatchTrained(rollout_id))
    backend.apply_now(RecordBatch(3, {"a": 1}, []))
    backend.apply_now(MarkBatchTrained(3))
    assert (backend.adapter_status("a").step, backend.adapter_status("a").accumulated_groups) == (5, 1)

    reopened = open_backend(tmp_path / "r.sqlite", defaults)
    reopened.apply_now(SetStep("a", 4))  # its latest checkpoint
    run = reopened.snapshot().active["a"]
    assert (run.step, run.start_step, run.accumulated_groups, run.final_step) == (4, 2, 0, 8)


async def test_a_new_trainer_over_a_restored_registry_pushes_before_anything_is_sampled(
        tmp_path: Path, defaults: AdapterDefaults, data_root: Path) -> None:
    path = tmp_path / "controller" / "registry.sqlite"
    data = str(write_dataset(data_root / "rows.jsonl", 20))
    first = open_backend(path, defaults)
    await first.register("a", config={"data": data, "rollout_batch_size": 2, "num_step": 100})
    first.apply_now(SetStep("a", 4))  # resumed before its first push: num_step counts from 4
    first.apply_now(RecordWeightUpdate(["a"]))
    first.apply_now(RecordBatch(0, {"a": 2}, ["a"]))
    first.apply_now(MarkBatchTrained(0))
    assert first.snapshot().active["a"].step == 5

    restored = open_backend(path, defaults)  # the trainer crashed and starts again
    assert restored.apply_now(RequeueForNewTrainer()) == ["a"]
    snapshot = restored.snapshot()
    assert "a" in snapshot.pending and not snapshot.sampleable
    restored.apply_now(SetStep("a", 5))  # the new trainer resumes the checkpoint of step 5
    run = restored.snapshot().pending["a"]
    assert (run.step, run.start_step) == (5, 4)  # num_step still counts from the registration's start
    restored.apply_now(RecordWeightUpdate(["a"]))
    assert "a" in restored.snapshot().active
    assert open_backend(path, defaults).snapshot() == restored.snapshot()


async def test_a_failed_adapter_is_aborted_and_stays_failed_with_its_error_after_a_reopen(
        tmp_path: Path, defaults: AdapterDefaults, data_root: Path) -> None:
    from miles.utils.types import AdapterFailure

    aborted: list[tuple[str, str]] = []

    async def abort(router_url: str, prefix: str) -> list[str]:
        aborted.append((router_url, prefix))
        return [router_url]

    path = tmp_path / "registry.sqlite"
    hooks = dataclasses.replace(ROLLOUT_HOOKS, abort_prefix=abort)
    backend = MultiLoRABackend(2, defaults, "http://router", hooks, store=RegistryStore(path))
    await backend.register("bad", config={"data": str(data_root / "data" / "train.jsonl")})
    backend.apply_now(RecordWeightUpdate(["bad"]))
    registration = backend.adapter_status("bad").registration_id
    failure = AdapterFailure.from_exception(ZeroDivisionError("x" * 5000), groups=8)
    assert await backend.apply(FailAdapter("bad", registration, failure))
    assert aborted == [("http://router", "bad::")]
    assert not await backend.apply(FailAdapter("bad", registration, failure))  # once only
    assert await backend.apply(FreeSlots(["bad"])) == [0]
    backend.store.close()

    reopened = open_backend(path, defaults, n_slots=2)
    status = reopened.adapter_status("bad")
    assert status.state is AdapterState.FAILED and status.last_error == failure
    assert status.last_error.error_type == "ZeroDivisionError" and len(status.last_error.message) == 1000
    assert reopened.apply_now(RequeueForNewTrainer()) == [] and reopened.snapshot().failed == {"bad"}
    await reopened.register("bad", config={"data": str(data_root / "data" / "train.jsonl")})
    assert reopened.adapter_status("bad").state is AdapterState.PENDING


async def test_the_registration_queue_is_on_disk_in_its_order_after_every_change(
        tmp_path: Path, defaults: AdapterDefaults, data_root: Path) -> None:
    path = tmp_path / "controller" / "registry.sqlite"
    backend = open_backend(path, defaults, n_slots=1)
    data = str(data_root / "data" / "train.jsonl")

    def on_disk() -> AdapterRegistry:
        return AdapterRegistry.from_state(RegistryStore(path).load(), 1)

    assert await backend.register("a", config={"data": data}) == 0
    for name, priority in [("q1", 0), ("q2", 0), ("urgent", 2), ("q3", 0)]:
        assert await backend.register(name, config={"data": data}, priority=priority) is None
    assert on_disk().snapshot().queued == ("urgent", "q1", "q2", "q3")
    assert backend.deregister("q2") is None  # out of the queue: its row goes
    assert on_disk().snapshot().queued == ("urgent", "q1", "q3") and on_disk().state("q2") is None
    before = full_picture(backend)
    backend.store.close()

    reopened = open_backend(path, defaults, n_slots=1)
    assert full_picture(reopened) == before
    assert reopened.adapter_status("urgent").priority == 2
    # A slot that frees is taken by the head of the queue in the same write.
    reopened.apply_now(RecordWeightUpdate(["a"]))
    reopened.deregister("a")
    await reopened.apply(RetireAdapters())
    assert await reopened.apply(FreeSlots(["a"])) == [0]
    disk = on_disk()
    assert (disk.state("a"), disk.state("urgent"), disk.snapshot().queued) == (
        AdapterState.COMPLETED, AdapterState.PENDING, ("q1", "q3"))
    assert disk.snapshot() == reopened.snapshot()


def test_a_change_rewrites_only_its_own_rows_however_many_records_are_kept(tmp_path: Path) -> None:
    """Written through (`write_through`: the registry names what changed), a registration,
    an adapter finishing, one dropped past the retention and a finished record read (moved to
    the end of the retention order) each write a row or two, not every record kept; the file
    read back is the registry, the queue's and the retention's order included."""
    from tests.helpers.controller_fakes import make_config

    registry = AdapterRegistry(n_slots=2, completed_retention=150)
    store = RegistryStore(tmp_path / "r.sqlite")

    def retire(name: str) -> None:
        registry.deregister(name)
        registry.retire_adapters()
        registry.free_slot(name)

    for i in range(150):
        registry.register(f"done{i}", make_config(f"done{i}"))
        retire(f"done{i}")
    store.write_through(registry)  # the first write of a registry: every row

    def rows_written(change: Callable[[], object]) -> int:
        before = store._db.total_changes
        change()
        store.write_through(registry)
        return store._db.total_changes - before

    def read_back() -> AdapterRegistry:
        return AdapterRegistry.from_state(RegistryStore(tmp_path / "r.sqlite").load(), 2, completed_retention=150)

    assert rows_written(lambda: registry.register("live", make_config("live"))) == 1
    assert rows_written(lambda: registry.register("other", make_config("other"))) == 1
    assert rows_written(lambda: registry.register("q1", make_config("q1"))) == 1  # QUEUED
    assert rows_written(lambda: registry.register("q2", make_config("q2"))) == 1
    assert rows_written(lambda: registry.status("done3")) == 1  # kept longer: moved to the end
    assert rows_written(lambda: registry.status("done3")) == 0  # already the last one
    assert rows_written(lambda: retire("live")) <= 4  # live COMPLETED, done0 dropped, q1 takes the slot
    assert rows_written(lambda: retire("other")) <= 4
    assert rows_written(lambda: registry.deregister("q2")) == 1  # q2 took other's slot; RETIRING now
    restored = read_back()
    assert restored.export_state() == registry.export_state()
    finished = [s.name for s in restored.statuses() if s.state is AdapterState.COMPLETED]
    assert finished[-3:] == ["done3", "live", "other"] and "done0" not in finished and len(finished) == 150
    assert [s.name for s in restored.statuses() if s.state.holds_slot] == ["q1", "q2"]

    registry.register("q3", make_config("q3"))
    registry.register("q4", make_config("q4"))
    assert rows_written(lambda: registry.deregister("q3")) == 1  # out of the queue: its row deleted
    assert read_back().export_state() == registry.export_state()


def test_the_stored_form_follows_a_push_of_a_retiring_adapter() -> None:
    """A record's stored form is cached while the record is unchanged; a change of any field
    (here `pushed`, by a push that reaches an adapter already RETIRING) makes a new one, so
    the registry read back is the registry (found by the stateful test's store invariant)."""
    from tests.helpers.controller_fakes import make_config

    registry = AdapterRegistry(n_slots=2)
    registry.register("c", make_config("c"))
    registry.export_state()  # its stored form, cached
    registry.deregister("c")
    registry.export_state()
    registry.record_weight_update(["c"])
    restored = AdapterRegistry.from_state(registry.export_state(), 2)
    assert restored.snapshot() == registry.snapshot() and restored.export_state() == registry.export_state()
