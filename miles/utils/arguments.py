"""Command-line flags of the trainers, parsed once into a typed, frozen `MilesConfig`.

Every flag is a field of `MilesConfig`; the field's default is the flag's default and
its `help` metadata is the flag's help, so defaults live in exactly one place. Flag
names keep Miles' spelling (`multi_lora_n_adapters` <-> `--multi-lora-n-adapters`).

    cfg = parse_args(["--config", "configs/tiny-multi-lora.yaml", "--lr", "1e-4"])

`--config FILE.yaml` holds flag values (keys with `-` or `_`); flags given on the
command line win over the file. Each value is checked against its flag's type (`lr:
1e-3` is the number 0.001; `multi_lora_n_adapters: four` is an error naming the key). An
invalid value or combination exits with status 2 and one line saying what to change. Components take the few fields they need (each defines a
small config of its own with a `from_config(cfg)` constructor), never the whole object.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import TypeAdapter, ValidationError

from miles.utils.safe_yaml import load_yaml


def _flag(default: Any, help: str, **extra: Any) -> Any:
    metadata = {"help": help, **extra}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class ConfigError(ValueError):
    """An invalid flag value or combination; the message says what to change."""


@dataclass(frozen=True)
class MilesConfig:
    # ---- model and backends ----
    hf_checkpoint: str | None = _flag(None, "Hugging Face model directory of the frozen base model.")
    train_backend: Literal["torch", "megatron"] = _flag("torch", "Training backend.")
    actor_num_workers: int = _flag(1, "Data-parallel train ranks (Ray actors).")
    device: Literal["auto", "cpu", "cuda"] = _flag("auto", "Device of train ranks and builtin engines.")
    dtype: Literal["auto", "float32", "bfloat16"] = _flag("auto", "Parameter dtype (auto: bf16 on CUDA, fp32 on CPU).")
    micro_batch_size: int | None = _flag(None, "Samples per forward/backward on a train rank (default: all).")
    seed: int = _flag(42, "Random seed.")

    # ---- LoRA ----
    lora_rank: int = _flag(16, "Slot width: the largest adapter rank (adapters may use less).")
    lora_alpha: float = _flag(16.0, "Default LoRA alpha of an adapter.")
    target_modules: str = _flag("all-linear", "'all-linear' or a comma list such as q_proj,v_proj.")

    # ---- engines and router ----
    rollout_engine: Literal["builtin", "sglang"] = _flag("builtin", "Inference server kind.")
    rollout_num_engines: int = _flag(1, "Inference engines (one server process each).")
    rollout_num_gpus_per_engine: int = _flag(1, "GPUs per engine (sglang tensor parallel size).")
    engine_max_running_requests: int = _flag(64, "Most requests an engine decodes at once.")
    sglang_router_ip: str | None = _flag(None, "Use a running sglang-router at this address.")
    sglang_router_port: int | None = _flag(None, "Port of the running router (with --sglang-router-ip).")

    # ---- rollout ----
    rollout_batch_size: int = _flag(8, "Prompt groups per optimizer step of an adapter (default of adapters).")
    n_samples_per_prompt: int = _flag(4, "Responses per prompt (default of adapters).")
    global_batch_size: int | None = _flag(None, "Samples per train batch (default: rollout_batch_size * n_samples_per_prompt).")
    rollout_max_response_len: int = _flag(1024, "max_new_tokens of each generation.")
    rollout_temperature: float = _flag(1.0, "Sampling temperature.")
    rollout_top_p: float = _flag(1.0, "Top-p of sampling.")
    rollout_top_k: int = _flag(-1, "Top-k of sampling (-1: off).")
    rollout_stop: list[str] = _flag([], "Stop strings.", nargs="*")
    apply_chat_template: bool = _flag(False, "Apply the tokenizer's chat template to prompts.")
    input_key: str = _flag("text", "Prompt key of dataset rows (default of adapters).")
    label_key: str = _flag("label", "Label key of dataset rows (default of adapters).")
    metadata_key: str = _flag("metadata", "Metadata key of dataset rows (default of adapters).")
    rm_type: str | None = _flag(None, "Built-in reward (default of adapters), e.g. math, exact, f1.")
    custom_rm_path: str | None = _flag(None, "Dotted path to fn(args, sample) -> float (default of adapters).")
    dynamic_sampling_filter_path: str | None = _flag(None, "Dotted path to fn(args, samples) -> DynamicFilterOutput or bool keeping a group (default of adapters).")
    custom_generate_function_path: str | None = _flag(None, "Dotted path to async fn(input: GenerateFnInput) -> Sample replacing single-turn generation (default of adapters).")
    rollout_sample_filter_path: str | None = _flag(None, "Dotted path to fn(args, data: list[list[Sample]]) run on each kept group before it is buffered; it sets sample.remove_sample (no loss) or edits loss_mask.")
    max_weight_staleness: int | None = _flag(None, "Drop groups generated more than this many pushes ago.")
    rollout_buffer_steps: int | None = _flag(1, "Generate at most this many optimizer steps of groups ahead per adapter (bounds off-policy lag).")

    # ---- training ----
    lr: float = _flag(1e-4, "Learning rate (default of adapters).")
    min_lr: float = _flag(0.0, "Final learning rate of decaying schedules.")
    weight_decay: float = _flag(0.0, "AdamW weight decay (default of adapters).")
    lr_decay_style: Literal["constant", "linear", "cosine"] = _flag("constant", "LR schedule (default of adapters).")
    lr_warmup_steps: int = _flag(0, "Warmup in optimizer steps (default of adapters).")
    adam_beta1: float = _flag(0.9, "AdamW beta1.")
    adam_beta2: float = _flag(0.999, "AdamW beta2.")
    adam_eps: float = _flag(1e-8, "AdamW epsilon.")
    clip_grad: float = _flag(1.0, "Per-adapter gradient norm clip (0: off).")
    eps_clip: float = _flag(0.2, "PPO clip range (lower).")
    eps_clip_high: float | None = _flag(None, "PPO clip range (upper; default: --eps-clip).")
    use_tis: bool = _flag(False, "Truncated importance sampling against the engine's logprobs.")
    tis_clip: float = _flag(2.0, "Upper bound of the TIS weight.")
    kl_coef: float = _flag(0.0, "KL penalty to the base model (slot switched off).")

    # ---- drivers ----
    prompt_data: str | None = _flag(None, "train_async: dataset of the single policy (jsonl, json or parquet).")
    num_rollout: int = _flag(100, "train_async: rollouts to train on.")
    start_rollout_id: int = _flag(0, "train_async: first rollout id.")
    update_weights_interval: int = _flag(1, "train_async: push weights every N rollouts.")
    save: str | None = _flag(None, "Root of adapter save directories ({save}/adapters/{name}).")
    save_interval: int | None = _flag(None, "Save an adapter every N of its steps.")
    run_dir: str | None = _flag(None, "Where metrics go (default: --save, else runs/latest).")
    use_wandb: bool = _flag(False, "Also log metrics to Weights & Biases.")
    wandb_project: str | None = _flag(None, "W&B project.")

    # ---- multi-LoRA ----
    multi_lora_n_adapters: int = _flag(0, "Slots of the LoRA page table (0: multi-LoRA off).")
    multi_lora_adapter: list[tuple[str, str]] = _flag([], "NAME PATH of an adapter YAML to register at start (repeatable).", nargs=2, action="append", metavar=("NAME", "PATH"))
    multi_lora_adapters: list[str] = _flag([], "Adapter YAMLs to register at start (name = file stem).", nargs="+")
    multi_lora_idle_poll_s: float = _flag(5.0, "Service mode: seconds between polls while no adapter is live.")
    multi_lora_api_host: str = _flag("127.0.0.1", "Bind address of the control plane.")
    multi_lora_api_port: int = _flag(8068, "Port of the control plane (0: ephemeral).")
    multi_lora_api_token: str | None = _flag(None, "Bearer token required on every route but /health (or env MILES_API_TOKEN).")
    multi_lora_allowed_roots: list[str] = _flag([], "Roots that paths in requests must resolve inside (default: cwd and --save).", nargs="+")
    multi_lora_disable_service_mode: bool = _flag(False, "Exit when no adapter is left instead of idling.")
    multi_lora_max_adapter_global_batch_size: int | None = _flag(None, "Largest rollout_batch_size * n_samples_per_prompt of an adapter (default: 4 x global batch).")
    multi_lora_max_coalesce_wait_s: float = _flag(0.5, "Ship a non-empty batch after this long without progress.")
    multi_lora_max_empty_wait_s: float = _flag(30.0, "Raise EmptyBatchTimeoutError after this long with nothing to train.")
    multi_lora_backend_path: str | None = _flag(None, "Dotted path of a MultiLoRABackend subclass.")
    multi_lora_http_server_path: str | None = _flag(None, "Dotted path of a MultiLoRAHTTPServer subclass.")
    multi_lora_registry_path: str | None = _flag(None, "SQLite file the adapter registry is kept in (default: {--save or --run-dir}/controller/registry.sqlite; 'none': memory only).")
    multi_lora_max_dataset_bytes: int = _flag(2 * 1024**3, "Largest dataset file a registration reads (400 above it).")
    multi_lora_dataset_timeout_s: float = _flag(120.0, "Seconds a registration may spend reading its dataset (400 after).")
    multi_lora_registry_path: str | None = _flag(None, "SQLite file the adapter registry is kept in (default: {--save or --run-dir}/controller/registry.sqlite; 'none': memory only).")
    multi_lora_max_dataset_bytes: int = _flag(2 * 1024**3, "Largest dataset file a registration reads (400 above it).")
    multi_lora_dataset_timeout_s: float = _flag(120.0, "Seconds a registration may spend reading its dataset (400 after).")

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.global_batch_size is None:
            set_("global_batch_size", self.rollout_batch_size * self.n_samples_per_prompt)
        if self.multi_lora_max_adapter_global_batch_size is None:
            set_("multi_lora_max_adapter_global_batch_size", 4 * self.global_batch_size)
        if self.eps_clip_high is None:
            set_("eps_clip_high", self.eps_clip)
        if self.multi_lora_api_token is None and os.environ.get("MILES_API_TOKEN"):
            set_("multi_lora_api_token", os.environ["MILES_API_TOKEN"])
        set_("multi_lora_adapter", [tuple(pair) for pair in self.multi_lora_adapter])
        self._validate()

    def _validate(self) -> None:
        positive = ["actor_num_workers", "rollout_num_engines", "lora_rank", "rollout_batch_size",
                    "n_samples_per_prompt", "global_batch_size", "rollout_max_response_len",
                    "engine_max_running_requests", "update_weights_interval"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag_name(name)} must be > 0, got {getattr(self, name)}")
        if self.multi_lora_n_adapters < 0:
            raise ConfigError("--multi-lora-n-adapters must be >= 0 (0 turns multi-LoRA off)")
        if self.lora_alpha <= 0:
            raise ConfigError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if (self.sglang_router_ip is None) != (self.sglang_router_port is None):
            raise ConfigError("give both --sglang-router-ip and --sglang-router-port, or neither")
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError("--save-interval must be > 0 (leave it out to save only at cleanup and exit)")
        if self.rollout_buffer_steps is not None and self.rollout_buffer_steps <= 0:
            raise ConfigError("--rollout-buffer-steps must be > 0 (leave it out for no limit)")
        if self.max_weight_staleness is not None and self.max_weight_staleness < 0:
            raise ConfigError("--max-weight-staleness must be >= 0")
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            raise ConfigError("--micro-batch-size must be > 0")
        names = [name for name, _ in self.multi_lora_adapter] + [Path(p).stem for p in self.multi_lora_adapters]
        if len(set(names)) != len(names):
            raise ConfigError(f"adapter names given at start must be unique, got {names}")
        if names and self.multi_lora_n_adapters == 0:
            raise ConfigError("adapters were given but --multi-lora-n-adapters is 0: set it to the number of slots")
        if len(names) > self.multi_lora_n_adapters > 0:
            raise ConfigError(f"{len(names)} adapters given at start but only {self.multi_lora_n_adapters} slots: raise --multi-lora-n-adapters")

    @property
    def initial_adapters(self) -> list[tuple[str, str]]:
        """(name, yaml path) of the adapters to register at start."""
        return list(self.multi_lora_adapter) + [(Path(p).stem, p) for p in self.multi_lora_adapters]

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device == "cuda" else "float32"

    @property
    def resolved_run_dir(self) -> Path:
        if self.run_dir:
            return Path(self.run_dir)
        if self.save:
            return Path(self.save)
        return Path("runs/latest")

    def replace(self, **changes: Any) -> MilesConfig:
        return dataclasses.replace(self, **changes)


def _flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(element type, optional) of a field annotation such as `int | None`."""
    hint = annotation
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if typing.get_origin(hint) is Literal:
        return str, optional
    if typing.get_origin(hint) in (list, tuple):
        inner = typing.get_args(hint)[0]
        return (str if typing.get_origin(inner) is tuple else inner), optional
    return hint, optional


