"""Plug-ins written against Miles' interface run unchanged: an async reward
`fn(args, sample, **kwargs)`, Miles' own zero-std dynamic filter (DynamicFilterOutput
with a tensor `keep`), a legacy bool filter, and a rollout sample filter that sets
`remove_sample`. Drops are counted per reason in the producer's typed counts."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from miles.recipes.tiny_model import build_char_tokenizer
from miles.rollout.buffers import AdapterBuffers
from miles.rollout.data_source import DataSourceConfig, MultiLoRADataSource
from miles.rollout.filters import UNSPECIFIED_REASON
from miles.rollout.producer import ProducerConfig, RolloutProducer
from miles.utils.types import engine_lora_name
from tests.helpers.rollout_fakes import FakeController, FakeEngineServer, active, make_run
from tests.helpers.waiting import wait_until_async

# Written as a Miles user writes them (Miles' imports, names and signatures), unchanged.
MILES_PLUGINS = '''
import torch

from miles.rollout.filter_hub.base_types import DynamicFilterOutput
from miles.utils.types import Sample


async def reward_func(args, sample, **kwargs):
    if not isinstance(sample, Sample):
        raise TypeError("Sample must be an instance of Sample class.")
    assert sample.status == Sample.Status.COMPLETED
    assert sample.tokens[-sample.response_length:] == [5, 6]
    return 1.0 if sample.response.strip() == sample.label else 0.0


def check_reward_nonzero_std(args, samples, **kwargs):
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = torch.tensor(rewards, dtype=torch.float64).std() > 1e-8
    return DynamicFilterOutput(
        keep=keep,
        reason=None if keep else f"zero_std_{round(rewards[0], 1)}",
    )


def keep_nothing(args, samples):
    return False


def remove_unrewarded(args, data):
    for group in data:
        for sample in group:
            if sample.reward == 0:
                sample.remove_sample = True
'''


@pytest.fixture
def miles_plugins(tmp_path, monkeypatch):
    (tmp_path / "miles_user_plugins.py").write_text(textwrap.dedent(MILES_PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "miles_user_plugins"
    sys.modules.pop("miles_user_plugins", None)


@pytest.fixture
def dataset(tmp_path):
    # the fake engine always answers "12": prompts labelled 12 score 1, the others 0
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i}+{i}=", "label": "12" if i % 3 == 0 else "13"}) + "\n"
                            for i in range(6)))
    return str(path)


def producer(server, controller, **config):
    source = MultiLoRADataSource(DataSourceConfig(seed=0, apply_chat_template=False, default_rm_type=None),
                                 build_char_tokenizer())
    cfg = ProducerConfig(max_groups_in_flight=2, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=-1,
                         snapshot_poll_s=0.02, **config)
    buffers = AdapterBuffers()
    return RolloutProducer(cfg, router_url=server.url, controller=controller, data_source=source, buffers=buffers,
                           lora_name=engine_lora_name, reward_args=None), buffers


def run(dataset, name, slot, plugins, **kwargs):
    return make_run(name, slot, data=dataset, input_key="text", label_key="label", n_samples=2,
                    rollout_batch_size=64, custom_rm_path=f"{plugins}.reward_func", **kwargs)


async def test_miles_reward_and_zero_std_filter_count_drops_per_reason(dataset, miles_plugins):
    a = run(dataset, "a", 0, miles_plugins)
    async with FakeEngineServer("12") as server:
        prod, buffers = producer(server, FakeController(active(a)),
                                 dynamic_filter_path=f"{miles_plugins}.check_reward_nonzero_std")
        prod.start()
        await wait_until_async(lambda: prod.count("filtered", "a") >= 6, 10, "a pass over the dataset")
        await prod.stop()
    counts = prod.generation_counts("a")
    assert set(counts.filtered_by_reason) == {"zero_std_1.0", "zero_std_0.0"}
    assert sum(counts.filtered_by_reason.values()) == counts.filtered
    # one prompt in three is labelled 12; the shuffled stream still holds them in that proportion
    assert counts.filtered_by_reason["zero_std_0.0"] >= counts.filtered_by_reason["zero_std_1.0"]
    assert counts.produced == 0 and len(buffers.get("a")) == 0  # every group here has equal rewards
    metrics = counts.to_metrics("perf/")
    assert metrics["perf/dynamic_filter/drop_zero_std_1.0"] == counts.filtered_by_reason["zero_std_1.0"]


async def test_adapter_filter_wins_and_a_bool_drop_counts_as_unspecified(dataset, miles_plugins):
    a = run(dataset, "a", 0, miles_plugins, dynamic_sampling_filter_path=f"{miles_plugins}.keep_nothing")
    b = run(dataset, "b", 1, miles_plugins)
    async with FakeEngineServer("12") as server:
        prod, buffers = producer(server, FakeController(active(a, b)))
        prod.start()
        await wait_until_async(lambda: prod.count("filtered", "a") >= 2 and prod.count("produced", "b") >= 2, 10,
                               "groups of both adapters")
        await prod.stop()
    assert prod.generation_counts("a").filtered_by_reason == {UNSPECIFIED_REASON: prod.count("filtered", "a")}
    assert prod.count("produced", "a") == 0 and prod.count("filtered", "b") == 0
    assert prod.generation_counts().filtered_by_reason == {UNSPECIFIED_REASON: prod.count("filtered", "a")}


async def test_rollout_sample_filter_masks_removed_samples(dataset, miles_plugins):
    a = run(dataset, "a", 0, miles_plugins)
    async with FakeEngineServer("12") as server:
        prod, buffers = producer(server, FakeController(active(a)),
                                 rollout_sample_filter_path=f"{miles_plugins}.remove_unrewarded")
        prod.start()
        await wait_until_async(lambda: len(buffers.get("a")) >= 6, 10, "a pass over the dataset")
        await prod.stop()
    samples = [s for g in buffers.get("a").pop(6) for s in g.samples]
    assert {s.reward for s in samples} == {0.0, 1.0}
    for s in samples:
        assert s.remove_sample is (s.reward == 0.0)
        assert s.loss_mask == ([0, 0] if s.reward == 0.0 else None)
