"""Collection rules of DESIGN §8, one by one, with hand-filled buffers and a fake clock."""

from __future__ import annotations

import pytest

from miles.rollout.buffers import AdapterBuffers, GroupBuffer
from miles.rollout.collection import BatchCollector, CollectionConfig, EmptyBatchTimeoutError
from miles.utils.types import DropReason, SampleStatus
from tests.helpers.rollout_fakes import FakeClock, FakeController, FakeProducer, active, make_group, make_run


def collector(controller, *, target: int, dp: int = 1, staleness: int | None = None,
              coalesce: float = 0.5, empty: float = 5.0):
    config = CollectionConfig(global_batch_size=target, dp_size=dp, max_weight_staleness=staleness,
                              max_coalesce_wait_s=coalesce, max_empty_wait_s=empty)
    buffers, clock, producer = AdapterBuffers(), FakeClock(), FakeProducer()
    return BatchCollector(config, buffers, controller, producer, clock), buffers, clock, producer


def fill(buffers, run, indices, **kwargs):
    for i in indices:
        buffers.put(make_group(run, i, **kwargs))


async def test_no_pop_before_a_whole_multiple_is_buffered():
    a = make_run("a", 0, n_samples=1)  # dp 2, n 1 -> units of 2 groups
    c, buffers, clock, _ = collector(FakeController(active(a)), target=2, dp=2)
    fill(buffers, a, [0])
    clock.at(0.3, lambda: fill(buffers, a, [1]))
    batch = await c.collect(0)
    assert clock.t == pytest.approx(0.3, abs=0.02)
    assert batch.groups_per_adapter == {"a": 2}
    assert len(buffers.get("a")) == 0


async def test_a_lone_group_below_the_multiple_is_never_popped():
    a = make_run("a", 0, n_samples=1)
    c, buffers, clock, _ = collector(FakeController(active(a)), target=2, dp=2, empty=1.0)
    fill(buffers, a, [0])
    with pytest.raises(EmptyBatchTimeoutError):
        await c.collect(0)
    assert len(buffers.get("a")) == 1


async def test_stops_at_the_target_without_waiting():
    a = make_run("a", 0, n_samples=2)
    controller = FakeController(active(a))
    c, buffers, clock, _ = collector(controller, target=4)
    fill(buffers, a, range(4))
    batch = await c.collect(3)
    assert clock.t == 0.0
    assert len(batch.samples) == 4 and batch.prompt_group_sizes == [2, 2]
    assert len(buffers.get("a")) == 2
    assert controller.records == [(3, {"a": 2}, [])]


async def test_ships_below_target_after_the_coalesce_wait():
    a = make_run("a", 0, n_samples=2)
    c, buffers, clock, _ = collector(FakeController(active(a)), target=8, coalesce=0.5)
    fill(buffers, a, [0])
    clock.at(0.3, lambda: fill(buffers, a, [1]))  # progress restarts the wait
    batch = await c.collect(0)
    assert clock.t == pytest.approx(0.8, abs=0.02)
    assert batch.groups_per_adapter == {"a": 2}


async def test_remaining_group_cap_and_step_names():
    a = make_run("a", 0, rollout_batch_size=4, accumulated=3)
    b = make_run("b", 1, rollout_batch_size=4, accumulated=0)
    controller = FakeController(active(a, b))
    c, buffers, clock, _ = collector(controller, target=100, coalesce=0.2)
    fill(buffers, a, range(5))
    fill(buffers, b, range(2))
    batch = await c.collect(7)
    assert batch.groups_per_adapter == {"a": 1, "b": 2}
    assert batch.step_names == ["a"]
    assert controller.records == [(7, {"a": 1, "b": 2}, ["a"])]
    assert len(buffers.get("a")) == 4


async def test_full_batch_ships_at_once_when_every_adapter_is_capped():
    a = make_run("a", 0, rollout_batch_size=2)
    c, buffers, clock, _ = collector(FakeController(active(a)), target=100, coalesce=5.0)
    fill(buffers, a, range(3))
    batch = await c.collect(0)
    assert clock.t == 0.0 and batch.step_names == ["a"] and batch.groups_per_adapter == {"a": 2}


