"""Random sequences of lifecycle and batch operations keep the registry's invariants.

Invariants checked after every step: each live adapter owns a distinct slot; free and
live slots partition the table; slot versions never decrease; COMPLETED and FAILED adapters
own no slot, and only FAILED ones carry an error; `step` and `accumulated_groups` change only
in `mark_batch_trained` (or a resume via `set_step`). The registration queue follows a model
kept here (priority first, then arrival; the head takes each freed slot in the same call;
DELETE takes one out), holds no slot, is empty whenever a slot is free, and comes back
unchanged from the exported state. The registry is written through to a SQLite store after
every step (only the rows that changed), and a second connection reads back the same
registry, every record and the queue's and the retention's order included.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from miles.controller.registry import (
    AdapterAlreadyRegisteredError,
    AdapterNotFoundError,
    AdapterRegistry,
    AdapterValidationError,
    QueueFullError,
)
from miles.controller.store import RegistryStore
from miles.utils.types import AdapterFailure, AdapterState, FailureReason
from tests.helpers.controller_fakes import make_config

N_SLOTS = 2
QUEUE_SIZE = 2
NAMES = st.sampled_from(["a", "b", "c", "d", "e", "f"])


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.registry = AdapterRegistry(n_slots=N_SLOTS, completed_retention=4, queue_size=QUEUE_SIZE)
        self.directory = tempfile.TemporaryDirectory()
        self.path = Path(self.directory.name) / "registry.sqlite"
        self.store = RegistryStore(self.path)
        self.reader = RegistryStore(self.path)
        """A second connection: it reads what the first has committed."""
        self.queue: list[tuple[str, int]] = []
        """The model of the registration queue: (name, priority), head first."""
        self.versions = [0] * N_SLOTS
        self.progress = self._progress()
        self.rollout_id = 0

    def _progress(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(name, registration) → (step, accumulated_groups) of every known adapter."""
        return {(s.name, s.registration_id): (s.step, s.accumulated_groups) for s in self.registry.statuses()}

    def _expect_no_progress(self) -> None:
        after = self._progress()
        for key, value in after.items():
            if key in self.progress:
                assert value == self.progress[key], f"{key} advanced outside mark_batch_trained"
            else:
                assert value == (0, 0), f"new registration {key} starts at step 0"
        self.progress = after

    @rule(name=NAMES, batch=st.sampled_from([1, 2, 4]), num_step=st.none() | st.integers(1, 3),
          priority=st.integers(-1, 1))
    def register(self, name: str, batch: int, num_step: int | None, priority: int) -> None:
        state = self.registry.state(name)
        taken = {AdapterState.QUEUED, AdapterState.PENDING, AdapterState.ACTIVE, AdapterState.RETIRING,
                 AdapterState.CLEANUP}
        free_before = self.registry.free_slots
        try:
            slot = self.registry.register(name, make_config(name, rollout_batch_size=batch, num_step=num_step),
                                          priority=priority)
        except AdapterAlreadyRegisteredError:
            assert state in (AdapterState.QUEUED, AdapterState.PENDING, AdapterState.ACTIVE)
        except AdapterValidationError:
            assert state in taken
        except QueueFullError:
            assert not free_before and state not in taken and len(self.queue) == QUEUE_SIZE
        else:
            assert state not in taken
            if free_before:
                assert slot == free_before[0]
            else:  # queued behind every entry of its priority or higher
                assert slot is None and self.registry.state(name) is AdapterState.QUEUED
                index = next((i for i, (_, p) in enumerate(self.queue) if p < priority), len(self.queue))
                self.queue.insert(index, (name, priority))
        self._expect_no_progress()

    @rule(name=NAMES)
    def deregister(self, name: str) -> None:
        before = self.registry.state(name)
        slots_before = (self.registry.live_slots(), self.registry.free_slots, self.registry.slot_versions)
        try:
            after = self.registry.deregister(name)
        except AdapterNotFoundError:
            assert before is None
        else:
            if before is AdapterState.QUEUED:  # out of the queue and forgotten; no slot changes
                assert after is None and self.registry.state(name) is None
                assert (self.registry.live_slots(), self.registry.free_slots,
                        self.registry.slot_versions) == slots_before
                self.queue = [(n, p) for n, p in self.queue if n != name]
            else:
                moved = before in (AdapterState.PENDING, AdapterState.ACTIVE)
                assert after is (AdapterState.RETIRING if moved else before)
        self._expect_no_progress()

    @rule()
    def retire(self) -> None:
        retiring = set(self.registry.snapshot().retiring)
        assert set(self.registry.retire_adapters()) == retiring
        assert all(self.registry.state(n) is AdapterState.CLEANUP for n in retiring)
        self._expect_no_progress()

    @rule(data=st.data())
    def free_one_in_cleanup(self, data: st.DataObject) -> None:
        """The trainer's own call: `free` below mostly draws names that are not in CLEANUP."""
        cleanup = sorted(self.registry.snapshot().cleanup)
        if cleanup:
            self.free(data.draw(st.sampled_from(cleanup)))

    @rule(name=NAMES)
    def free(self, name: str) -> None:
        in_cleanup = self.registry.state(name) is AdapterState.CLEANUP
        slot = self.registry.live_slots().get(name)
        assert self.registry.free_slot(name) == (slot if in_cleanup else -1)
        if in_cleanup and self.queue:  # the head took the slot in that same call
            head, _ = self.queue.pop(0)
            assert self.registry.state(head) is AdapterState.PENDING
            assert self.registry.live_slots()[head] == slot
        self._expect_no_progress()

    @rule()
    def restore(self) -> None:
        """What a restarted controller rebuilds from the store: the same registry, queue order included."""
        before = (self.registry.statuses(), self.registry.snapshot(), self.registry.free_slots)
        self.registry = AdapterRegistry.from_state(self.registry.export_state(), N_SLOTS, completed_retention=4,
                                                   queue_size=QUEUE_SIZE)
        assert (self.registry.statuses(), self.registry.snapshot(), self.registry.free_slots) == before

    @rule(name=NAMES, stale=st.booleans())
    def fail(self, name: str, stale: bool) -> None:
        before = self.registry.state(name)
        registration = self.registry.registration_id(name)
        failure = AdapterFailure(reason=FailureReason.ERRORS, error_type="E", message="m", groups=1)
        failed = self.registry.fail(name, "stale" if stale or registration is None else registration, failure)
        moved = not stale and before in (AdapterState.ACTIVE, AdapterState.RETIRING)
        assert failed == moved
        assert self.registry.state(name) is (AdapterState.CLEANUP if moved else before)
        self._expect_no_progress()

    @rule(names=st.lists(NAMES, unique=True, max_size=3))
    def push(self, names: list[str]) -> None:
        pending = set(self.registry.snapshot().pending)
        self.registry.record_weight_update(names)
        for name in pending & set(names):
            assert self.registry.state(name) is AdapterState.ACTIVE
        self._expect_no_progress()

    @rule(data=st.data(), commit=st.booleans())
    def batch(self, data: st.DataObject, commit: bool) -> None:
        live = sorted(self.registry.live_slots())
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True) if live else st.just([]))
        groups = {n: data.draw(st.integers(1, 4)) for n in chosen}
        step_names = data.draw(st.lists(st.sampled_from(chosen), unique=True) if chosen else st.just([]))
        self.rollout_id += 1
        self.registry.record_batch_adapters(self.rollout_id, groups, step_names)
        if not commit:  # the train call failed: nothing may move
            self._expect_no_progress()
            return
        countable = {n for n in chosen if self.registry.state(n) in
                     (AdapterState.ACTIVE, AdapterState.RETIRING, AdapterState.CLEANUP)}
        stepped = self.registry.mark_batch_trained(self.rollout_id)
        assert set(stepped) == set(step_names) & countable
        after = self._progress()
        for (name, reg), (step, accumulated) in after.items():
            old_step, old_groups = self.progress.get((name, reg), (0, 0))
            if name in stepped:
                assert (step, accumulated) == (old_step + 1, 0)
            elif name in countable:
                assert (step, accumulated) == (old_step, old_groups + groups[name])
            else:
                assert (step, accumulated) == (old_step, old_groups)
        self.progress = after

    @invariant()
    def slots_partition_the_table(self) -> None:
        live = self.registry.live_slots()
        assert len(set(live.values())) == len(live)
        assert set(live.values()).isdisjoint(self.registry.free_slots)
        assert len(live) + len(self.registry.free_slots) == N_SLOTS

    @invariant()
    def versions_never_decrease(self) -> None:
        current = self.registry.slot_versions
        assert all(new >= old for new, old in zip(current, self.versions))
        self.versions = current

    @invariant()
    def completed_hold_no_slot(self) -> None:
        snapshot = self.registry.snapshot()
        assert snapshot.completed.isdisjoint(snapshot.failed)
        assert (snapshot.completed | snapshot.failed).isdisjoint(self.registry.live_slots())
        for name in snapshot.completed | snapshot.failed:
            status = self.registry.status(name)
            assert status.version is None and (status.last_error is None) == (status.state is AdapterState.COMPLETED)
        assert snapshot.all_adapters_cleaned_up == (not self.registry.live_slots() and not self.queue)

    @invariant()
    def the_queue_follows_its_model_and_holds_no_slot(self) -> None:
        queued = self.registry.snapshot().queued
        assert list(queued) == [name for name, _ in self.queue]
        assert not (queued and self.registry.free_slots), "a slot is free while registrations wait"
        assert set(queued).isdisjoint(self.registry.live_slots())
        for position, (name, priority) in enumerate(self.queue, start=1):
            status = self.registry.status(name)
            assert (status.state, status.slot, status.version, status.queue_position, status.priority) == (
                AdapterState.QUEUED, None, None, position, priority)


    @invariant()
    def the_store_reads_back_as_the_registry(self) -> None:
        self.store.write_through(self.registry)
        state = self.reader.load()
        assert state is not None
        restored = AdapterRegistry.from_state(state, N_SLOTS, completed_retention=4, queue_size=QUEUE_SIZE)
        assert restored.export_state() == self.registry.export_state()

    def teardown(self) -> None:
        self.store.close()
        self.reader.close()
        self.directory.cleanup()


TestRegistryStateMachine = RegistryMachine.TestCase
TestRegistryStateMachine.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
