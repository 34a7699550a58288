"""Every lifecycle and batch-accounting rule of the adapter registry (DESIGN §2)."""

from __future__ import annotations

import logging
import pickle
import uuid
from pathlib import Path

import pytest

from miles.controller.registry import (
    BATCH_RECORD_RETENTION,
    COMPLETED_RETENTION,
    AdapterConflictError,
    AdapterNotFoundError,
    AdapterRegistry,
    AdapterValidationError,
    NoFreeSlotError,
)
from miles.utils.types import (
    AdapterFailure,
    AdapterKind,
    AdapterState,
    ClientModelConfig,
    FailureReason,
    MultiLoRASnapshot,
)
from tests.helpers.controller_fakes import make_config


def walk_to(registry: AdapterRegistry, name: str, state: AdapterState) -> None:
    """Register `name` and drive it to `state` through the real transitions."""
    registry.register(name, make_config(name))
    order = [AdapterState.PENDING, AdapterState.ACTIVE, AdapterState.RETIRING, AdapterState.CLEANUP,
             AdapterState.COMPLETED]
    for target in order[1:order.index(state) + 1]:
        if target is AdapterState.ACTIVE:
            registry.record_weight_update([name])
        elif target is AdapterState.RETIRING:
            registry.deregister(name)
        elif target is AdapterState.CLEANUP:
            registry.retire_adapters()
        else:
            registry.free_slot(name)
    assert registry.state(name) is state


def test_full_walk_and_snapshot_views() -> None:
    registry = AdapterRegistry(n_slots=3)
    assert registry.register("a", make_config("a")) == 0
    assert registry.register("b", make_config("b")) == 1
    snap = registry.snapshot()
    assert set(snap.pending) == {"a", "b"} and not snap.active and not snap.all_adapters_cleaned_up
    assert snap.pending["a"].slot == 0 and snap.pending["a"].version == 0 and snap.pending["a"].step == 0

    assert registry.record_weight_update(["a"]) == {"a": 1}
    assert registry.state("a") is AdapterState.ACTIVE and registry.state("b") is AdapterState.PENDING
    assert registry.deregister("a") is AdapterState.RETIRING
    assert registry.retire_adapters() == ["a"]
    snap = registry.snapshot()
    assert snap.cleanup == frozenset({"a"}) and "a" not in snap.live
    assert registry.free_slot("a") == 0
    assert registry.state("a") is AdapterState.COMPLETED
    status = registry.status("a")
    assert (status.state, status.slot, status.version) == (AdapterState.COMPLETED, 0, None)
    assert registry.free_slots == [0, 2]

    registry.deregister("b")
    registry.retire_adapters()
    registry.free_slot("b")
    snap = registry.snapshot()
    assert snap.all_adapters_cleaned_up and snap.completed == frozenset({"a", "b"})
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_registration_ids_are_fresh_uuid4_hex() -> None:
    registry = AdapterRegistry(n_slots=2)
    walk_to(registry, "a", AdapterState.COMPLETED)
    first = registry.status("a").registration_id
    registry.register("a", make_config("a"))
    second = registry.status("a").registration_id
    assert first != second
    for registration_id in (first, second):
        parsed = uuid.UUID(hex=registration_id)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122, registration_id
        assert registration_id == parsed.hex  # 32 lowercase hex digits, no dashes


def test_lowest_free_slot_and_slot_reuse_keeps_versions_monotonic() -> None:
    registry = AdapterRegistry(n_slots=2)
    registry.register("a", make_config("a"))
    registry.register("b", make_config("b"))
    registry.record_weight_update(["a", "b"])
    registry.record_weight_update(["a"])
    assert registry.slot_versions == [2, 1]
    registry.deregister("a")
    registry.retire_adapters()
    assert registry.free_slot("a") == 0

    assert registry.register("c", make_config("c")) == 0
    assert registry.snapshot().pending["c"].version == 2  # not reset by the new owner
    assert registry.record_weight_update(["c"]) == {"c": 3}
    seen = {(0, 1), (0, 2)}
    assert (0, registry.snapshot().active["c"].version) not in seen


