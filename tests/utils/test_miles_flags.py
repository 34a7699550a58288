"""Miles' multi-LoRA command line parses here and means what it means in Miles.

Every flag of the example (`miles_multi_lora_flags.py`, with the Miles commit) lands in the
typed config with the example's value; the flags that configure a component reach it (the
SGLang server arguments the SGLang command, the placement flags the rank and engine
counts); every flag without effect in the run is named by exactly one warning line.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from miles.backends.megatron.actor import MegatronActorConfig
from miles.backends.torch.actor import TrainActorConfig
from miles.controller.backend import ControllerHooks, MultiLoRABackend
from miles.recipes.tiny_model import build_char_tokenizer
from miles.rollout.data_source import DatasetCheck
from miles.rollout.engines.server_command import EngineServerConfig, build_sglang_command
from miles.rollout.rewards import validate_reward_spec
from miles.utils.adapter_config import AdapterDefaults, AdapterRunConfig, parse_adapter_run_yaml
from miles.utils.arguments import build_parser, inert_flag_warnings, parse_args
from miles.utils.loss_settings import LossSettings
from tests.helpers.miles_multi_lora_flags import (
    BOUNDED_ARGV,
    MILES_ADAPTER_YAMLS,
    MODEL_ARGV,
    SERVICE_ARGV,
    WANDB_ARGV,
    flag_names,
)

SGLANG_FLAGS = Path(__file__).parents[1] / "rollout" / "engines" / "sglang_0_5_23_server_flags.json"

EXPECTED = {
    "hf_checkpoint": "/root/models/Qwen3-4B", "megatron_to_hf_mode": "bridge",
    "lora_rank": 32, "lora_alpha": 32.0, "lora_dropout": 0.0, "target_modules": "all-linear",
    "multi_lora_n_adapters": 4, "multi_lora_idle_poll_s": 5.0,
    "multi_lora_adapter": [("dapo_math", "examples/multi_lora/adapters/dapo_math.yaml"),
                           ("gsm8k", "examples/multi_lora/adapters/gsm8k.yaml")],
    "multi_lora_disable_service_mode": True,
    "pause_generation_mode": "in_place", "max_weight_staleness": 3, "use_tis": True,
    "apply_chat_template": True, "rollout_shuffle": True, "num_rollout": 50, "rollout_batch_size": 32,
    "n_samples_per_prompt": 8, "rollout_max_response_len": 4096, "rollout_temperature": 1.0,
    "global_batch_size": 256,
    "advantage_estimator": "grpo", "kl_loss_coef": 0.0, "kl_coef": 0.0, "entropy_coef": 0.0,
    "eps_clip": 0.2, "eps_clip_high": 0.28,
    "optimizer": "adam", "lr": 1e-5, "lr_decay_style": "constant", "weight_decay": 0.1,
    "adam_beta1": 0.9, "adam_beta2": 0.98,
    "tensor_model_parallel_size": 2, "sequence_parallel": True, "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
    "use_dynamic_batch_size": True, "max_tokens_per_gpu": 9216,
    "rollout_num_gpus_per_engine": 1, "sglang_server_args": ["--mem-fraction-static", "0.8"],
    "actor_num_nodes": 1, "actor_num_gpus_per_node": 4, "rollout_num_gpus": 4,
    "save": "/tmp/multi_lora", "save_interval": 5,
    "attention_dropout": 0.0, "hidden_dropout": 0.0, "accumulate_allreduce_grads_in_fp32": True,
    "attention_softmax_in_fp32": True, "attention_backend": "flash",
    "use_wandb": True, "wandb_project": "miles-run_multi_lora", "wandb_group": "RUN_ID",
    "wandb_key": "WANDB_API_KEY", "disable_wandb_random_suffix": True,
    "swiglu": True, "num_layers": 36, "hidden_size": 2560, "ffn_hidden_size": 9728, "num_attention_heads": 32,
    "group_query_attention": True, "num_query_groups": 8, "use_rotary_position_embeddings": True,
    "disable_bias_linear": True, "normalization": "RMSNorm", "norm_epsilon": 1e-6, "rotary_base": 1000000,
    "vocab_size": 151936, "kv_channels": 128, "qk_layernorm": True,
}
"""Each flag of the bounded example (+ W&B + model shape) as the field it sets, with its value."""

NO_EFFECT_WITH_TORCH = {
    # Megatron backend (this run trains with --train-backend torch)
    "--megatron-to-hf-mode", "--tensor-model-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
    "--context-parallel-size", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--attention-dropout", "--hidden-dropout", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", *[f for f in flag_names(MODEL_ARGV)],
    # engine pausing, a run length that multi-LoRA does not use
    "--pause-generation-mode", "--num-rollout",
    # SGLang server argument with the builtin engine
    "--sglang-mem-fraction-static",
}


def example_argv() -> list[str]:
    return BOUNDED_ARGV + WANDB_ARGV + MODEL_ARGV


def test_the_example_uses_these_flags():
    names = flag_names(BOUNDED_ARGV + SERVICE_ARGV + WANDB_ARGV)
    assert len(names) == 59 and len(set(names)) == 59
    assert len(flag_names(MODEL_ARGV)) == 15
    assert {"--" + k.replace("_", "-") for k in EXPECTED} | {"--mem-fraction-static"} >= set(
        flag_names(example_argv())) - {"--sglang-mem-fraction-static"}


def test_every_flag_of_the_example_lands_in_the_typed_config():
    cfg = parse_args(example_argv())
    assert {name: getattr(cfg, name) for name in EXPECTED} == EXPECTED
    # --kl-coef is Miles' reward shaping; the loss flags build one LossSettings
    assert cfg.loss == LossSettings(eps_clip=0.2, eps_clip_high=0.28, use_tis=True)
    # Miles' placement: 1 node x 4 GPUs of data-parallel torch ranks, 4 GPUs / 1 per engine
    assert (cfg.actor_num_workers, cfg.rollout_num_engines) == (4, 4)


def test_the_service_command_line_parses_too():
    cfg = parse_args(SERVICE_ARGV)
    assert cfg.multi_lora_api_port == 8068 and cfg.initial_adapters == []


def test_each_flag_without_effect_is_named_by_exactly_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="miles.utils.arguments"):
        parse_args(example_argv())
    lines = [r.getMessage() for r in caplog.records if r.name == "miles.utils.arguments"]
    named = [line.split(" has no effect: ")[0] for line in lines]
    assert all(" has no effect: " in line for line in lines)
    assert sorted(named) == sorted(NO_EFFECT_WITH_TORCH)  # once each, and no flag that has an effect


def test_miles_token_budget_sizes_the_micro_batches_of_both_backends():
    for backend in ("torch", "megatron"):
        cfg = parse_args(example_argv() + ["--train-backend", backend])
        assert TrainActorConfig.from_config(cfg).max_tokens_per_micro_batch == 9216
        assert MegatronActorConfig.from_config(cfg).max_tokens_per_micro_batch == 9216
    budget_only = parse_args(["--hf-checkpoint", "/m", "--max-tokens-per-gpu", "4096", "--micro-batch-size", "4"])
    assert TrainActorConfig.from_config(budget_only).max_tokens_per_micro_batch is None
    assert inert_flag_warnings(budget_only, {"max_tokens_per_gpu", "micro_batch_size"}) == [
        "--max-tokens-per-gpu has no effect: it is the token budget of --use-dynamic-batch-size, which is off"]
    both = parse_args(["--hf-checkpoint", "/m", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
                       "--micro-batch-size", "4"])
    assert [line.split(":")[0] for line in inert_flag_warnings(both, {"micro_batch_size", "max_tokens_per_gpu"})] == [
        "--micro-batch-size has no effect"]


def test_the_activation_budget_reaches_the_torch_rank_and_says_when_another_setting_wins():
    assert TrainActorConfig.from_config(parse_args(["--hf-checkpoint", "/m"])).activation_budget_mb is None
    cfg = parse_args(["--hf-checkpoint", "/m", "--activation-budget-mb", "0"])
    assert TrainActorConfig.from_config(cfg).activation_budget_mb == 0
    assert inert_flag_warnings(cfg, {"activation_budget_mb"}) == []
    sized = parse_args(["--hf-checkpoint", "/m", "--activation-budget-mb", "256", "--micro-batch-size", "4"])
    assert inert_flag_warnings(sized, {"activation_budget_mb", "micro_batch_size"}) == [
        "--activation-budget-mb has no effect: --micro-batch-size sets the micro-batches"]
    megatron = parse_args(["--hf-checkpoint", "/m", "--activation-budget-mb", "256", "--train-backend", "megatron"])
    assert [w.split(":")[0] for w in inert_flag_warnings(megatron, {"activation_budget_mb"})] == [
        "--activation-budget-mb has no effect"]


def test_megatron_flags_are_kept_quietly_for_the_megatron_backend():
    cfg = parse_args(example_argv() + ["--train-backend", "megatron"])
    warned = {line.split(" has no effect")[0] for line in inert_flag_warnings(cfg, set(EXPECTED) | {"train_backend"})}
    assert "--tensor-model-parallel-size" not in warned and "--num-layers" not in warned
    assert "--sequence-parallel" in warned  # accepted; tensor parallelism runs without it
    # data-parallel ranks = 4 GPUs / (tensor 2 x pipeline 1 x context 1)
    assert (cfg.tensor_model_parallel_size, cfg.actor_num_workers) == (2, 2)


def test_sglang_server_arguments_reach_the_sglang_command():
    argv = ["--hf-checkpoint", "/m", "--rollout-engine", "sglang", "--sglang-mem-fraction-static", "0.8",
            "--sglang-enable-torch-compile", "--sglang-chunked-prefill-size=4096"]
    cfg = parse_args(argv)
    assert inert_flag_warnings(cfg, {"sglang_server_args", "rollout_engine", "hf_checkpoint"}) == []
    command = build_sglang_command(EngineServerConfig.from_config(cfg), "127.0.0.1", 30000)
    forwarded = ["--mem-fraction-static", "0.8", "--enable-torch-compile", "--chunked-prefill-size", "4096"]
    assert command[-len(forwarded):] == forwarded
    known = json.loads(SGLANG_FLAGS.read_text())["flags"]
    assert all(token in known for token in forwarded if token.startswith("--"))
    builtin = EngineServerConfig.from_config(parse_args(argv[:2] + argv[4:]))
    assert builtin.extra_args == ()  # the builtin engine is not SGLang: warned, not passed


def test_sglang_arguments_from_a_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("sglang_mem_fraction_static: 0.7\nsglang-enable-torch-compile: true\n")
    cfg = parse_args(["--config", str(path), "--sglang-max-prefill-tokens", "8192"])
    assert cfg.sglang_server_args == ["--mem-fraction-static", "0.7", "--enable-torch-compile",
                                      "--max-prefill-tokens", "8192"]


def test_sglang_tp_size_is_overridden_as_in_miles_and_trainer_owned_arguments_are_refused(caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="miles.utils.arguments"):
        cfg = parse_args(["--rollout-engine", "sglang", "--sglang-tp-size", "4", "--sglang-mem-fraction-static", "0.5"])
    assert cfg.sglang_server_args == ["--mem-fraction-static", "0.5"]
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["--sglang-tp-size has no effect"]
    with pytest.raises(SystemExit) as exc:
        parse_args(["--rollout-engine", "sglang", "--sglang-model-path", "/other"])
    assert exc.value.code == 2
    assert "--sglang-model-path is set by the trainer (from --hf-checkpoint)" in capsys.readouterr().err


def test_unknown_flags_still_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--no-such-flag", "1"])
    assert exc.value.code == 2 and "unrecognized arguments: --no-such-flag 1" in capsys.readouterr().err


def test_kl_coef_is_reward_shaping_and_the_kl_loss_is_use_kl_loss():
    shaped = parse_args(["--kl-coef", "0.1"])
    assert shaped.loss.kl_coef == 0.1 and not shaped.loss.use_kl_loss
    assert not shaped.loss.needs_ref_logprobs  # grpo does not shape its reward
    assert shaped.loss.kl_loss_coef == 0.0  # no KL term in the loss
    kl_loss = parse_args(["--use-kl-loss", "--kl-loss-type", "k3", "--kl-loss-coef", "0.05"])
    assert kl_loss.loss.kl_loss_coef == 0.05 and kl_loss.loss.kl_coef == 0.0
    assert kl_loss.loss == LossSettings(use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.05)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_parses_with_its_kl_coef_and_gamma_and_does_not_warn(caplog, estimator):
    with caplog.at_level(logging.WARNING, logger="miles.utils.arguments"):
        cfg = parse_args(["--advantage-estimator", estimator, "--normalize-advantages", "--kl-coef", "0.1",
                          "--gamma", "0.9"])
    assert (cfg.loss.advantage_estimator, cfg.loss.kl_coef, cfg.loss.gamma) == (estimator, 0.1, 0.9)
    assert cfg.loss.needs_ref_logprobs and caplog.records == []


@pytest.mark.parametrize("argv, warned", [
    (["--kl-coef", "0.1"], "--kl-coef has no effect: it shapes the reinforce++ advantages"),
    (["--gamma", "0.9"], "--gamma has no effect: it shapes the reinforce++ advantages"),
    (["--kl-loss-coef", "0.1"], "--kl-loss-coef has no effect: the KL loss term needs --use-kl-loss"),
    (["--kl-loss-type", "k2"], "--kl-loss-type has no effect: the KL loss term needs --use-kl-loss"),
    (["--lora-dropout", "0.1"], "--lora-dropout has no effect: the slot LoRA layers apply no dropout"),
    (["--wandb-project", "p"], "--wandb-project has no effect: --use-wandb is not set"),
    (["--calculate-per-token-loss"], "--calculate-per-token-loss has no effect: the train actors take a token mean"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"],
     "--recompute-num-layers has no effect: the torch backend recomputes uniformly layer by layer"),
    (["--rollout-engine", "sglang", "--engine-num-threads", "4"],
     "--engine-num-threads has no effect: it sets the threads of builtin engines"),
])
def test_a_flag_set_without_effect_warns_once(caplog, argv, warned):
    with caplog.at_level(logging.WARNING, logger="miles.utils.arguments"):
        parse_args(argv)
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith(warned) for line in lines) == 1, lines


def test_flags_with_an_effect_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="miles.utils.arguments"):
        parse_args(["--eps-clip", "0.1", "--eps-clip-high", "0.3", "--use-tis", "--tis-clip", "3",
                    "--tis-clip-low", "0.1",
                    "--use-kl-loss", "--kl-loss-type", "k2", "--kl-loss-coef", "0.05", "--rollout-shuffle",
                    "--advantage-estimator", "gspo", "--entropy-coef", "0.01", "--eps-clip-c", "3", "--use-unbiased-kl",
                    "--disable-grpo-std-normalization", "--normalize-advantages",
                    "--lora-dropout", "0.0", "--label-key", "answer", "--lr-warmup-iters", "3",
                    # Megatron's recompute flags as Miles' example scripts give them: the torch backend honours them
                    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])
        parse_args(["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"])
        parse_args(["--actor-num-cpus-per-worker", "2", "--engine-num-threads", "2"])
    assert caplog.records == []


@pytest.mark.parametrize("argv, message", [
    (["--advantage-estimator", "reinforce_plus_plus"], "requires advantage normalization: add --normalize-advantages"),
    (["--advantage-estimator", "ppo"], "--advantage-estimator ppo is not supported"),
    (["--use-tis", "--use-rollout-logprobs"], "--use-rollout-logprobs and --use-tis cannot be set at the same time"),
    (["--kl-coef", "0.1", "--kl-loss-coef", "0.1"], "only one of --kl-coef"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c is the lower bound of dual-clip PPO and must be > 1.0"),
    (["--optimizer", "sgd"], "invalid choice: 'sgd'"),
    (["--recompute-method", "block"],
     "--recompute-method and --recompute-num-layers apply to --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "0"], "--recompute-num-layers must be > 0"),
    (["--recompute-granularity", "ful"], "invalid choice: 'ful'"),
    (["--multi-lora-n-adapters", "2", "--calculate-per-token-loss"], "drop --calculate-per-token-loss"),
    (["--actor-num-gpus-per-node", "4", "--actor-num-workers", "2"], "--actor-num-workers 2 disagrees"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
     "--rollout-num-gpus 3 must be a positive multiple"),
])
def test_invalid_loss_and_placement_flags_exit_2_with_a_clear_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "miles.utils.arguments", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]  # argparse's own errors print the usage first
    assert last.startswith("miles: error: ") and message in last, proc.stderr


def test_lr_warmup_iters_is_miles_name_for_the_warmup(tmp_path, capsys):
    assert parse_args(["--lr-warmup-iters", "7"]).lr_warmup_steps == 7
    path = tmp_path / "run.yaml"
    path.write_text("lr_warmup_iters: 5\n")
    assert parse_args(["--config", str(path)]).lr_warmup_steps == 5
    # The warmup starts from --lr-warmup-init, 0 unless given, as Megatron's scheduler in Miles.
    assert parse_args([]).lr_warmup_init == 0.0
    assert parse_args(["--lr-warmup-init", "1e-6"]).lr_warmup_init == 1e-6
    with pytest.raises(SystemExit):
        parse_args(["--lr-warmup-init", "-1"])
    assert "--lr-warmup-init must be >= 0, got -1.0" in capsys.readouterr().err


def test_plugin_modules_default_to_miles_and_the_command_lines_own_plugins():
    assert parse_args([]).plugin_modules == ("miles",)
    cfg = parse_args(["--custom-rm-path", "my_pkg.rewards.score", "--custom-tis-function-path", "tis_mod:fn",
                      "--dynamic-sampling-filter-path", "my_pkg.rewards.keep"])
    assert cfg.plugin_modules == ("miles", "my_pkg.rewards", "tis_mod")
    # Given, the flag is the whole list.
    assert parse_args(["--multi-lora-allowed-plugin-modules", "a", "b.c"]).plugin_modules == ("a", "b.c")


def test_data_flags_have_miles_defaults():
    cfg = parse_args([])
    assert (cfg.input_key, cfg.label_key, cfg.metadata_key) == ("input", None, "metadata")
    assert (cfg.rollout_shuffle, cfg.rollout_seed, cfg.rollout_max_prompt_len, cfg.apply_chat_template) == (
        False, 42, None, False)
    assert (cfg.rm_url, cfg.reward_key, cfg.group_rm) == (None, None, False)


def test_no_flag_is_unknown_to_the_parser():
    flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert set(flag_names(example_argv())) - flags == {"--sglang-mem-fraction-static"}  # collected, not declared


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


def write_miles_datasets(root: Path) -> dict[str, Path]:
    """Local stand-ins for the example's datasets, in their shapes: gsm8k a parquet of chat
    `messages` with a `label`, dapo-math-17k a jsonl of chat `prompt`s with a `label`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    gsm8k = root / "gsm8k" / "train.parquet"
    gsm8k.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([
        {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "label": str(2 * i)} for i in range(64)
    ]), gsm8k)
    dapo = root / "dapo-math-17k" / "dapo-math-17k.jsonl"
    dapo.parent.mkdir(parents=True)
    dapo.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Solve {i}x = {2 * i}."}],
                                        "label": "2"}) + "\n" for i in range(1, 17)))
    return {"gsm8k.yaml": gsm8k, "dapo_math.yaml": dapo}


