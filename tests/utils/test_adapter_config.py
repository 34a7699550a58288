"""Adapter config: YAML parsing, defaults from the process config, every validation rule."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from miles.utils.adapter_config import (
    ADAPTER_CONFIG_KEYS,
    MAX_ADAPTER_NAME_LENGTH,
    MAX_CONFIG_FILE_BYTES,
    AdapterConfigError,
    AdapterDefaults,
    AdapterRunConfig,
    min_groups_per_dp_split,
    parse_adapter_run_yaml,
    path_within_roots,
    resolve_adapter_config,
    validate_adapter_name,
)
from miles.utils.arguments import config_from_dict
from miles.utils.loss_settings import LossSettings
from miles.utils.types import AdapterStatus


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"text": "1+1=", "label": "2"}) + "\n")
    return path


@pytest.fixture
def defaults(tmp_path: Path) -> AdapterDefaults:
    return AdapterDefaults(lora_rank=8, lora_alpha=16.0, rollout_batch_size=4, n_samples_per_prompt=2,
                           save=str(tmp_path / "save"), rm_type="math", dp_size=2, max_adapter_global_batch_size=32)


def test_min_groups_per_dp_split() -> None:
    assert [min_groups_per_dp_split(n, dp) for n, dp in [(4, 2), (2, 4), (2, 8), (1, 1), (8, 8), (3, 1), (1, 4)]] \
        == [1, 2, 4, 1, 1, 1, 4]
    for n, dp in [(3, 2), (2, 3), (4, 6)]:
        with pytest.raises(ValueError, match="divisor or a multiple"):
            min_groups_per_dp_split(n, dp)


def test_defaults_come_from_the_process_config(tmp_path: Path, data_file: Path) -> None:
    cfg = config_from_dict(dict(
        lora_rank=32, lora_alpha=64.0, rollout_batch_size=6, n_samples_per_prompt=4, save=str(tmp_path / "out"),
        input_key="question", label_key="answer", metadata_key="meta", rm_type="exact", lr=3e-5,
        weight_decay=0.1, lr_decay_style="cosine", lr_warmup_steps=5, actor_num_workers=2, global_batch_size=16,
    ))
    defaults = AdapterDefaults.from_config(cfg)
    assert (defaults.dp_size, defaults.max_adapter_global_batch_size) == (2, 64)

    resolved = resolve_adapter_config("alpha", {"data": str(data_file)}, defaults)

    assert resolved == AdapterRunConfig(
        data=str(data_file.resolve()), rank=32, alpha=64.0, rollout_batch_size=6, n_samples_per_prompt=4,
        save=(tmp_path / "out" / "adapters" / "alpha").resolve(), input_key="question", label_key="answer",
        metadata_key="meta", rm_type=None, custom_rm_path=None, num_step=None, num_epoch=None, metadata={},
        lr=3e-5, weight_decay=0.1, lr_decay_style="cosine", lr_warmup_steps=5, loss=LossSettings().flags(),
    )
    assert resolved.adapter_global_batch_size == 24


def test_adapter_values_override_defaults(tmp_path: Path, data_file: Path, defaults: AdapterDefaults) -> None:
    raw = {"data": str(data_file), "rank": 4, "alpha": 8, "rollout_batch_size": 2, "n_samples_per_prompt": 4,
           "save": str(tmp_path / "mine"), "rm_type": "f1", "num_epoch": 3, "metadata": {"lang": "en"},
           "lr": 0.01, "lr_decay_style": "linear"}
    resolved = resolve_adapter_config("b", raw, defaults)
    assert (resolved.rank, resolved.alpha, resolved.rollout_batch_size, resolved.n_samples_per_prompt) == (4, 8.0, 2, 4)
    assert resolved.save == (tmp_path / "mine").resolve()
    assert (resolved.rm_type, resolved.num_epoch, resolved.metadata, resolved.lr) == ("f1", 3, {"lang": "en"}, 0.01)
    assert resolved.lr_decay_style == "linear" and resolved.input_key == "text"


def test_parse_yaml_then_resolve(tmp_path: Path, data_file: Path, defaults: AdapterDefaults) -> None:
    path = tmp_path / "gsm.yaml"
    path.write_text(f"data: {data_file}\nrank: 2\nnum_step: 7\nmetadata:\n  source: gsm8k\n")
    raw = parse_adapter_run_yaml(path)
    assert ((raw.data, raw.rank, raw.num_step, raw.metadata, raw.alpha)
            == (str(data_file), 2, 7, {"source": "gsm8k"}, None))
    assert resolve_adapter_config("gsm", raw, defaults).rank == 2


@pytest.mark.parametrize("text, needle", [
    ("data: x.jsonl\nrnak: 4\n", "unknown key(s) ['rnak']"),
    ("rank: 4\n", "'data' is required"),
    ("- data\n", "must be a mapping"),
    ("data: [unclosed\n", "not valid YAML"),
])
def test_yaml_errors_name_the_adapter(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    with pytest.raises(AdapterConfigError) as err:
        parse_adapter_run_yaml(path)
    assert "Adapter 'typo'" in str(err.value) and needle in str(err.value)


def test_unknown_key_lists_valid_keys(data_file: Path, defaults: AdapterDefaults) -> None:
    with pytest.raises(AdapterConfigError) as err:
        resolve_adapter_config("c", {"data": str(data_file), "learning_rate": 1.0}, defaults)
    assert f"valid keys are {list(ADAPTER_CONFIG_KEYS)}" in str(err.value)
    with pytest.raises(AdapterConfigError, match="does not exist"):
        parse_adapter_run_yaml(Path("/nonexistent/x.yaml"))


@pytest.mark.parametrize("name", ["a/b", "..", ".", "a::b", "a b", "", "a\nb", "a\n", "é"])
def test_bad_names_rejected(name: str, data_file: Path, defaults: AdapterDefaults) -> None:
    with pytest.raises(AdapterConfigError, match="Invalid adapter name"):
        resolve_adapter_config(name, {"data": str(data_file)}, defaults)


def test_good_names_accepted() -> None:
    for name in ["a", "A-1", "my_adapter.v2", "..x", "-"]:
        assert validate_adapter_name(name) == name


# (overrides of the adapter config, overrides of the defaults, words the message must contain)
RULES: list[tuple[dict[str, Any], dict[str, Any], list[str]]] = [
    ({"rank": 0}, {}, ["rank: Input should be greater than 0, got 0"]),
    ({"rank": "4"}, {}, ["rank: Input should be a valid integer, got '4'"]),
    ({"rank": True}, {}, ["rank: Input should be a valid integer, got True"]),
    ({"rank": 9}, {}, ["rank 9 exceeds the slot width --lora-rank 8"]),
    ({"alpha": 0}, {}, ["alpha: Input should be greater than 0"]),
    ({"rollout_batch_size": 0}, {}, ["rollout_batch_size: Input should be greater than 0"]),
    ({"rollout_batch_size": 3, "n_samples_per_prompt": 1}, {"dp_size": 2},
     ["rollout_batch_size (3) must be a multiple of 2", "2 data-parallel ranks"]),
    ({"n_samples_per_prompt": 3}, {"dp_size": 2}, ["divisor or a multiple", "change n_samples_per_prompt"]),
    ({"n_samples_per_prompt": -1}, {}, ["n_samples_per_prompt: Input should be greater than 0, got -1"]),
    ({}, {"save": None}, ["no save directory", "--save"]),
    ({}, {"rm_type": None}, ["no reward", "rm_type or custom_rm_path"]),
    ({"num_step": 0}, {}, ["num_step: Input should be greater than 0"]),
    ({"num_epoch": -2}, {}, ["num_epoch: Input should be greater than 0, got -2"]),
    ({"rollout_batch_size": 16, "n_samples_per_prompt": 4}, {},
     ["= 64 exceeds --multi-lora-max-adapter-global-batch-size 32", "lower rollout_batch_size"]),
    ({"lr_decay_style": "step"}, {}, ["lr_decay_style: Input should be 'constant', 'linear' or 'cosine', got 'step'"]),
    ({"lr": -1.0}, {}, ["lr: Input should be greater than or equal to 0, got -1.0"]),
    ({"weight_decay": "0.1"}, {}, ["weight_decay: Input should be a valid number, got '0.1'"]),
    ({"lr_warmup_steps": -1}, {}, ["lr_warmup_steps: Input should be greater than or equal to 0"]),
    ({"metadata": ["x"]}, {}, ["metadata: Input should be a valid dictionary"]),
    ({"input_key": ""}, {}, ["input_key: String should have at least 1 character"]),
    ({"data": "missing.jsonl"}, {}, ["data file 'missing.jsonl' does not exist"]),
    ({"data": "train.csv"}, {}, ["must be a .jsonl, .json or .parquet file"]),
    ({"data": 5}, {}, ["data: Input should be a valid string, got 5"]),
    ({"alpha": "16"}, {}, ["alpha: Input should be a valid number, got '16'"]),
    ({"lr": True}, {}, ["lr: Input should be a valid number, got True"]),
    ({"metadata": {"blob": "x" * 70_000}}, {}, ["metadata: Value error, metadata is 70012 bytes as JSON",
                                                "at most 65536"]),
    ({"rank": 0, "lr": "fast", "rnk": 1}, {}, ["unknown key(s) ['rnk']", "rank: Input should be greater than 0",
                                                "lr: Input should be a valid number, got 'fast'"]),
]


@pytest.mark.parametrize("overrides, default_overrides, needles", RULES)
def test_validation_rules(overrides: dict[str, Any], default_overrides: dict[str, Any], needles: list[str],
                          data_file: Path, defaults: AdapterDefaults) -> None:
    raw = {"data": str(data_file), **overrides}
    with pytest.raises(AdapterConfigError) as err:
        resolve_adapter_config("tenant-7", raw, dataclasses.replace(defaults, **default_overrides))
    message = str(err.value)
    assert message.startswith("Adapter 'tenant-7'")
    for needle in needles:
        assert needle in message


def test_valid_dp_combinations(data_file: Path, defaults: AdapterDefaults) -> None:
    # dp=4, n=2: a prompt group is half a rank's share, so groups come in pairs.
    four_ranks = dataclasses.replace(defaults, dp_size=4)
    assert resolve_adapter_config("x", {"data": str(data_file), "n_samples_per_prompt": 2,
                                        "rollout_batch_size": 2}, four_ranks).rollout_batch_size == 2
    assert resolve_adapter_config("x", {"data": str(data_file), "n_samples_per_prompt": 8,
                                        "rollout_batch_size": 3}, four_ranks).adapter_global_batch_size == 24


def test_custom_reward_alone_is_enough(data_file: Path, defaults: AdapterDefaults) -> None:
    resolved = resolve_adapter_config("x", {"data": str(data_file), "custom_rm_path": "pkg.mod.fn"},
                                      dataclasses.replace(defaults, rm_type=None))
    assert (resolved.rm_type, resolved.custom_rm_path) == (None, "pkg.mod.fn")


def test_num_step_wins_over_num_epoch_with_warning(data_file: Path, defaults: AdapterDefaults,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="miles.utils.adapter_config"):
        resolved = resolve_adapter_config("x", {"data": str(data_file), "num_step": 5, "num_epoch": 2}, defaults)
    assert (resolved.num_step, resolved.num_epoch) == (5, 2)
    assert "num_step wins" in caplog.text


def test_unresolved_global_batch_size_is_an_error() -> None:
    with pytest.raises(AdapterConfigError, match="resolve_adapter_config"):
        _ = AdapterRunConfig(data="x.jsonl").adapter_global_batch_size


def test_path_within_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    assert path_within_roots(root / "sub" / "x.jsonl", [root])
    assert not path_within_roots(root / ".." / "outside" / "x.jsonl", [root])
    assert not path_within_roots(root / "escape" / "x.jsonl", [root])
    assert path_within_roots(tmp_path / "outside" / "x", [root, tmp_path / "outside"])


def test_status_carries_every_config_field() -> None:
    lifecycle = {"name", "state", "slot", "version", "step", "accumulated_groups", "registration_id", "last_error",
                 "queue_position", "priority"}
    # A Tinker model's own fields (its config has no data etc.): its id, seed and LoRA layout.
    client_driven = {"kind", "model_id", "seed", "train_attn", "train_mlp", "train_unembed"}
    assert set(AdapterStatus.model_fields) == lifecycle | set(ADAPTER_CONFIG_KEYS) | client_driven


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path: Path, data_file: Path, defaults: AdapterDefaults) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(f"data: {data_file}\nlr: 1e-3\nweight_decay: 5E-2\nalpha: 3.2e1\nmetadata:\n  note: '1e-3'\n")
    raw = parse_adapter_run_yaml(path)
    assert (raw.lr, raw.weight_decay, raw.alpha) == (0.001, 0.05, 32.0)
    assert raw.metadata == {"note": "1e-3"}  # a quoted string stays a string
    assert resolve_adapter_config("exp", raw, defaults).lr == 0.001


@pytest.mark.parametrize("text", [
    "data: &d x.jsonl\nsave: *d\n",
    "data: x.jsonl\nmetadata:\n  a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n  b: [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "  c: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n",
])
def test_yaml_anchors_and_aliases_are_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(AdapterConfigError,
                       match=r"Adapter .bomb.: .*anchors and aliases \(&name / \*name\) are not accepted"):
        parse_adapter_run_yaml(path)


def test_oversized_yaml_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("data: x.jsonl\nmetadata:\n" + "".join(f"  k{i}: {'v' * 100}\n" for i in range(11_000)))
    with pytest.raises(AdapterConfigError, match=f"larger than {MAX_CONFIG_FILE_BYTES} bytes"):
        parse_adapter_run_yaml(path)


def test_name_length_is_limited() -> None:
    assert validate_adapter_name("a" * MAX_ADAPTER_NAME_LENGTH) == "a" * MAX_ADAPTER_NAME_LENGTH
    for length in [MAX_ADAPTER_NAME_LENGTH + 1, 256, 5000]:
        with pytest.raises(AdapterConfigError) as err:
            validate_adapter_name("n" * length)
        assert f"({length} characters): use at most 64 characters" in str(err.value)
        assert len(str(err.value)) < 200  # the name itself is not echoed in full


def test_reward_defaults_are_not_copied_into_the_adapter(data_file: Path, defaults: AdapterDefaults) -> None:
    # --rm-type stays the last resort, so a row's metadata rm_type can still win.
    assert defaults.rm_type == "math"
    plain = resolve_adapter_config("x", {"data": str(data_file)}, defaults)
    assert (plain.rm_type, plain.custom_rm_path) == (None, None)
    own = resolve_adapter_config("x", {"data": str(data_file), "rm_type": "f1"}, defaults)
    assert own.rm_type == "f1"
    # --custom-rm-path is the reward of adapters that name none of their own.
    with_custom = dataclasses.replace(defaults, custom_rm_path="pkg.mod.fn")
    assert resolve_adapter_config("x", {"data": str(data_file)}, with_custom).custom_rm_path == "pkg.mod.fn"
    assert resolve_adapter_config("x", {"data": str(data_file), "rm_type": "f1"}, with_custom).custom_rm_path is None


def test_config_is_a_frozen_pydantic_model_with_a_schema(data_file: Path) -> None:
    cfg = AdapterRunConfig(data=str(data_file), rank=2)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.rank = 3  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AdapterRunConfig(data=str(data_file), rnak=2)  # type: ignore[call-arg]
    schema = AdapterRunConfig.model_json_schema()
    assert schema["required"] == ["data"] and schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(ADAPTER_CONFIG_KEYS)
    assert "LoRA rank" in schema["properties"]["rank"]["description"]


def test_plugin_paths_of_an_adapter_are_checked_at_resolution(data_file: Path, defaults: AdapterDefaults) -> None:
    good = {"data": str(data_file), "custom_generate_function_path": "miles.recipes.calculator_tool.generate",
            "dynamic_sampling_filter_path": "miles.rollout.filters.call_dynamic_filter"}
    cfg = resolve_adapter_config("calc", good, defaults)
    assert cfg.custom_generate_function_path == "miles.recipes.calculator_tool.generate"
    for key in ("custom_generate_function_path", "dynamic_sampling_filter_path"):
        with pytest.raises(AdapterConfigError, match=f"Adapter 'calc': {key} 'no_such_pkg.fn' cannot be imported"):
            resolve_adapter_config("calc", {"data": str(data_file), key: "no_such_pkg.fn"}, defaults)
    status_fields = AdapterStatus.model_fields
    assert {"custom_generate_function_path", "dynamic_sampling_filter_path"} <= set(status_fields)


def test_label_key_left_out_takes_the_flag_and_null_means_no_label(data_file: Path, defaults: AdapterDefaults) -> None:
    with_flag = dataclasses.replace(defaults, label_key="answer")
    assert resolve_adapter_config("a", {"data": str(data_file)}, with_flag).label_key == "answer"
    assert resolve_adapter_config("a", {"data": str(data_file), "label_key": None}, with_flag).label_key is None
    assert resolve_adapter_config("a", {"data": str(data_file)}, defaults).label_key is None  # Miles: no --label-key
    yaml_null = data_file.with_name("null.yaml")
    yaml_null.write_text(f"data: {data_file}\nlabel_key:\n")
    assert resolve_adapter_config("a", parse_adapter_run_yaml(yaml_null), with_flag).label_key is None
    resolved = resolve_adapter_config("a", {"data": str(data_file), "label_key": None}, with_flag)
    assert resolve_adapter_config("a", resolved, with_flag).label_key is None  # resolving again keeps it
    assert AdapterStatus(name="a", state="ACTIVE", slot=0, version=0, step=0, accumulated_groups=0,
                         registration_id="r", **resolved.to_dict()).label_key is None


def test_adapter_loss_keys_override_the_trainer_flags(data_file: Path, defaults: AdapterDefaults) -> None:
    cli = dataclasses.replace(defaults, loss=LossSettings(eps_clip=0.2, use_tis=True, entropy_coef=0.01))
    raw = {"data": str(data_file), "loss": {"advantage_estimator": "gspo", "eps_clip": 0.3, "use_tis": False,
                                            "use_rollout_logprobs": True, "disable_grpo_std_normalization": True}}
    settings = resolve_adapter_config("a", raw, cli).loss_settings()
    # = dataclasses.replace(cli_settings, **overrides), with Miles' flag names
    assert settings == dataclasses.replace(
        cli.loss, advantage_estimator="gspo", eps_clip=0.3, use_tis=False, use_rollout_logprobs=True,
        grpo_std_normalization=False)
    assert settings.clip_high == 0.3  # eps_clip_high left unset follows the adapter's eps_clip
    assert resolve_adapter_config("b", {"data": str(data_file)}, cli).loss_settings() == cli.loss


def test_an_adapter_may_train_with_reinforce_plus_plus(data_file: Path, defaults: AdapterDefaults) -> None:
    raw = {"data": str(data_file), "loss": {"advantage_estimator": "reinforce_plus_plus_baseline",
                                            "normalize_advantages": True, "kl_coef": 0.05}}
    settings = resolve_adapter_config("a", raw, defaults).loss_settings()
    assert (settings.advantage_estimator, settings.normalize_advantages, settings.kl_coef) == (
        "reinforce_plus_plus_baseline", True, 0.05)


def test_adapter_loss_keys_from_yaml_with_null(data_file: Path, defaults: AdapterDefaults) -> None:
    cli = dataclasses.replace(defaults, loss=LossSettings(eps_clip_high=0.4, eps_clip_c=3.0))
    path = data_file.with_name("loss.yaml")
    path.write_text(f"data: {data_file}\nloss:\n  eps_clip_c: null\n  kl_loss_type: k3\n  use_kl_loss: true\n"
                    "  kl_loss_coef: 1e-3\n")
    settings = resolve_adapter_config("a", parse_adapter_run_yaml(path), cli).loss_settings()
    assert (settings.eps_clip_c, settings.eps_clip_high, settings.kl_loss_coef, settings.kl_loss_type) == (
        None, 0.4, 0.001, "k3")


@pytest.mark.parametrize("loss, fragment", [
    ({"eps_clp": 0.1}, "loss.eps_clp"),
    ({"eps_clip": "wide"}, "loss.eps_clip"),
    ({"kl_loss_type": "k9"}, "loss.kl_loss_type"),
    ({"advantage_estimator": "reinforce_plus_plus"}, "loss (advantage_estimator over the trainer's flags): "
                                                     "--advantage-estimator reinforce_plus_plus requires"),
    ({"use_rollout_logprobs": True, "use_tis": True}, "cannot be set at the same time"),
    ({"custom_tis_function_path": "no_such_module_xyz.fn"}, "no_such_module_xyz"),
])
def test_bad_adapter_loss_keys_name_the_adapter_and_the_key(data_file: Path, defaults: AdapterDefaults,
                                                           loss: dict[str, Any], fragment: str) -> None:
    with pytest.raises(AdapterConfigError) as exc:
        resolve_adapter_config("tenant", {"data": str(data_file), "loss": loss}, defaults)
    assert str(exc.value).startswith("Adapter 'tenant': ") and fragment in str(exc.value)


def test_status_reports_every_loss_setting(data_file: Path, defaults: AdapterDefaults) -> None:
    resolved = resolve_adapter_config("a", {"data": str(data_file), "loss": {"entropy_coef": 0.02}}, defaults)
    status = AdapterStatus(name="a", state="ACTIVE", slot=0, version=0, step=0, accumulated_groups=0,
                           registration_id="r", **resolved.to_dict())
    assert status.loss == {**LossSettings().flags(), "entropy_coef": 0.02}
