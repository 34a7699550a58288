"""The producer against a fake SGLang-shaped server on loopback: request shape, stamps
taken at submission, whole-group abort drops, round robin under the in-flight cap,
filtering, death on engine errors surfacing through `raise_if_failed`, and an adapter whose
reward, generate function or filter fails every group given up alone beside a healthy one."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import sys
import textwrap

import aiohttp
import pytest

from miles.recipes.tiny_model import build_char_tokenizer
from miles.rollout.adapter_health import AdapterLimits
from miles.rollout.buffers import AdapterBuffers
from miles.rollout.collection import BatchCollector, CollectionConfig
from miles.rollout.data_source import DataSourceConfig, MultiLoRADataSource
from miles.rollout.producer import ProducerConfig, ProducerDiedError, RolloutProducer
from miles.utils.types import GenerationCounts, SampleStatus, engine_lora_name
from tests.helpers.rollout_fakes import FakeController, FakeEngineServer, active, make_run
from tests.helpers.waiting import wait_until_async


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i}+{i}=", "label": "12"}) + "\n" for i in range(4)))
    return str(path)


def run_for(dataset, name, slot, **kwargs):
    return make_run(name, slot, data=dataset, input_key="text", label_key="label", rm_type="final_number", **kwargs)


def producer(server, controller, *, in_flight=4, engines_serving=None, **config):
    tokenizer = build_char_tokenizer()
    source = MultiLoRADataSource(DataSourceConfig(seed=0, apply_chat_template=False, default_rm_type=None),
                                 tokenizer)
    cfg = ProducerConfig(max_groups_in_flight=in_flight, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=-1,
                         stop=("\n",), snapshot_poll_s=0.02, **config)
    buffers = AdapterBuffers()
    prod = RolloutProducer(cfg, router_url=server.url, controller=controller, data_source=source,
                           buffers=buffers, lora_name=engine_lora_name, reward_args=None,
                           engines_serving=engines_serving)
    return prod, buffers, tokenizer


async def test_requests_and_groups_have_the_sglang_shape(dataset):
    a = run_for(dataset, "a", 3, n_samples=2)
    controller = FakeController(active(a))
    async with FakeEngineServer("so 12") as server:
        prod, buffers, tokenizer = producer(server, controller, in_flight=1)
        prod.start()
        await wait_until_async(lambda: len(buffers.get("a")) >= 2, 10, "two groups")
        await prod.stop()
    request = server.requests[0]
    assert re.fullmatch(r"a::[0-9a-f]{32}", request["rid"])
    assert len({r["rid"] for r in server.requests}) == len(server.requests)
    assert request["lora_path"] == "__miles_slot_3" and request["return_logprob"] is True
    assert request["sampling_params"] == {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                          "stop": ["\n"]}
    group = buffers.get("a").pop(1)[0]
    assert (group.adapter, group.slot, group.version, group.registration_id) == ("a", 3, 1, "reg-a")
    assert [s.index for s in group.samples] == [0, 1]
    sample = group.samples[0]
    assert request["input_ids"] == tokenizer.encode(sample.prompt)
    assert sample.response == "so 12" and sample.response_ids == [5, 6]
    assert sample.rollout_logprobs == [-0.5, -0.25] and sample.status is SampleStatus.COMPLETED
    assert sample.reward == 1.0 and sample.label == "12"


async def test_stamp_is_the_version_at_submission_not_at_completion(dataset):
    a = run_for(dataset, "a", 0, version=1)
    controller = FakeController(active(a))
    async with FakeEngineServer() as server:
        server.gate.clear()
        prod, buffers, _ = producer(server, controller, in_flight=1)
        prod.start()
        await wait_until_async(lambda: len(server.requests) == 1, 10, "first request")
        controller.current = active(dataclasses.replace(a, version=2))  # a push lands mid-generation
        await wait_until_async(lambda: prod._snapshot.active["a"].version == 2, 10, "producer sees version 2")
        server.gate.set()
        await wait_until_async(lambda: len(buffers.get("a")) >= 2, 10, "two groups")
        await prod.stop()
    first, second = buffers.get("a").pop(2)
    assert (first.version, second.version) == (1, 2)


async def test_group_with_an_aborted_sample_is_dropped_whole(dataset):
    a = run_for(dataset, "a", 0, n_samples=2)
    controller = FakeController(active(a))
    async with FakeEngineServer() as server:
        server.gate.clear()
        prod, buffers, _ = producer(server, controller, in_flight=1)
        prod.start()
        await wait_until_async(lambda: len(server.requests) == 2, 10, "both requests of the group")
        server.aborted_prefixes.append(server.requests[1]["rid"])  # abort one sample only
        server.gate.set()
        await wait_until_async(lambda: prod.count("aborted") == 1 and len(buffers.get("a")) >= 2, 10, "later groups")
        await prod.stop()
    groups = buffers.get("a").pop(len(buffers.get("a")))
    assert 0 not in [g.samples[0].group_index for g in groups]  # the first prompt's group is gone
    assert all(s.status is SampleStatus.COMPLETED for g in groups for s in g.samples)


async def test_round_robin_under_the_in_flight_cap(dataset):
    a, b = run_for(dataset, "a", 0, n_samples=2), run_for(dataset, "b", 1, n_samples=2)
    controller = FakeController(active(a, b))
    async with FakeEngineServer() as server:
        server.gate.clear()
        prod, _, _ = producer(server, controller, in_flight=2)
        prod.start()
        await wait_until_async(lambda: len(server.requests) == 4, 10, "two groups of two")
        # Nothing beyond the cap is submitted while all are in flight: each round of the producer
        # reads the snapshot, then submits; two more reads mean a full round ran with the cap reached.
        reads = controller.snapshot_reads
        await wait_until_async(lambda: controller.snapshot_reads >= reads + 2, 10, "two more producer rounds")
        assert prod.count("submitted") == 2 and len(server.requests) == 4
        adapters = sorted(r["rid"].split("::")[0] for r in server.requests)
        assert adapters == ["a", "a", "b", "b"]
        assert {r["lora_path"] for r in server.requests} == {"__miles_slot_0", "__miles_slot_1"}
        assert prod.generation_counts("a").in_flight == 1 and prod.generation_counts("b").in_flight == 1
        assert prod.generation_counts() == GenerationCounts(submitted=2, in_flight=2)
        await prod.stop()


@pytest.fixture
def filter_module(tmp_path, monkeypatch):
    (tmp_path / "my_filters.py").write_text(textwrap.dedent("""
        def keep_none(args, samples):
            return False
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_filters", None)