@pytest.mark.parametrize("state, error, words", [
    (AdapterState.PENDING, AdapterConflictError, "already registered"),
    (AdapterState.ACTIVE, AdapterConflictError, "already registered"),
    (AdapterState.RETIRING, AdapterConflictError, "still cleaning up; retry shortly"),
    (AdapterState.CLEANUP, AdapterConflictError, "still cleaning up; retry shortly"),
])
def test_reregister_refused_while_live(state: AdapterState, error: type, words: str) -> None:
    registry = AdapterRegistry(n_slots=3)
    walk_to(registry, "a", state)
    before = (registry.snapshot(), registry.free_slots, registry.status("a"))
    with pytest.raises(error, match=words):
        registry.register("a", make_config("a", root=Path("/elsewhere")))
    assert (registry.snapshot(), registry.free_slots, registry.status("a")) == before
    assert issubclass(error, AdapterValidationError)


def test_reregister_after_completed_replaces_the_record() -> None:
    registry = AdapterRegistry(n_slots=2)
    walk_to(registry, "a", AdapterState.COMPLETED)
    registry.set_step("a", 5)
    assert registry.register("a", make_config("a", rank=2)) == 0
    status = registry.status("a")
    assert (status.state, status.step, status.rank) == (AdapterState.PENDING, 0, 2)
    assert "a" not in registry.snapshot().completed


def test_deregister_is_a_noop_after_retiring_and_unknown_is_404() -> None:
    registry = AdapterRegistry(n_slots=4)
    for name, state in [("r", AdapterState.RETIRING), ("c", AdapterState.CLEANUP), ("d", AdapterState.COMPLETED)]:
        walk_to(registry, name, state)
        assert registry.deregister(name) is state
    with pytest.raises(AdapterNotFoundError, match="Adapter 'zz' not registered"):
        registry.deregister("zz")
    assert registry.state("zz") is None


def test_free_slot_only_from_cleanup() -> None:
    registry = AdapterRegistry(n_slots=3)
    walk_to(registry, "p", AdapterState.PENDING)
    walk_to(registry, "r", AdapterState.RETIRING)
    assert [registry.free_slot(n) for n in ["p", "r", "unknown"]] == [-1, -1, -1]
    assert registry.free_slots == [2]


FAILURE = AdapterFailure(reason=FailureReason.ERRORS, error_type="ValueError", message="reward exploded", groups=8)


@pytest.mark.parametrize("state", [AdapterState.ACTIVE, AdapterState.RETIRING])
def test_a_failed_adapter_leaves_through_cleanup_and_ends_failed(state: AdapterState) -> None:
    registry = AdapterRegistry(n_slots=2)
    walk_to(registry, "bad", state)
    walk_to(registry, "good", AdapterState.ACTIVE)
    registration = registry.registration_id("bad")
    assert registration is not None
    assert registry.fail("bad", registration, FAILURE)
    snap = registry.snapshot()
    assert "bad" in snap.cleanup and "bad" not in snap.sampleable and set(snap.sampleable) == {"good"}
    assert registry.status("bad").last_error == FAILURE  # visible while it is cleaned up
    assert registry.retire_adapters() == []  # not RETIRING: its requests were aborted by whoever failed it
    assert registry.free_slot("bad") == 0
    status = registry.status("bad")
    assert (status.state, status.version, status.last_error) == (AdapterState.FAILED, None, FAILURE)
    snap = registry.snapshot()
    assert snap.failed == frozenset({"bad"}) and not snap.completed and registry.free_slots == [0]
    assert pickle.loads(pickle.dumps(snap)) == snap
    # Terminal: DELETE changes nothing, and a batch that names it counts nothing.
    assert registry.deregister("bad") is AdapterState.FAILED
    registry.record_batch_adapters(0, {"bad": 1, "good": 4}, ["bad", "good"])
    assert registry.mark_batch_trained(0) == ["good"] and registry.status("bad").step == status.step


