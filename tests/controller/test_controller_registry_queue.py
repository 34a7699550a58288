"""The registration queue of the adapter registry: a registration that finds every slot held
waits QUEUED (holding no slot) and takes the next freed slot, by priority then arrival."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.controller.registry import (
    AdapterAlreadyRegisteredError,
    AdapterNotFoundError,
    AdapterRegistry,
    AdapterValidationError,
    NoFreeSlotError,
    QueueFullError,
)
from miles.utils.types import AdapterFailure, AdapterKind, AdapterState, ClientModelConfig, FailureReason
from tests.helpers.controller_fakes import make_config


def full(n_slots: int = 1, **kwargs: int) -> AdapterRegistry:
    """A registry whose every slot is held by an ACTIVE adapter `held0`, `held1`, ..."""
    registry = AdapterRegistry(n_slots=n_slots, **kwargs)
    for i in range(n_slots):
        assert registry.register(f"held{i}", make_config(f"held{i}")) == i
    registry.record_weight_update([f"held{i}" for i in range(n_slots)])
    return registry


def leave(registry: AdapterRegistry, name: str) -> int:
    """Retire `name` through the real transitions; returns the slot its `free_slot` freed."""
    registry.deregister(name)
    registry.retire_adapters()
    return registry.free_slot(name)


def queue_of(registry: AdapterRegistry) -> list[str]:
    names = registry.snapshot().queued
    assert [registry.queue_position(n) for n in names] == list(range(1, len(names) + 1))
    return list(names)


def test_a_registration_with_no_free_slot_is_queued_holding_no_slot() -> None:
    registry = full(2)
    before = registry.snapshot()
    assert registry.register("late", make_config("late")) is None
    assert registry.state("late") is AdapterState.QUEUED and registry.free_slots == []
    status = registry.status("late")
    assert (status.slot, status.version, status.queue_position, status.step, status.kind) == (
        None, None, 1, 0, AdapterKind.SERVER)
    assert len(status.registration_id) == 32 and status.data == "/runs/late.jsonl"
    snapshot = registry.snapshot()
    assert snapshot.queued == ("late",) and "late" not in snapshot.live and not snapshot.all_adapters_cleaned_up
    assert (snapshot.pending, snapshot.active) == (before.pending, before.active)  # nothing holding a slot moved
    assert registry.status("held0").queue_position is None
    assert [s.name for s in registry.statuses()] == ["held0", "held1", "late"]  # live by slot, then the queue


def test_the_queue_is_fifo_within_a_priority_and_higher_priorities_go_first() -> None:
    registry = full(1)
    for name, priority in [("q1", 0), ("q2", 0), ("hi1", 5), ("hi2", 5), ("low", -1), ("q3", 0), ("top", 9)]:
        assert registry.register(name, make_config(name), priority=priority) is None
    assert queue_of(registry) == ["top", "hi1", "hi2", "q1", "q2", "q3", "low"]
    assert registry.status("hi2").priority == 5 and registry.status("low").priority == -1
    # Slots freed one by one go down the queue in that order.
    promoted = []
    for _ in range(7):
        live = next(iter(registry.live_slots()))
        registry.record_weight_update([live])
        leave(registry, live)
        promoted.append(next(iter(registry.snapshot().pending)))
    assert promoted == ["top", "hi1", "hi2", "q1", "q2", "q3", "low"]
    assert registry.status("low").priority == -1  # kept once it holds a slot


@pytest.mark.parametrize("failed", [False, True])
def test_a_freed_slot_goes_to_the_head_of_the_queue_in_the_same_change(failed: bool) -> None:
    registry = full(2)
    registry.register("first", make_config("first"))
    registry.register("second", make_config("second"))
    queued_id = registry.status("first").registration_id
    if failed:
        registry.fail("held1", registry.status("held1").registration_id,
                      AdapterFailure(reason=FailureReason.ERRORS, error_type="ValueError", message="x", groups=3))
    else:
        registry.deregister("held1")
        registry.retire_adapters()
    version = registry.slot_versions[1]
    assert registry.free_slot("held1") == 1  # one call: held1 ends, first takes slot 1
    assert registry.state("held1") is (AdapterState.FAILED if failed else AdapterState.COMPLETED)
    snapshot = registry.snapshot()
    run = snapshot.pending["first"]
    assert (run.slot, run.version, run.registration_id, run.step) == (1, version, queued_id, 0)
    assert snapshot.queued == ("second",) and registry.queue_position("second") == 1
    assert registry.free_slots == []
    # The exported state after that one change already holds the promotion (the store writes it at once).
    exported = registry.export_state()
    assert [r["name"] for r in exported.live] == ["held0", "first"]
    assert [r["name"] for r in exported.queued] == ["second"]


def test_deleting_a_queued_adapter_touches_no_slot_and_frees_the_name() -> None:
    registry = full(2)
    for name in ["x", "y", "z"]:
        registry.register(name, make_config(name))
    live_before = [s for s in registry.statuses() if s.state.holds_slot]
    versions_before = registry.slot_versions
    assert registry.deregister("y") is None
    assert registry.state("y") is None and registry.queue_position("y") is None
    with pytest.raises(AdapterNotFoundError):
        registry.status("y")
    with pytest.raises(AdapterNotFoundError):
        registry.deregister("y")
    assert [s for s in registry.statuses() if s.state.holds_slot] == live_before
    assert registry.slot_versions == versions_before and registry.free_slots == []
    assert queue_of(registry) == ["x", "z"]
    # Registrable again at once, at the back of the queue, as a new registration.
    assert registry.register("y", make_config("y")) is None
    assert queue_of(registry) == ["x", "z", "y"]
    # DELETE of a live adapter is unchanged: RETIRING, and its slot goes to the head once freed.
    assert registry.deregister("held0") is AdapterState.RETIRING
    registry.retire_adapters()
    registry.free_slot("held0")
    assert registry.snapshot().pending["x"].slot == 0


def test_a_queued_name_cannot_be_registered_twice_nor_share_a_save_directory(tmp_path: Path) -> None:
    registry = full(1)
    registry.register("q", make_config("q", save=tmp_path / "shared"))
    with pytest.raises(AdapterAlreadyRegisteredError, match="already registered \\(QUEUED, position 1\\)"):
        registry.register("q", make_config("q"))
    with pytest.raises(AdapterValidationError, match="already used by queued adapter 'q'"):
        registry.register("other", make_config("other", save=tmp_path / "x" / ".." / "shared"))
    assert queue_of(registry) == ["q"]


def test_a_full_queue_refuses_and_says_what_to_do() -> None:
    registry = full(1, queue_size=2)
    registry.register("a", make_config("a"))
    registry.register("b", make_config("b"))
    before = (registry.statuses(), registry.export_state())
    with pytest.raises(QueueFullError, match="queue is full \\(2 waiting for 1 slots\\).*--multi-lora-queue-size"
                       ) as caught:
        registry.register("c", make_config("c"), priority=100)
    assert isinstance(caught.value, NoFreeSlotError) and isinstance(caught.value, RuntimeError)  # a 409, as in Miles
    assert (registry.statuses(), registry.export_state()) == before and registry.state("c") is None
    leave(registry, "held0")  # a promotion makes room
    assert registry.register("c", make_config("c")) is None and queue_of(registry) == ["b", "c"]


def test_client_driven_adapters_are_never_queued() -> None:
    registry = full(1)
    config = ClientModelConfig(model_id="s-1:train:0", session_id="s-1", base_model="tiny", rank=4, alpha=8.0,
                               seed=3, save=Path("/runs/adapters/s-1.train.0"))
    with pytest.raises(NoFreeSlotError, match="client models are not queued") as caught:
        registry.register("s-1.train.0", config)
    assert not isinstance(caught.value, QueueFullError)
    assert registry.state("s-1.train.0") is None and registry.snapshot().queued == ()


def test_the_queue_and_its_priorities_survive_the_exported_state() -> None:
    registry = full(2)
    for name, priority in [("a", 0), ("b", 3), ("c", 0), ("d", 3)]:
        registry.register(name, make_config(name), priority=priority)
    restored = AdapterRegistry.from_state(registry.export_state(), n_slots=2)
    assert restored.statuses() == registry.statuses() and restored.snapshot() == registry.snapshot()
    assert queue_of(restored) == ["b", "d", "a", "c"]
    # A new registration of priority 3 goes behind the restored ones of priority 3.
    restored.register("e", make_config("e"), priority=3)
    assert queue_of(restored) == ["b", "d", "e", "a", "c"]
    leave(restored, "held1")
    assert restored.snapshot().pending["b"].slot == 1
    assert restored.status("b").registration_id == registry.status("b").registration_id


def test_a_larger_table_at_restart_gives_its_new_slots_to_the_queue() -> None:
    registry = full(1)
    for name in ["a", "b", "c"]:
        registry.register(name, make_config(name))
    restored = AdapterRegistry.from_state(registry.export_state(), n_slots=3)
    snapshot = restored.snapshot()
    assert {n: r.slot for n, r in snapshot.pending.items()} == {"a": 1, "b": 2} and snapshot.queued == ("c",)


def test_a_new_trainer_keeps_the_queue_and_hands_it_the_slots_it_frees() -> None:
    registry = full(2)
    for name in ["a", "b", "c"]:
        registry.register(name, make_config(name))
    registry.deregister("held0")
    registry.retire_adapters()  # held0 in CLEANUP when the trainer stops
    restored = AdapterRegistry.from_state(registry.export_state(), n_slots=2)
    assert restored.requeue_for_new_trainer() == ["held1"]
    snapshot = restored.snapshot()
    assert restored.state("held0") is AdapterState.COMPLETED
    assert set(snapshot.pending) == {"held1", "a"} and snapshot.pending["a"].slot == 0
    assert snapshot.queued == ("b", "c")


def test_a_restored_queue_longer_than_the_queue_size_is_kept_whole() -> None:
    registry = full(1)
    for name in ["a", "b", "c"]:
        registry.register(name, make_config(name))
    restored = AdapterRegistry.from_state(registry.export_state(), n_slots=1, queue_size=1)
    assert queue_of(restored) == ["a", "b", "c"]
    with pytest.raises(QueueFullError):
        restored.register("d", make_config("d"))
    off = AdapterRegistry.from_state(registry.export_state(), n_slots=1, queue_size=0)
    assert queue_of(off) == ["a", "b", "c"]  # the queue drains into freed slots even with it turned off
    leave(off, "held0")
    assert set(off.snapshot().pending) == {"a"}
    with pytest.raises(NoFreeSlotError, match="--multi-lora-queue-size"):
        off.register("d", make_config("d"))


def test_queue_size_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="queue_size must be >= 0"):
        AdapterRegistry(n_slots=1, queue_size=-1)