async def test_miles_adapter_files_register_as_they_are(tmp_path):
    data = write_miles_datasets(tmp_path)
    cfg = parse_args(example_argv()[:example_argv().index("--save") + 1] + [str(tmp_path / "save")]
                     + example_argv()[example_argv().index("--save") + 2:])
    tokenizer_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    hooks = ControllerHooks(validate_dataset=DatasetCheck(str(tokenizer_dir)), validate_reward=validate_reward_spec)
    backend = MultiLoRABackend(cfg.multi_lora_n_adapters, AdapterDefaults.from_config(cfg), None, hooks)
    for file_name, keys in MILES_ADAPTER_YAMLS.items():
        path = tmp_path / file_name
        path.write_text("".join(f"{key}: {json.dumps(str(data[file_name]) if key == 'data' else value)}\n"
                                for key, value in keys.items()))
        assert parse_adapter_run_yaml(path).model_dump(exclude_unset=True) == {**keys, "data": str(data[file_name])}
        await backend.register(path.stem, yaml_path=str(path))
    runs = backend.registry.snapshot().pending
    assert {name: (run.config.rank, run.config.input_key, run.config.rm_type, run.config.num_step)
            for name, run in runs.items()} == {"gsm8k": (16, "messages", "math", 400),
                                               "dapo_math": (32, "prompt", "deepscaler", 500)}
    assert all(run.config.loss_settings() == cfg.loss for run in runs.values())


async def test_rm_url_reaches_remote_rm_through_the_config_the_producer_passes():
    from aiohttp import web

    from miles.rollout.rewards import compute_reward, get_reward_fn
    from miles.utils.types import Sample

    seen = []

    async def handle(request):
        seen.append(await request.json())
        return web.json_response(0.5)

    app = web.Application()
    app.router.add_post("/reward", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        cfg = parse_args(["--rm-type", "remote_rm", "--rm-url", f"http://{host}:{port}/reward"])
        sample = Sample(adapter="a", slot=0, group_index=0, index=0, prompt="1+1=", label="2", metadata={},
                        prompt_ids=[], response="2")
        assert await compute_reward(get_reward_fn(cfg.rm_type), cfg, sample) == 0.5
    finally:
        await runner.cleanup()
    assert seen == [{"prompt": "1+1=", "response": "2", "label": "2"}]