@pytest.mark.parametrize("state", [AdapterState.PENDING, AdapterState.CLEANUP, AdapterState.COMPLETED])
def test_fail_is_refused_outside_active_and_retiring(state: AdapterState) -> None:
    registry = AdapterRegistry(n_slots=1)
    walk_to(registry, "a", state)
    status = registry.status("a")
    before = (registry.snapshot(), registry.free_slots)
    assert not registry.fail("a", status.registration_id, FAILURE)
    assert (registry.snapshot(), registry.free_slots, registry.status("a")) == (*before, status)


def test_fail_of_a_previous_registration_or_a_client_model_is_ignored() -> None:
    registry = AdapterRegistry(n_slots=2)
    walk_to(registry, "a", AdapterState.COMPLETED)
    old = registry.status("a").registration_id
    walk_to(registry, "a", AdapterState.ACTIVE)
    assert not registry.fail("a", old, FAILURE) and registry.state("a") is AdapterState.ACTIVE
    assert not registry.fail("unknown", old, FAILURE)
    registry.register("m", client_config())
    registry.activate_clients(["m"])
    registration = registry.registration_id("m")
    assert registration is not None and not registry.fail("m", registration, FAILURE)
    assert registry.state("m") is AdapterState.ACTIVE


def test_a_failed_name_registers_again_with_a_new_registration() -> None:
    """FAILED is terminal like COMPLETED: the name is free, its save directory too."""
    registry = AdapterRegistry(n_slots=1)
    walk_to(registry, "a", AdapterState.ACTIVE)
    first = registry.status("a").registration_id
    registry.fail("a", first, FAILURE)
    with pytest.raises(AdapterConflictError, match="still cleaning up"):
        registry.register("a", make_config("a"))
    registry.free_slot("a")
    assert registry.register("a", make_config("a", rank=2)) == 0
    status = registry.status("a")
    assert (status.state, status.rank, status.last_error) == (AdapterState.PENDING, 2, None)
    assert status.registration_id != first and registry.snapshot().failed == frozenset()


def test_failed_records_share_the_retention_of_completed_ones() -> None:
    registry = AdapterRegistry(n_slots=1, completed_retention=2)
    for name in ["a", "b", "c"]:
        walk_to(registry, name, AdapterState.ACTIVE)
        registry.fail(name, registry.status(name).registration_id, FAILURE)
        registry.free_slot(name)
    assert registry.snapshot().failed == frozenset({"b", "c"}) and registry.state("a") is None


def test_failed_and_its_error_survive_the_exported_state() -> None:
    registry = AdapterRegistry(n_slots=2)
    for name in ["gone", "leaving"]:
        walk_to(registry, name, AdapterState.ACTIVE)
        registry.fail(name, registry.status(name).registration_id, FAILURE)
    registry.free_slot("gone")
    restored = AdapterRegistry.from_state(registry.export_state(), 2)
    assert restored.statuses() == registry.statuses()
    assert restored.snapshot() == registry.snapshot() == MultiLoRASnapshot(
        cleanup=frozenset({"leaving"}), failed=frozenset({"gone"}))
    assert restored.requeue_for_new_trainer() == []  # a new trainer resumes neither,
    # and ends the one the previous trainer was still cleaning up: FAILED, its error kept, its slot free.
    assert restored.state("leaving") is AdapterState.FAILED and restored.free_slots == [0, 1]
    assert restored.status("leaving").last_error == registry.status("leaving").last_error is not None


def test_retiring_adapter_stays_sampleable_until_retired() -> None:
    registry = AdapterRegistry(n_slots=2)
    walk_to(registry, "a", AdapterState.RETIRING)
    assert set(registry.snapshot().sampleable) == {"a"}
    registry.retire_adapters()
    assert registry.snapshot().sampleable == {}