async def test_dynamic_filter_drops_groups(dataset, filter_module):
    a = run_for(dataset, "a", 0)
    async with FakeEngineServer() as server:
        prod, buffers, _ = producer(server, FakeController(active(a)), dynamic_filter_path="my_filters.keep_none")
        prod.start()
        await wait_until_async(lambda: prod.count("filtered") >= 3, 10, "filtered groups")
        await prod.stop()
    assert len(buffers.get("a")) == 0 and prod.count("produced") == 0


async def test_repeated_failures_kill_the_producer_and_surface_the_cause(dataset):
    a = run_for(dataset, "a", 0)
    async with FakeEngineServer() as server:
        server.status_code = 500
        prod, _, _ = producer(server, FakeController(active(a)), max_consecutive_failures=2)
        prod.start()
        await wait_until_async(lambda: prod.failure is not None, 10, "producer death")
        with pytest.raises(ProducerDiedError) as info:
            prod.raise_if_failed()
        assert isinstance(info.value.__cause__, aiohttp.ClientResponseError)
        await prod.stop()


async def test_groups_that_fail_while_no_engine_serves_do_not_count_toward_death(dataset):
    serving = {"now": True}
    async with FakeEngineServer() as server:
        prod, _, _ = producer(server, FakeController(active(run_for(dataset, "a", 0))), max_consecutive_failures=2,
                              engines_serving=lambda: serving["now"])

        async def lost_engine():
            raise aiohttp.ClientConnectionError("the engine went away")

        failed = asyncio.ensure_future(lost_engine())
        await asyncio.gather(failed, return_exceptions=True)
        serving["now"] = False  # every engine restarting: any number of failures is not the groups' fault
        run = run_for(dataset, "a", 0)
        for _ in range(3):
            await prod._settle(failed, run)
        serving["now"] = True
        await prod._settle(failed, run)  # 1 of 2
        with pytest.raises(aiohttp.ClientConnectionError):
            await prod._settle(failed, run)


