"""Command lines of the engines and the router, built from the typed config."""

from __future__ import annotations

import sys

import pytest

from miles.rollout.engines.fleet import EngineFleetConfig
from miles.rollout.engines.router import build_router_command
from miles.rollout.engines.server_command import (
    EngineServerConfig,
    build_sglang_command,
    server_command,
)
from miles.utils.arguments import parse_args


def flag_values(argv: list[str], flag: str) -> list[str]:
    """Values after `flag` up to the next flag."""
    start = argv.index(flag) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


def test_sglang_command_carries_the_lora_flags():
    cfg = EngineServerConfig.from_config(parse_args([
        "--hf-checkpoint", "/models/qwen", "--rollout-engine", "sglang", "--multi-lora-n-adapters", "6",
        "--lora-rank", "32", "--target-modules", "q_proj,v_proj", "--device", "cuda", "--dtype", "bfloat16",
        "--rollout-num-gpus-per-engine", "2", "--seed", "3",
    ]))
    argv = build_sglang_command(cfg, "127.0.0.1", 30001)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert flag_values(argv, "--model-path") == ["/models/qwen"]
    assert "--enable-lora" in argv
    assert flag_values(argv, "--max-loras-per-batch") == ["6"]
    assert flag_values(argv, "--max-lora-rank") == ["32"]
    assert flag_values(argv, "--lora-target-modules") == ["q_proj", "v_proj"]
    assert flag_values(argv, "--tp-size") == ["2"]
    assert flag_values(argv, "--dtype") == ["bfloat16"]
    assert flag_values(argv, "--port") == ["30001"] and flag_values(argv, "--host") == ["127.0.0.1"]
    assert flag_values(argv, "--random-seed") == ["3"]
    assert server_command(cfg, "127.0.0.1", 30001) == argv


def test_all_linear_is_spelled_all_for_sglang_and_slots_default_to_one():
    cfg = EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m", "--rollout-engine", "sglang"]))
    assert cfg.n_slots == 1  # multi-LoRA off still serves one LoRA (train_async)
    assert flag_values(build_sglang_command(cfg, "h", 1), "--lora-target-modules") == ["all"]
    builtin = server_command(EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m"])), "h", 1)
    assert builtin[2] == "miles.rollout.engines.builtin_server"
    assert flag_values(builtin, "--lora-target-modules") == ["all-linear"]


def test_fleet_config_reads_router_and_engine_flags(tmp_path):
    cfg = parse_args(["--hf-checkpoint", "/m", "--rollout-num-engines", "3", "--sglang-router-ip", "10.0.0.2",
                      "--sglang-router-port", "31000", "--multi-lora-n-adapters", "4", "--run-dir", str(tmp_path)])
    fleet = EngineFleetConfig.from_config(cfg)
    assert (fleet.num_engines, fleet.router_ip, fleet.router_port) == (3, "10.0.0.2", 31000)
    assert fleet.server.n_slots == 4 and fleet.router_policy == "round_robin"
    assert fleet.work_dir == str((tmp_path / "engines").resolve())


def test_missing_checkpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        EngineServerConfig.from_config(parse_args([]))


def test_router_command():
    argv = build_router_command(["http://a:1", "http://b:2"], "127.0.0.1", 30000, "round_robin", prometheus_port=29001)
    assert argv[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    assert flag_values(argv, "--worker-urls") == ["http://a:1", "http://b:2"]
    assert flag_values(argv, "--policy") == ["round_robin"]
    assert flag_values(argv, "--prometheus-port") == ["29001"]