def test_no_free_slot_with_the_queue_off() -> None:
    registry = AdapterRegistry(n_slots=1, queue_size=0)
    registry.register("a", make_config("a"))
    before = (registry.snapshot(), registry.free_slots)
    with pytest.raises(NoFreeSlotError, match="all 1 slots are in use.*--multi-lora-queue-size"):
        registry.register("b", make_config("b"))
    assert (registry.snapshot(), registry.free_slots) == before
    assert registry.state("b") is None


def test_duplicate_save_directory_rejected_until_the_owner_completes(tmp_path: Path) -> None:
    registry = AdapterRegistry(n_slots=3)
    registry.register("a", make_config("a", save=tmp_path / "shared"))
    with pytest.raises(AdapterValidationError, match="already used by live adapter 'a'"):
        registry.register("b", make_config("b", save=tmp_path / "x" / ".." / "shared"))
    registry.deregister("a")
    registry.retire_adapters()
    with pytest.raises(AdapterValidationError, match="already used"):  # CLEANUP still owns it
        registry.register("b", make_config("b", save=tmp_path / "shared"))
    registry.free_slot("a")
    assert registry.register("b", make_config("b", save=tmp_path / "shared")) == 0


def test_bad_names_rejected_by_the_registry_too() -> None:
    registry = AdapterRegistry(n_slots=1)
    for name in ["a/b", "..", ".", "a::b", "a b", ""]:
        with pytest.raises(AdapterValidationError, match="Invalid adapter name"):
            registry.register(name, make_config("x"))
    assert registry.free_slots == [0]


def test_accumulation_over_three_batches() -> None:
    registry = AdapterRegistry(n_slots=2)
    registry.register("a", make_config("a", rollout_batch_size=6))
    registry.record_weight_update(["a"])
    for rollout_id, (expected_step, expected_groups) in enumerate([(0, 2), (0, 4), (1, 0)]):
        registry.record_batch_adapters(rollout_id, {"a": 2}, ["a"] if rollout_id == 2 else [])
        stepped = registry.mark_batch_trained(rollout_id)
        run = registry.snapshot().active["a"]
        assert (run.step, run.accumulated_groups) == (expected_step, expected_groups)
        assert stepped == (["a"] if rollout_id == 2 else [])


def test_failed_train_call_leaves_the_registry_unchanged() -> None:
    registry = AdapterRegistry(n_slots=2)
    registry.register("a", make_config("a", rollout_batch_size=2))
    registry.record_weight_update(["a"])
    before = (registry.snapshot(), registry.status("a"))
    registry.record_batch_adapters(7, {"a": 2}, ["a"])
    # the train call raised: no mark_batch_trained
    assert (registry.snapshot(), registry.status("a")) == before
    # the retry records the same rollout again and commits once
    registry.record_batch_adapters(7, {"a": 2}, ["a"])
    assert registry.mark_batch_trained(7) == ["a"]
    assert registry.mark_batch_trained(7) == []  # a second commit adds nothing
    assert (registry.step("a"), registry.status("a").accumulated_groups) == (1, 0)


def test_step_warns_when_groups_do_not_match_batch_size(caplog: pytest.LogCaptureFixture) -> None:
    registry = AdapterRegistry(n_slots=1)
    registry.register("a", make_config("a", rollout_batch_size=4))
    registry.record_weight_update(["a"])
    registry.record_batch_adapters(0, {"a": 3}, ["a"])
    with caplog.at_level(logging.WARNING, logger="miles.controller.registry"):
        assert registry.mark_batch_trained(0) == ["a"]
    assert "stepped with 3 accumulated groups, expected rollout_batch_size=4" in caplog.text
    assert registry.status("a").accumulated_groups == 0


def test_groups_counted_for_active_retiring_and_cleanup_only() -> None:
    registry = AdapterRegistry(n_slots=4)
    walk_to(registry, "p", AdapterState.PENDING)
    walk_to(registry, "a", AdapterState.ACTIVE)
    walk_to(registry, "r", AdapterState.RETIRING)
    walk_to(registry, "c", AdapterState.CLEANUP)
    registry.record_batch_adapters(0, {"p": 1, "a": 1, "r": 1, "c": 1, "ghost": 1}, ["c"])
    assert registry.mark_batch_trained(0) == ["c"]
    groups = {s.name: (s.accumulated_groups, s.step) for s in registry.statuses()}
    assert groups == {"p": (0, 0), "a": (1, 0), "r": (1, 0), "c": (0, 1)}


