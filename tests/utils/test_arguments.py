"""The CLI parses once into a frozen, validated config; bad input exits 2 with one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from miles.utils.arguments import ConfigError, MilesConfig, build_parser, config_from_dict, parse_args


def test_defaults_are_derived_once():
    cfg = parse_args([])
    assert cfg.global_batch_size == cfg.rollout_batch_size * cfg.n_samples_per_prompt
    assert cfg.multi_lora_max_adapter_global_batch_size == 4 * cfg.global_batch_size
    assert cfg.eps_clip_high == cfg.eps_clip
    assert cfg.multi_lora_api_host == "127.0.0.1"
    assert cfg.multi_lora_api_port == 8068
    assert cfg.multi_lora_idle_poll_s == 5.0


def test_config_is_frozen():
    cfg = parse_args([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]


def test_every_field_is_a_flag_with_miles_spelling():
    parser = build_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in dataclasses.fields(MilesConfig):
        if f.name != "loss":  # derived from the loss flags
            assert "--" + f.name.replace("_", "-") in flags


def test_adapter_flags_both_forms(tmp_path):
    cfg = parse_args([
        "--multi-lora-n-adapters", "4",
        "--multi-lora-adapter", "a", "x/a.yaml",
        "--multi-lora-adapter", "b", "x/b.yaml",
        "--multi-lora-adapters", "y/c.yaml", "y/d.yaml",
    ])
    assert cfg.initial_adapters == [("a", "x/a.yaml"), ("b", "x/b.yaml"), ("c", "y/c.yaml"), ("d", "y/d.yaml")]


def test_config_file_values_and_command_line_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 0.001\nlora-rank: 4\nmulti_lora_n_adapters: 2\nuse_tis: true\n")
    cfg = parse_args(["--config", str(path), "--lr", "0.5"])
    assert cfg.lr == 0.5
    assert cfg.lora_rank == 4
    assert cfg.multi_lora_n_adapters == 2
    assert cfg.use_tis is True


def test_config_file_unknown_key_is_rejected(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 0.1\n")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(path)])
    assert exc.value.code == 2


@pytest.mark.parametrize("values, fragment", [
    ({"lora_rank": 0}, "--lora-rank must be > 0"),
    ({"sglang_router_ip": "127.0.0.1"}, "--sglang-router-port"),
    ({"multi_lora_adapter": [("a", "a.yaml")]}, "--multi-lora-n-adapters"),
    ({"multi_lora_n_adapters": 1, "multi_lora_queue_size": 0, "multi_lora_adapters": ["a.yaml", "b.yaml"]},
     "only 1 slots and 0 queue places"),
    ({"multi_lora_n_adapters": 1, "multi_lora_queue_size": 1, "multi_lora_adapters": ["a.yaml", "b.yaml", "c.yaml"]},
     "raise --multi-lora-n-adapters or --multi-lora-queue-size"),
    ({"multi_lora_queue_size": -1}, "--multi-lora-queue-size must be >= 0"),
    ({"multi_lora_n_adapters": 2, "multi_lora_adapters": ["x/a.yaml", "y/a.yaml"]}, "unique"),
    ({"save_interval": 0}, "--save-interval"),
    ({"use_dynamic_batch_size": True}, "give it with --max-tokens-per-gpu"),
    ({"use_dynamic_batch_size": True, "max_tokens_per_gpu": 0}, "--max-tokens-per-gpu must be > 0"),
    ({"activation_budget_mb": -1}, "--activation-budget-mb must be >= 0"),
    ({"actor_num_cpus_per_worker": 0}, "--actor-num-cpus-per-worker must be > 0"),
    ({"engine_num_threads": 0}, "--engine-num-threads must be > 0"),
    ({"recompute_modules": ["mlp"]}, "add it, or drop --recompute-modules"),
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp", "moe"]}, "the torch backend recomputes"),
    ({"train_backend": "megatron", "lora_unembed": True}, "--lora-unembed is not built for --train-backend megatron"),
])
def test_invalid_combinations_say_what_to_change(values, fragment):
    with pytest.raises(ConfigError, match=fragment):
        MilesConfig(**values)


def test_invalid_flag_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "miles.utils.arguments", "--lora-rank", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["miles: error: --lora-rank must be > 0, got 0"]


def test_api_token_from_environment(monkeypatch):
    monkeypatch.setenv("MILES_API_TOKEN", "s3cret")
    assert parse_args([]).multi_lora_api_token == "s3cret"
    assert parse_args(["--multi-lora-api-token", "flag"]).multi_lora_api_token == "flag"


def test_config_file_numbers_in_exponent_form_are_numbers(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\nmin_lr: 5E-6\nmulti_lora_idle_poll_s: 2\nrollout_num_engines: '3'\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.lr, cfg.min_lr) == (0.001, 5e-6) and isinstance(cfg.lr, float)
    assert cfg.multi_lora_idle_poll_s == 2.0 and isinstance(cfg.multi_lora_idle_poll_s, float)
    assert cfg.rollout_num_engines == 3


@pytest.mark.parametrize("text, fragment", [
    ('multi_lora_n_adapters: "four"\n',
     "multi_lora_n_adapters (--multi-lora-n-adapters) expects int, got 'four'"),
    ("lr: fast\n", "lr (--lr) expects float, got 'fast'"),
    ("rollout_stop: x\n", "rollout_stop (--rollout-stop) expects list[str], got 'x'"),
    ("multi_lora_n_adapters: true\n", "multi_lora_n_adapters (--multi-lora-n-adapters) expects int, got True"),
    ("train_backend: jax\n", "train_backend (--train-backend) expects Literal['torch', 'megatron'], got 'jax'"),
    ("use_tis: maybe\n", "use_tis (--use-tis) expects bool, got 'maybe'"),
    ("save: &s runs/x\nrun_dir: *s\n", "anchors and aliases"),
])
def test_config_file_values_are_checked_against_flag_types(tmp_path, text, fragment):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "miles.utils.arguments", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"miles: error: --config {path}") and fragment in lines[0], lines


def test_config_from_dict_checks_types():
    assert config_from_dict({"lr": "1e-3", "lora_rank": 8.0}).lr == 0.001
    with pytest.raises(ConfigError, match=r"lora_rank \(--lora-rank\) expects int, got 8.5"):
        config_from_dict({"lora_rank": 8.5})
    with pytest.raises(ConfigError, match="unknown flag 'learning_rate'"):
        config_from_dict({"learning_rate": 0.1})


def test_auto_device_follows_the_ray_cluster_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver on a GPU-less head node picks cuda when the cluster it joined has GPUs."""
    import ray
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = parse_args(["--device", "auto"])
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert (cfg.resolved_device, cfg.resolved_dtype) == ("cpu", "float32")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    assert (cfg.resolved_device, cfg.resolved_dtype) == ("cuda", "bfloat16")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    assert cfg.resolved_device == "cpu"
    assert parse_args(["--device", "cpu"]).resolved_device == "cpu"


