"""Reward precedence from registration to a sample: the adapter's `rm_type`, then the
sample's `metadata["rm_type"]`, then `--rm-type`. Registration must not copy
`--rm-type` into the adapter, or a row's own `rm_type` could never win."""

from __future__ import annotations

import json
from pathlib import Path

from miles.controller.backend import ControllerHooks, MultiLoRABackend
from miles.recipes.tiny_model import build_char_tokenizer
from miles.rollout.data_source import DataSourceConfig, MultiLoRADataSource
from miles.rollout.datasets import validate_dataset
from miles.rollout.rewards import get_reward_fn, validate_reward_spec
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.types import MultiLoRASnapshot
from miles.utils.types.lifecycle_ops import RecordWeightUpdate
from tests.helpers.waiting import wait_until_async

CLI_RM_TYPE = "math"


async def draw_rewards(tmp_path: Path, adapter_config: dict) -> dict[str, str]:
    """Register an adapter through the controller's backend, load its dataset like the
    producer does, and name the reward function each row's sample resolves to."""
    data = tmp_path / "rows.jsonl"
    rows = [{"text": "q0", "label": "1", "metadata": {"rm_type": "exact"}},
            {"text": "q1", "label": "1", "metadata": {"rm_type": "f1"}},
            {"text": "q2", "label": "1"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hooks = ControllerHooks(validate_dataset=validate_dataset, validate_reward=validate_reward_spec)
    backend = MultiLoRABackend(1, AdapterDefaults(save=str(tmp_path / "save"), rm_type=CLI_RM_TYPE), None, hooks)
    await backend.register("a", config={"data": str(data), **adapter_config})
    backend.apply_now(RecordWeightUpdate(["a"]))
    run = backend.snapshot().active["a"]

    source = MultiLoRADataSource(DataSourceConfig(seed=0, apply_chat_template=False, default_rm_type=CLI_RM_TYPE),
                                 build_char_tokenizer())
    source.sync(MultiLoRASnapshot(active={"a": run}))
    await wait_until_async(lambda: source.ready(run) or source.failed, 10, "the dataset to load")
    assert source.ready(run), source.failed
    names = {fn: name for name, fn in (("math", get_reward_fn("math")), ("exact", get_reward_fn("exact")),
                                       ("f1", get_reward_fn("f1")))}
    resolved = {}
    for _ in rows:
        item = source.next_prompt(run)
        resolved[item.prompt] = names[item.reward.resolve(item.new_samples(1)[0])]
    await source.close()
    return resolved


async def test_sample_metadata_wins_over_the_cli_reward(tmp_path: Path) -> None:
    assert await draw_rewards(tmp_path, {}) == {"q0": "exact", "q1": "f1", "q2": CLI_RM_TYPE}


async def test_adapter_reward_wins_over_sample_metadata(tmp_path: Path) -> None:
    assert await draw_rewards(tmp_path, {"rm_type": "f1"}) == {"q0": "f1", "q1": "f1", "q2": "f1"}