def test_reregistered_adapter_does_not_inherit_an_old_batch() -> None:
    registry = AdapterRegistry(n_slots=2)
    walk_to(registry, "a", AdapterState.ACTIVE)
    registry.record_batch_adapters(0, {"a": 4}, ["a"])
    registry.deregister("a")
    registry.retire_adapters()
    registry.free_slot("a")
    registry.register("a", make_config("a"))
    registry.record_weight_update(["a"])
    assert registry.mark_batch_trained(0) == []
    assert (registry.step("a"), registry.status("a").accumulated_groups) == (0, 0)


def test_num_step_auto_retires_relative_to_the_resumed_step() -> None:
    registry = AdapterRegistry(n_slots=1)
    registry.register("a", make_config("a", rollout_batch_size=1, num_step=2))
    registry.set_step("a", 10)  # resumed from a step-10 checkpoint
    registry.record_weight_update(["a"])
    states = []
    for rollout_id in range(2):
        registry.record_batch_adapters(rollout_id, {"a": 1}, ["a"])
        registry.mark_batch_trained(rollout_id)
        states.append((registry.step("a"), registry.state("a")))
    assert states == [(11, AdapterState.ACTIVE), (12, AdapterState.RETIRING)]


def test_a_trainer_restarted_over_the_registry_keeps_the_registration_end() -> None:
    """num_step counts from the registration's start, not from the step a new trainer loads at."""
    from miles.backends.base import AdapterSpec

    registry = AdapterRegistry(n_slots=1)
    registry.register("a", make_config("a", rollout_batch_size=1, num_step=10))
    registry.set_step("a", 2)  # resumed from a step-2 checkpoint before its first push
    first = registry.snapshot().pending["a"]
    assert not first.pushed and AdapterSpec.from_run(first).final_step(2) == 12
    registry.record_weight_update(["a"])
    for rollout_id in range(3):
        registry.record_batch_adapters(rollout_id, {"a": 1}, ["a"])
        registry.mark_batch_trained(rollout_id)
    assert registry.requeue_for_new_trainer() == ["a"]
    registry.set_step("a", 4)  # the new trainer found a step-4 checkpoint
    snapshot = registry.snapshot()
    run = snapshot.pending["a"]
    assert (run.pushed, run.start_step, run.step) == (True, 2, 4)
    assert AdapterSpec.from_run(run).final_step(4) == 12


def test_pending_adapter_is_not_auto_retired_and_unset_num_step_never_retires() -> None:
    registry = AdapterRegistry(n_slots=1)
    registry.register("a", make_config("a", rollout_batch_size=1))
    registry.record_weight_update(["a"])
    for rollout_id in range(5):
        registry.record_batch_adapters(rollout_id, {"a": 1}, ["a"])
        registry.mark_batch_trained(rollout_id)
    assert (registry.step("a"), registry.state("a")) == (5, AdapterState.ACTIVE)


def test_step_names_must_be_in_groups() -> None:
    registry = AdapterRegistry(n_slots=1)
    with pytest.raises(ValueError, match=r"step_names \['b'\] are not in the batch's groups"):
        registry.record_batch_adapters(0, {"a": 1}, ["b"])


def test_batch_records_keep_the_last_16() -> None:
    assert BATCH_RECORD_RETENTION == 16
    registry = AdapterRegistry(n_slots=1)
    walk_to(registry, "a", AdapterState.ACTIVE)
    for rollout_id in range(17):
        registry.record_batch_adapters(rollout_id, {"a": 1}, [])
    assert registry.mark_batch_trained(0) == [] and registry.status("a").accumulated_groups == 0
    registry.mark_batch_trained(1)
    registry.mark_batch_trained(16)
    assert registry.status("a").accumulated_groups == 2