@pytest.mark.parametrize("given_up_at, shipped_at", [(None, 0.5), (0.0, 0.0), (0.2, 0.2)])
async def test_an_adapter_the_producer_gave_up_on_is_not_waited_for(given_up_at, shipped_at):
    """`good`'s step is all buffered; `bad` only fails. Without the producer giving up, the
    batch waits the coalesce time for `bad`; once it has given up (before or during the
    collection, whose snapshot still lists `bad`) it ships at once."""
    good, bad = make_run("good", 0, rollout_batch_size=2), make_run("bad", 1, rollout_batch_size=2)
    c, buffers, clock, producer = collector(FakeController(active(good, bad)), target=100, coalesce=0.5)
    fill(buffers, good, range(2))
    fill(buffers, bad, [0])  # from before it failed: taken only while not given up
    if given_up_at is not None:
        clock.at(given_up_at, lambda: producer.given_up.add("reg-bad"))
    if given_up_at == 0.0:
        producer.given_up.add("reg-bad")
    batch = await c.collect(0)
    assert clock.t == pytest.approx(shipped_at, abs=0.02)
    assert batch.groups_per_adapter == ({"good": 2} if given_up_at == 0.0 else {"good": 2, "bad": 1})


async def test_with_only_given_up_adapters_the_collection_ends_at_once():
    bad = make_run("bad", 0)
    c, _, clock, producer = collector(FakeController(active(bad)), target=8, empty=30.0)
    clock.at(0.2, lambda: producer.given_up.add("reg-bad"))
    with pytest.raises(EmptyBatchTimeoutError, match=r"gave up on every sampleable adapter \(bad\)"):
        await c.collect(0)
    assert clock.t == pytest.approx(0.2, abs=0.02)


async def test_no_overshoot_across_fetches():
    a = make_run("a", 0, rollout_batch_size=3)
    c, buffers, clock, _ = collector(FakeController(active(a)), target=100, coalesce=1.0)
    for when, index in [(0.1, 0), (0.2, 1), (0.3, 2), (0.4, 3), (0.5, 4)]:
        clock.at(when, lambda i=index: fill(buffers, a, [i]))
    batch = await c.collect(0)
    assert batch.groups_per_adapter == {"a": 3} and batch.step_names == ["a"]
    assert [s.group_index for s in batch.samples] == [0, 1, 2]


async def test_never_more_samples_than_the_global_batch():
    a = make_run("a", 0, n_samples=2)
    b = make_run("b", 1, n_samples=4)
    c, buffers, clock, _ = collector(FakeController(active(a, b)), target=4, coalesce=0.3)
    fill(buffers, a, [0])
    fill(buffers, b, range(3))
    batch = await c.collect(0)
    assert len(batch.samples) == 2 and batch.groups_per_adapter == {"a": 1}
    assert clock.t == pytest.approx(0.3, abs=0.02)
    batch = await c.collect(1)  # a unit may fill an empty batch exactly
    assert batch.groups_per_adapter == {"b": 1} and len(batch.samples) == 4


async def test_round_robin_interleaves_adapters(monkeypatch):
    """One unit per turn, adapter after adapter: a's first group, b's, a's next, b's next."""
    popped = []
    pop = GroupBuffer.pop

    def recording_pop(buffer, n_groups):
        taken = pop(buffer, n_groups)
        popped.extend((group.adapter, group.samples[0].group_index) for group in taken)
        return taken

    monkeypatch.setattr(GroupBuffer, "pop", recording_pop)
    a, b = make_run("a", 0), make_run("b", 1)
    c, buffers, _, _ = collector(FakeController(active(a, b)), target=4)
    fill(buffers, a, range(4))
    fill(buffers, b, range(4))
    batch = await c.collect(0)
    assert popped == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert batch.groups_per_adapter == {"a": 2, "b": 2}


async def test_cursor_persists_across_batches():
    runs = [make_run(name, slot) for slot, name in enumerate("abc")]
    c, buffers, _, _ = collector(FakeController(active(*runs)), target=1)
    for run in runs:
        fill(buffers, run, range(4))
    served = [list((await c.collect(i)).groups_per_adapter) for i in range(5)]
    assert served == [["a"], ["b"], ["c"], ["a"], ["b"]]