def _str2bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles", description="Miles multi-LoRA asynchronous RL trainer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", default=None, help="YAML file of flag values; command-line flags win.")
    hints = typing.get_type_hints(MilesConfig)
    for f in dataclasses.fields(MilesConfig):
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        elem, _ = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text, "default": argparse.SUPPRESS}
        if hints[f.name] is bool:
            kwargs.update(action="store_true")
        else:
            kwargs["type"] = elem
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else None
            if choices:
                kwargs["choices"] = choices
            kwargs.update(meta)
        parser.add_argument(f"--{_flag_name(f.name)}", **kwargs)
    return parser


def _load_config_file(path: str) -> dict[str, Any]:
    try:
        data = load_yaml(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    known = {f.name for f in dataclasses.fields(MilesConfig)}
    values = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known:
            raise ConfigError(f"--config {path}: unknown flag {key!r}")
        values[name] = value
    if "multi_lora_adapter" in values and isinstance(values["multi_lora_adapter"], dict):
        values["multi_lora_adapter"] = list(values["multi_lora_adapter"].items())
    return check_types(values, source=f"--config {path}: ")


@functools.cache
def _field_types() -> dict[str, tuple[Any, TypeAdapter[Any]]]:
    hints = typing.get_type_hints(MilesConfig)
    return {f.name: (hints[f.name], TypeAdapter(hints[f.name])) for f in dataclasses.fields(MilesConfig)}


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def check_types(values: dict[str, Any], source: str = "") -> dict[str, Any]:
    """Each value converted to its field's type (pydantic's lax rules: "4" -> 4, 1e-3 ->
    0.001); ConfigError naming the key, the expected type and the value otherwise."""
    types_ = _field_types()
    checked = {}
    for name, value in values.items():
        if name not in types_:
            raise ConfigError(f"{source}unknown flag {name!r}")
        hint, adapter = types_[name]
        try:
            if isinstance(value, bool) and hint is not bool:
                raise ValueError("a boolean is not a " + _type_name(hint))
            checked[name] = adapter.validate_python(value)
        except (ValidationError, ValueError) as exc:
            reason = exc.errors(include_url=False)[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise ConfigError(
                f"{source}{name} (--{_flag_name(name)}) expects {_type_name(hint)}, got {value!r} ({reason})"
            ) from None
    return checked


def config_from_dict(values: dict[str, Any]) -> MilesConfig:
    """Build a config from field values (YAML or code), with type checks."""
    return MilesConfig(**check_types(values))


def parse_args(argv: list[str] | None = None) -> MilesConfig:
    """Parse flags (and `--config`); exit 2 with one clear line when invalid."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        values = _load_config_file(namespace.config) if namespace.config else {}
        values.update({k: v for k, v in vars(namespace).items() if k != "config"})
        return config_from_dict(values)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


if __name__ == "__main__":  # pragma: no cover - manual inspection
    print(parse_args(sys.argv[1:]))