def test_completed_retention_evicts_oldest_and_reads_refresh() -> None:
    assert AdapterRegistry(n_slots=1).completed_retention == COMPLETED_RETENTION == 1024
    registry = AdapterRegistry(n_slots=1, completed_retention=3)
    for name in ["a", "b", "c"]:
        walk_to(registry, name, AdapterState.COMPLETED)
    registry.status("a")  # reading "a" makes "b" the oldest
    walk_to(registry, "d", AdapterState.COMPLETED)
    assert registry.snapshot().completed == frozenset({"a", "c", "d"})
    with pytest.raises(AdapterNotFoundError):
        registry.status("b")


def test_set_step_and_adapter_step() -> None:
    registry = AdapterRegistry(n_slots=1)
    registry.register("a", make_config("a"))
    registry.set_step("a", 3)
    assert registry.step("a") == 3 and registry.snapshot().pending["a"].step == 3
    with pytest.raises(ValueError):
        registry.set_step("a", -1)
    with pytest.raises(AdapterNotFoundError):
        registry.set_step("b", 1)


def test_a_resume_restores_the_groups_of_an_unfinished_step() -> None:
    registry = AdapterRegistry(n_slots=1)
    registry.register("a", make_config("a", rollout_batch_size=3))
    registry.set_step("a", 4, accumulated_groups=2)  # a checkpoint saved 2 of 3 groups' gradient
    assert (registry.step("a"), registry.status("a").accumulated_groups) == (4, 2)
    assert registry.snapshot().pending["a"].accumulated_groups == 2
    for bad in (-1, 3):  # a full window would have stepped
        with pytest.raises(ValueError, match=r"0\.\.2"):
            registry.set_step("a", 4, accumulated_groups=bad)
    registry.set_step("a", 5)
    assert registry.status("a").accumulated_groups == 0


def test_weight_update_of_unknown_name_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    registry = AdapterRegistry(n_slots=1)
    walk_to(registry, "a", AdapterState.COMPLETED)
    with caplog.at_level(logging.WARNING):
        assert registry.record_weight_update(["a", "nobody"]) == {}
    assert registry.slot_versions == [1]
    assert "holds no slot" in caplog.text


def test_a_push_under_way_shows_its_version_until_it_is_recorded() -> None:
    registry = AdapterRegistry(n_slots=2)
    registry.register("a", make_config("a"))
    registry.register("b", make_config("b"))
    registry.record_weight_update(["a"])
    assert registry.begin_weight_update(["a", "b", "gone"]) == {"a": 2, "b": 1}  # an unknown name is skipped
    before = registry.snapshot()
    a, b = before.active["a"], before.pending["b"]
    # The engines still serve version 1 of a (and nothing of b); staleness counts against 2.
    assert (a.version, a.pushing_version, a.trainer_version) == (1, 2, 2)
    assert (b.version, b.pushing_version, b.trainer_version) == (0, 1, 1)
    assert registry.record_weight_update(["a", "b"]) == {"a": 2, "b": 1}
    after = registry.snapshot()
    assert set(after.active) == {"a", "b"}
    assert [(r.version, r.pushing_version, r.trainer_version) for r in (after.active["a"], after.active["b"])] == [
        (2, None, 2), (1, None, 1)]


# ---- client-driven adapters (Tinker models, DESIGN §11) ------------------------------------

def client_config(model_id: str = "s-1:train:0", rank: int = 4, root: Path = Path("/runs")) -> ClientModelConfig:
    name = model_id.replace(":", ".")
    return ClientModelConfig(model_id=model_id, session_id=model_id.split(":")[0], base_model="tiny", rank=rank,
                             alpha=8.0, seed=3, save=root / "adapters" / name)