async def test_retiring_adapter_is_still_collected():
    a = make_run("a", 0)
    c, buffers, _, _ = collector(FakeController(active(retiring=(a,))), target=2)
    fill(buffers, a, range(2))
    assert (await c.collect(0)).groups_per_adapter == {"a": 2}


async def test_retired_adapters_buffer_is_discarded():
    a, gone = make_run("a", 0), make_run("gone", 1)
    c, buffers, _, _ = collector(FakeController(active(a)), target=2)
    fill(buffers, gone, range(4))
    fill(buffers, a, range(2))
    batch = await c.collect(0)
    assert batch.groups_per_adapter == {"a": 2}
    assert "gone" not in buffers.names()


async def test_stale_groups_are_dropped_and_counted():
    a = make_run("a", 0, version=5)
    c, buffers, clock, _ = collector(FakeController(active(a)), target=100, staleness=1, coalesce=0.1)
    for index, version in enumerate([3, 4, 5, 2]):
        buffers.put(make_group(a, index, version=version))
    batch = await c.collect(0)
    assert sorted(s.group_index for s in batch.samples) == [1, 2]
    assert batch.group_versions == [4, 5]  # each kept group's submission version, in batch order
    assert batch.per_adapter["a"].dropped == {DropReason.STALE: 2, DropReason.FOREIGN: 0}
    assert batch.stats.dropped[DropReason.STALE] == 2
    assert batch.stats.to_metrics()["perf/rollout/stale_dropped"] == 2.0
    assert batch.per_adapter["a"].to_metrics()["perf/stale_dropped"] == 2.0


async def test_empty_timeout_raises():
    a = make_run("a", 0)
    c, _, clock, _ = collector(FakeController(active(a)), target=2, empty=2.0)
    with pytest.raises(EmptyBatchTimeoutError, match=r"^No poppable groups collected before empty timeout"):
        await c.collect(0)
    assert clock.t == pytest.approx(2.0, abs=0.02)
    assert issubclass(EmptyBatchTimeoutError, RuntimeError)


async def test_reregistration_drops_old_buffer_and_stragglers():
    old = make_run("a", 0, registration_id="r1")
    controller = FakeController(active(old))
    c, buffers, clock, _ = collector(controller, target=2, coalesce=0.1)
    fill(buffers, old, range(3))
    assert (await c.collect(0)).groups_per_adapter == {"a": 2}
    new = make_run("a", 2, registration_id="r2")
    fill(buffers, new, [5])  # the new registration produced before this collection
    controller.current = active(new)
    clock.at(clock.t + 0.05, lambda: fill(buffers, old, [10]))  # a straggler of the old registration
    clock.at(clock.t + 0.1, lambda: fill(buffers, new, [0]))
    batch = await c.collect(1)
    assert [(s.slot, s.group_index) for s in batch.samples] == [(2, 0), (2, 5)]
    assert len(buffers.get("a")) == 0
    # Every group of the old registration is dropped and counted: the one left in the
    # buffer when the re-registration is first seen, and the straggler that arrives later.
    assert batch.per_adapter["a"].dropped[DropReason.FOREIGN] == 2
    assert batch.stats.dropped == {DropReason.STALE: 0, DropReason.FOREIGN: 2}


async def test_dead_producer_raises_immediately_chained_from_the_cause():
    a = make_run("a", 0)
    c, _, clock, producer = collector(FakeController(active(a)), target=2, empty=30.0)
    cause = ConnectionError("router gone")
    producer.failure = cause
    with pytest.raises(RuntimeError) as info:
        await c.collect(0)
    assert info.value.__cause__ is cause and clock.t == 0.0


async def test_producer_dying_mid_wait_raises_without_waiting_for_the_timeout():
    a = make_run("a", 0)
    c, _, clock, producer = collector(FakeController(active(a)), target=2, empty=30.0)
    cause = ValueError("bad dataset row")
    clock.at(0.2, lambda: setattr(producer, "failure", cause))
    with pytest.raises(RuntimeError) as info:
        await c.collect(0)
    assert info.value.__cause__ is cause and clock.t == pytest.approx(0.2, abs=0.02)