@pytest.mark.parametrize("reward_key, response, reward", [("score", "Answer: 12", 1.0), ("score", "Answer: 7", -1.0),
                                                          ("acc", "Answer: 12", 1.0)])
async def test_reward_key_picks_the_reward_of_a_dict_reward(dataset, reward_key, response, reward):
    a = run_for(dataset, "a", 0, n_samples=2)
    a = dataclasses.replace(a, config=a.config.model_copy(update={"rm_type": "dapo"}))
    async with FakeEngineServer(response) as server:
        prod, buffers, _ = producer(server, FakeController(active(a)), in_flight=1, reward_key=reward_key)
        prod.start()
        await wait_until_async(lambda: len(buffers.get("a")) >= 1, 10, "a group")
        await prod.stop()
    group = buffers.get("a").pop(1)[0]
    assert [s.reward for s in group.samples] == [reward, reward]


async def test_a_dict_reward_without_reward_key_fails_the_adapter_naming_the_flag(dataset):
    a = run_for(dataset, "a", 0)
    a = dataclasses.replace(a, config=a.config.model_copy(update={"rm_type": "dapo"}))
    controller = FakeController(active(a))
    async with FakeEngineServer("Answer: 12") as server:
        prod, _, _ = producer(server, controller, adapter_limits=AdapterLimits(max_failures=1))
        prod.start()
        await wait_until_async(lambda: controller.failures, 10, "the adapter failed")
        await prod.stop()
    [(name, _, failure)] = controller.failures
    assert name == "a" and "set --reward-key" in failure.message and prod.failure is None


@pytest.fixture
def group_reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_group_rewards.py").write_text(textwrap.dedent("""
        CALLS = []

        def rank_in_group(args, samples):
            if not isinstance(samples, list):  # called with one sample
                CALLS.append(1)
                return {"r": 5.0}
            CALLS.append(len(samples))
            return [{"r": float(i)} for i in range(len(samples))]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_group_rewards", None)


@pytest.mark.parametrize("group_rm", [True, False])
async def test_group_rm_scores_the_whole_group_with_one_call(dataset, group_reward_module, group_rm):
    a = run_for(dataset, "a", 0, n_samples=3)
    a = dataclasses.replace(a, config=a.config.model_copy(update={"custom_rm_path": "my_group_rewards.rank_in_group"}))
    async with FakeEngineServer() as server:
        prod, buffers, _ = producer(server, FakeController(active(a)), in_flight=1, group_rm=group_rm,
                                    reward_key="r", max_consecutive_failures=1)
        prod.start()
        await wait_until_async(lambda: len(buffers.get("a")) >= 1, 10, "a group")
        await prod.stop()
    calls = sys.modules["my_group_rewards"].CALLS
    rewards = [s.reward for s in buffers.get("a").pop(1)[0].samples]
    if group_rm:
        assert rewards == [0.0, 1.0, 2.0] and set(calls) == {3}  # one call per group, with all its samples
    else:  # without --group-rm the custom reward is called per sample
        assert rewards == [5.0, 5.0, 5.0] and set(calls) == {1}


async def test_an_adapter_deregistered_before_its_first_push_is_never_sampled(dataset):
    """PENDING -> RETIRING (DELETE before the first push): the engines never held its weights."""
    a, b = run_for(dataset, "a", 0), run_for(dataset, "b", 1)
    controller = FakeController(active(a, retiring=(b,)))
    async with FakeEngineServer() as server:
        prod, buffers, _ = producer(server, controller, in_flight=2)
        prod.start()
        await wait_until_async(lambda: len(buffers.get("a")) >= 3, 10, "three groups of a")
        assert {r["lora_path"] for r in server.requests} == {"__miles_slot_0"}
        # An adapter seen ACTIVE keeps generating while RETIRING, as before.
        controller.current = active(retiring=(a,))
        buffers.discard("a")  # its next step is no longer covered: the producer submits again
        served = len(server.requests)
        await wait_until_async(lambda: len(server.requests) > served + 2, 10, "a's requests while retiring")
        await prod.stop()
    assert not buffers.get("b") and {r["lora_path"] for r in server.requests} == {"__miles_slot_0"}