def test_client_driven_adapters_share_the_slots_and_stay_out_of_rl_batches() -> None:
    registry = AdapterRegistry(n_slots=2)
    assert registry.register("rl", make_config("rl", num_step=1)) == 0
    assert registry.register("s-1.train.0", client_config()) == 1
    with pytest.raises(NoFreeSlotError, match="all 2 slots are in use"):
        registry.register("s-1.train.1", client_config("s-1:train:1"))
    assert registry.kind("s-1.train.0") is AdapterKind.CLIENT and registry.kind("rl") is AdapterKind.SERVER

    registry.record_weight_update(["rl", "s-1.train.0"])
    snapshot = registry.snapshot()
    assert set(snapshot.active) == {"rl"} and set(snapshot.sampleable) == {"rl"}  # nothing generates for it
    client = snapshot.clients["s-1.train.0"]
    assert (client.state, client.slot, client.version, client.step) == (AdapterState.ACTIVE, 1, 1, 0)

    # A batch naming it (a driver bug) never steps it; its optim_step does, and it never auto-retires.
    registry.record_batch_adapters(0, {"rl": 4, "s-1.train.0": 4}, ["rl", "s-1.train.0"])
    assert registry.mark_batch_trained(0) == ["rl"]
    assert registry.state("rl") is AdapterState.RETIRING  # num_step=1 reached
    assert [registry.record_client_step("s-1.train.0") for _ in range(3)] == [1, 2, 3]
    assert registry.state("s-1.train.0") is AdapterState.ACTIVE
    assert registry.record_client_step("rl") is None and registry.record_client_step("ghost") is None

    status = registry.status("s-1.train.0")
    assert (status.kind, status.model_id, status.seed, status.rank, status.data, status.num_step) == (
        AdapterKind.CLIENT, "s-1:train:0", 3, 4, None, None)

    registry.deregister("s-1.train.0")
    assert registry.snapshot().clients["s-1.train.0"].state is AdapterState.RETIRING
    registry.retire_adapters()
    snapshot = registry.snapshot()
    assert "s-1.train.0" in snapshot.cleanup and "s-1.train.0" not in snapshot.clients
    assert registry.free_slot("s-1.train.0") == 1
    assert registry.client_config("s-1.train.0") == client_config()  # kept with the completed record


def test_client_driven_adapters_round_trip_through_the_exported_state() -> None:
    registry = AdapterRegistry(n_slots=3)
    registry.register("rl", make_config("rl"))
    registry.register("s-1.train.0", client_config())
    registry.record_client_step("s-1.train.0")
    restored = AdapterRegistry.from_state(registry.export_state(), n_slots=3)
    assert restored.snapshot() == registry.snapshot()
    assert restored.statuses() == registry.statuses()
    assert restored.kind("s-1.train.0") is AdapterKind.CLIENT
    restored.set_step("s-1.train.0", 5)  # a resume from a checkpoint
    assert restored.step("s-1.train.0") == 5
    with pytest.raises(ValueError, match="accumulated groups must be in 0..0"):
        restored.set_step("s-1.train.0", 5, accumulated_groups=1)


def test_client_driven_adapters_are_activated_by_the_trainer_and_resume_from_their_last_save() -> None:
    registry = AdapterRegistry(n_slots=2)
    registry.register("rl", make_config("rl"))
    registry.register("s-1.train.0", client_config())
    assert registry.activate_clients(["rl", "s-1.train.0", "ghost"]) == ["s-1.train.0"]
    assert registry.state("rl") is AdapterState.PENDING  # only client-driven ones: RL adapters wait for a push
    assert registry.record_client_step("s-1.train.0") == 1
    assert registry.record_client_checkpoint("s-1.train.0", "/runs/adapters/s-1.train.0/weights/c1")
    assert registry.record_client_step("s-1.train.0") == 2  # a step after the save: lost with a trainer
    assert not registry.record_client_checkpoint("rl", "/x")
    restored = AdapterRegistry.from_state(registry.export_state(), n_slots=2)
    run = restored.snapshot().clients["s-1.train.0"]
    assert (run.state, run.step) == (AdapterState.ACTIVE, 2)
    assert (run.resume_from, run.resume_step) == ("/runs/adapters/s-1.train.0/weights/c1", 1)