def test_recompute_modules_reach_both_backends():
    from miles.backends.megatron.actor import MegatronActorConfig
    from miles.backends.torch.actor import TrainActorConfig

    flags = ["--hf-checkpoint", "/m", "--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"]
    assert TrainActorConfig.from_config(parse_args(flags)).recompute_modules == ("layernorm", "mlp")
    megatron = parse_args(flags[:-2] + ["moe_act", "--train-backend", "megatron"])  # any of Megatron's names
    assert MegatronActorConfig.from_config(megatron).recompute_modules == ("moe_act",)
    assert TrainActorConfig.from_config(parse_args(["--hf-checkpoint", "/m"])).recompute_modules is None


def test_lora_unembed_puts_lm_head_in_every_slot_the_trainer_and_engines_hold(tmp_path):
    from miles.backends.rank.config import TrainActorConfig
    from miles.controller.actor import ControllerConfig

    off = parse_args(["--hf-checkpoint", "/m", "--multi-lora-n-adapters", "2", "--save", str(tmp_path)])
    on = parse_args(["--hf-checkpoint", "/m", "--multi-lora-n-adapters", "2", "--save", str(tmp_path),
                     "--lora-unembed"])
    assert (off.lora_unembed, off.slot_target_modules) == (False, "all-linear")
    assert on.slot_target_modules == "all-linear,lm_head"
    assert TrainActorConfig.from_config(on).target_modules == "all-linear,lm_head"
    assert ControllerConfig.from_config(on).gateway.lora_unembed is True
    assert ControllerConfig.from_config(off).gateway.lora_unembed is False


def test_start_up_adapters_beyond_the_slots_wait_in_the_queue():
    cfg = MilesConfig(multi_lora_n_adapters=1, multi_lora_adapters=["a.yaml", "b.yaml"])
    assert cfg.multi_lora_queue_size == 1024 and [name for name, _ in cfg.initial_adapters] == ["a", "b"]
    assert parse_args(["--multi-lora-n-adapters", "2", "--multi-lora-queue-size", "0"]).multi_lora_queue_size == 0