async def test_samples_ordered_by_slot_group_and_index_with_metrics():
    a = make_run("a", 3, n_samples=2)
    b = make_run("b", 1, n_samples=3)
    c, buffers, _, _ = collector(FakeController(active(a, b)), target=10)
    for index in (5, 2):
        group = make_group(a, index, rewards=[1.0, 0.0])
        group.samples[0].rollout_log_probs = [-0.5]  # sample 0 has one response token, sample 1 two
        group.samples[1].rollout_log_probs = [-0.5, -1.5]
        group.samples.reverse()
        buffers.put(group)
    fill(buffers, b, [9, 4])
    batch = await c.collect(0)
    assert [(s.slot, s.group_index, s.index) for s in batch.samples] == [
        (1, 4, 0), (1, 4, 1), (1, 4, 2), (1, 9, 0), (1, 9, 1), (1, 9, 2),
        (3, 2, 0), (3, 2, 1), (3, 5, 0), (3, 5, 1),
    ]
    assert batch.prompt_group_sizes == [3, 3, 2, 2]
    assert batch.per_adapter["a"].raw_reward_mean == 0.5
    assert batch.per_adapter["b"].response_len_mean == 2.0  # responses of 1, 2, 3 tokens
    # Miles' log_probs: the mean over samples of each sample's mean engine logprob.
    assert batch.per_adapter["a"].to_metrics()["log_probs"] == pytest.approx((-0.5 - 1.0 - 0.5 - 1.0) / 4)
    assert "log_probs" not in batch.per_adapter["b"].to_metrics()  # its samples carry no engine logprobs
    assert (batch.per_adapter["a"].groups, batch.per_adapter["b"].groups) == (2, 2)
    assert batch.stats.batch_n_samples == 10 and batch.stats.batch_n_groups == 4


async def test_stale_and_foreign_drops_are_counted_per_adapter_and_reason_then_reset():
    """Both ways a group becomes unusable (too old, other registration), found when the
    batch starts and while it waits, counted once each and reported with the next batch."""
    a = make_run("a", 0, version=4, registration_id="r2")
    b = make_run("b", 1, version=4)
    c, buffers, clock, _ = collector(FakeController(active(a, b)), target=100, staleness=1, coalesce=0.2)
    buffers.put(make_group(a, 0, version=4, registration_id="r1"))  # foreign, buffered before collect
    buffers.put(make_group(a, 1, version=2))                        # stale, buffered before collect
    buffers.put(make_group(b, 0, version=1))                        # stale, of the other adapter
    fill(buffers, a, [2])                                           # usable
    fill(buffers, b, [1])                                           # usable
    clock.at(0.05, lambda: buffers.put(make_group(a, 3, version=4, registration_id="r1")))  # foreign straggler
    clock.at(0.1, lambda: buffers.put(make_group(a, 4, version=1)))  # stale arrival
    clock.at(0.1, lambda: fill(buffers, a, [5]))                     # usable arrival
    batch = await c.collect(0)
    assert [(s.adapter, s.group_index) for s in batch.samples] == [("a", 2), ("a", 5), ("b", 1)]
    assert batch.per_adapter["a"].dropped == {DropReason.STALE: 2, DropReason.FOREIGN: 2}
    assert batch.per_adapter["b"].dropped == {DropReason.STALE: 1, DropReason.FOREIGN: 0}
    assert batch.stats.dropped == {DropReason.STALE: 3, DropReason.FOREIGN: 2}
    assert batch.per_adapter["a"].to_metrics()["perf/foreign_dropped"] == 2.0
    assert all(len(buffers.get(name)) == 0 for name in "ab")
    fill(buffers, a, [6])
    batch = await c.collect(1)  # counts are per batch
    assert batch.per_adapter["a"].dropped == {DropReason.STALE: 0, DropReason.FOREIGN: 0}
    assert batch.stats.dropped == {DropReason.STALE: 0, DropReason.FOREIGN: 0}


