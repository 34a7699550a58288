"""Which flags of Miles' multi-LoRA example our command line takes today, with their values."""

from __future__ import annotations

import pytest
from miles_multi_lora_flags import (
    BOUNDED_ARGV,
    MILES_ADAPTER_YAMLS,
    SERVICE_ARGV,
    WANDB_ARGV,
    flag_names,
    split_flags,
)

from miles.rollout.rewards import validate_reward_spec
from miles.utils.adapter_config import AdapterRunConfig
from miles.utils.arguments import build_parser

ACCEPTED_TODAY = [
    "--hf-checkpoint", "--lora-rank", "--lora-alpha", "--target-modules", "--multi-lora-n-adapters",
    "--multi-lora-idle-poll-s", "--multi-lora-adapter", "--multi-lora-disable-service-mode", "--multi-lora-api-port",
    "--max-weight-staleness", "--use-tis", "--apply-chat-template", "--num-rollout", "--rollout-batch-size",
    "--n-samples-per-prompt", "--rollout-max-response-len", "--rollout-temperature", "--global-batch-size",
    "--kl-coef", "--eps-clip", "--eps-clip-high", "--lr", "--lr-decay-style", "--weight-decay", "--adam-beta1",
    "--adam-beta2", "--rollout-num-gpus-per-engine", "--save", "--save-interval", "--use-wandb", "--wandb-project",
]
"""Flags with these names parse today (`--kl-coef` is our KL-loss coefficient, not Miles'
reward shaping: see docs/MILES_COMPAT.md)."""


def test_the_example_uses_these_flags():
    names = flag_names(BOUNDED_ARGV + SERVICE_ARGV + WANDB_ARGV)
    assert len(names) == 59 and len(set(names)) == 59
    assert set(ACCEPTED_TODAY) <= set(names)


def test_flags_accepted_today_parse_with_the_example_values():
    pieces = [p for p in split_flags(BOUNDED_ARGV + SERVICE_ARGV + WANDB_ARGV) if p[0] in ACCEPTED_TODAY]
    argv = [token for piece in pieces for token in piece]
    namespace, unknown = build_parser().parse_known_args(argv)
    assert unknown == []
    assert (namespace.eps_clip, namespace.eps_clip_high, namespace.rollout_batch_size) == (0.2, 0.28, 32)


@pytest.mark.parametrize("file_name", sorted(MILES_ADAPTER_YAMLS))
def test_miles_adapter_keys_and_reward_types_are_accepted(file_name):
    keys = MILES_ADAPTER_YAMLS[file_name]
    config = AdapterRunConfig(**keys)
    assert config.model_dump(include=set(keys)) == keys
    validate_reward_spec(config.rm_type, None)  # math and deepscaler are built-ins


def test_miles_optional_adapter_keys_are_accepted():
    keys = {"data": "d.jsonl", "save": "/tmp/s", "metadata_key": "meta", "custom_rm_path": "pkg.mod.fn",
            "num_epoch": 2, "metadata": {"k": 1}}
    config = AdapterRunConfig(**keys)
    assert (str(config.save), config.metadata_key, config.custom_rm_path, config.num_epoch, config.metadata) == (
        "/tmp/s", "meta", "pkg.mod.fn", 2, {"k": 1})