@pytest.fixture
def broken_plugins(tmp_path, monkeypatch):
    """A reward, a generate function and a dynamic filter that fail on every group."""
    (tmp_path / "broken_plugins.py").write_text(textwrap.dedent("""
        class RewardServiceDown(RuntimeError):
            pass

        def raising_reward(args, sample):
            raise RewardServiceDown("reward service said 503 " + "x" * 3000)

        async def raising_generate(input):
            raise KeyError("tool 'calculator' is not registered")

        def drop_all(args, samples):
            return False
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("broken_plugins", None)


BROKEN = {
    "reward": ({"custom_rm_path": "broken_plugins.raising_reward"}, "broken_plugins.RewardServiceDown",
               "reward service said 503"),
    "generate": ({"custom_generate_function_path": "broken_plugins.raising_generate"}, "KeyError",
                 "tool 'calculator' is not registered"),
    "filter": ({"dynamic_sampling_filter_path": "broken_plugins.drop_all"}, None,
               "its dynamic sampling filter dropped 5 prompt groups in a row (by reason: unspecified: 5)"),
}


@pytest.mark.parametrize("plugin", sorted(BROKEN))
async def test_an_adapter_whose_plugin_fails_every_group_fails_alone(dataset, broken_plugins, plugin, caplog):
    """`bad` is given up after its limit, once, with its error; nothing more is generated for
    it, `good` beside it goes on producing, and its steps are collected without waiting for
    `bad` (even against a snapshot from before the failure); the log has one line per failure
    episode."""
    update, error_type, message = BROKEN[plugin]
    good, bad = run_for(dataset, "good", 0), run_for(dataset, "bad", 1)
    bad = dataclasses.replace(bad, config=bad.config.model_copy(update=update))
    controller = FakeController(active(good, bad))
    caplog.set_level(logging.INFO, logger="miles.rollout")
    async with FakeEngineServer() as server:
        prod, buffers, _ = producer(server, controller, in_flight=4, buffer_steps=None,
                                    adapter_limits=AdapterLimits(max_failures=5, max_filtered=5))
        prod.start()
        await wait_until_async(lambda: controller.failures, 10, "bad to be failed")
        assert prod.gave_up("reg-bad") and not prod.gave_up("reg-good")
        submitted = prod.count("submitted", "bad")
        produced = prod.count("produced", "good")
        # Generation goes on for good alone; bad's last in-flight groups may still settle.
        await wait_until_async(lambda: prod.count("produced", "good") >= produced + 20, 10, "good to go on")
        assert prod.count("submitted", "bad") == submitted and prod.failure is None
        # Room for both adapters' steps and a 30 s coalesce wait: only bad could make it wait.
        collector = BatchCollector(CollectionConfig(global_batch_size=16, dp_size=1, max_weight_staleness=None,
                                                    max_coalesce_wait_s=30.0, max_empty_wait_s=30.0),
                                   buffers, controller, prod)
        for rollout_id in range(2):
            batch = await asyncio.wait_for(collector.collect(rollout_id, active(good, bad)), timeout=10)
            assert batch.groups_per_adapter == {"good": 8} and batch.step_names == ["good"]
        await prod.stop()
    [(name, registration, failure)] = controller.failures
    assert (name, registration) == ("bad", "reg-bad")
    assert failure.error_type == error_type and message in failure.message and len(failure.message) <= 1000
    assert failure.groups >= 5 and prod.count("produced", "bad") == 0
    assert len(buffers.get("bad")) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "miles.rollout.adapter_health"]
    assert len(lines) == (1 if plugin == "filter" else 2), lines  # a filter's drops are normal until the limit
    assert all("'bad'" in line and len(line) < 3000 for line in lines)
    assert "giving up on it" in lines[-1] and "Prompt group failed" not in caplog.text


async def test_an_adapter_that_recovers_before_its_limit_keeps_generating(dataset, caplog):
    """Failures that stop before the limit end their run: a later run starts counting anew."""
    a = run_for(dataset, "a", 0)
    prod, _, _ = producer(FakeEngineServer(), FakeController(active(a)), adapter_limits=AdapterLimits(max_failures=3))
    caplog.set_level(logging.INFO, logger="miles.rollout")
    for _ in range(2):
        assert prod.health.failed(a, ValueError("flaky")) is None
    prod.health.kept(a)
    assert [prod.health.failed(a, ValueError("flaky")) is None for _ in range(3)] == [True, True, False]
    assert prod.gave_up("reg-a")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("a prompt group failed" in m for m in messages) == 2  # one per run of failures
    assert sum("again after 2 failed" in m for m in messages) == 1