async def test_a_snapshot_passed_in_is_used_instead_of_reading_the_controller():
    a = make_run("a", 0)
    controller = FakeController(active())  # the controller's own view has no adapter
    c, buffers, _, _ = collector(controller, target=2)
    fill(buffers, a, range(2))
    batch = await c.collect(0, active(a))
    assert batch.groups_per_adapter == {"a": 2}
    assert controller.records == [(0, {"a": 2}, [])]


async def test_per_adapter_rollout_numbers_with_miles_names():
    """Rewards, trained-on lengths, truncation, zero-std groups and staleness of one batch,
    computed from hand-made groups; the second adapter's numbers stay its own."""
    a = make_run("a", 0, n_samples=3, version=5)
    b = make_run("b", 1, n_samples=2, version=2)
    controller = FakeController(active(a, b))
    c, buffers, _, _ = collector(controller, target=100, coalesce=0.1)
    buffers.put(make_group(a, 0, version=5, rewards=[1.0, 1.0, 1.0]))  # all one, fresh
    buffers.put(make_group(a, 1, version=3, rewards=[0.0, 0.0, 0.0]))  # all zero, 2 pushes old
    mixed = make_group(a, 2, version=4, rewards=[0.0, 1.0, 0.5])        # 1 push old
    mixed.samples[1].status = SampleStatus.TRUNCATED
    mixed.samples[2].loss_mask = [1, 0, 0]                              # a tool output of 2 tokens
    buffers.put(mixed)
    buffers.put(make_group(b, 0, rewards=[0.2, 0.2]))
    batch = await c.collect(0)
    m = batch.per_adapter["a"].to_metrics()
    # Rewards 1,1,1, 0,0,0, 0,1,0.5; lengths 1,2,3 per group, the masked one counts 1 token.
    assert m["raw_reward_mean"] == pytest.approx(4.5 / 9)
    assert (m["raw_reward_median"], m["raw_reward_max"], m["raw_reward_min"]) == (0.5, 1.0, 0.0)
    assert m["response_len_mean"] == pytest.approx(16 / 9)
    assert (m["response_len_median"], m["response_len_max"], m["response_len_min"]) == (2.0, 3.0, 1.0)
    assert m["truncated_ratio"] == pytest.approx(1 / 9)
    assert m["zero_std_all_zero_percentage"] == pytest.approx(1 / 3)
    assert m["zero_std_all_one_percentage"] == pytest.approx(1 / 3)
    assert (m["avg_staleness"], m["max_staleness"]) == (1.0, 2.0)
    mb = batch.per_adapter["b"].to_metrics()
    # A uniform group of 0.2 is neither all-zero nor all-one.
    assert (mb["zero_std_all_zero_percentage"], mb["zero_std_all_one_percentage"]) == (0.0, 0.0)
    assert mb["raw_reward_mean"] == pytest.approx(0.2) and mb["truncated_ratio"] == 0.0
    assert batch.stats.to_metrics()["perf/rollout/batch_n_adapters_to_step"] == 0.0


async def test_adapters_to_step_counts_the_adapters_this_batch_completes():
    a = make_run("a", 0, rollout_batch_size=2, accumulated=1)
    b = make_run("b", 1, rollout_batch_size=4)
    c, buffers, _, _ = collector(FakeController(active(a, b)), target=100, coalesce=0.1)
    fill(buffers, a, [0])
    fill(buffers, b, [0, 1])
    batch = await c.collect(0)
    assert batch.step_names == ["a"] and batch.stats.batch_n_adapters_to_step == 1
    # No group of an adapter in the batch: no sample statistics for it, only counters.
    idle = make_run("idle", 2)
    c2, _, _, _ = collector(FakeController(active(a, idle)), target=100, coalesce=0.1)
    fill(c2.buffers, a, [1])
    metrics = (await c2.collect(1)).per_adapter["idle"].to_metrics()
    assert not any(k.startswith(("raw_reward", "response_len", "zero_std", "truncated")) for k in metrics)
    assert metrics["perf/groups"] == 0.0
