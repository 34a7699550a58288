"""Per-adapter run config (`adapter.yaml`): parsing, defaults and validation.

An adapter is one tenant: one LoRA, one dataset, one reward and one optimizer. Its
config comes from a YAML file or inline JSON (POST /adapter_runs); only `data` is
required, every other field defaults to the trainer's flag of the same meaning:

    raw = parse_adapter_run_yaml("configs/adapters/math.yaml")
    cfg = resolve_adapter_config("math", raw, AdapterDefaults.from_config(miles_cfg))

`AdapterRunConfig` is a frozen pydantic model: field types and bounds are checked by
pydantic (so the control plane's `/docs` shows the schema), unknown keys are an error (a
typo never trains silently with a default), and numbers are never read from strings.
Resolution fills the defaults and applies the rules that need the trainer's flags
(DESIGN §4); each error names the adapter and says what to change.
"""

from __future__ import annotations

import json
import logging
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from miles.utils.arguments import MilesConfig
from miles.utils.loss_settings import ADAPTER_LOSS_KEYS, KL_LOSS_TYPES, LossSettings
from miles.utils.plugins import PluginError, load_object, path_in_modules
from miles.utils.safe_yaml import load_yaml

logger = logging.getLogger(__name__)

T = TypeVar("T")

ADAPTER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_ADAPTER_NAME_LENGTH = 64
"""Names become directory names and request-id prefixes; 64 keeps every path short."""
MAX_METADATA_BYTES = 64 * 1024
"""`metadata` is copied into every sample and echoed by every status call."""
MAX_CONFIG_FILE_BYTES = 1024 * 1024
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
LR_DECAY_STYLES = ("constant", "linear", "cosine")

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class AdapterConfigError(ValueError):
    """An adapter config that cannot be used; the message names the adapter and the fix."""


class AdapterLossSettings(BaseModel):
    """An adapter's `loss:` mapping: Miles' loss flags by name (`eps_clip_high: 0.28`).

    Keys left out take the trainer's flag; a key given as null sets the setting to None
    (`eps_clip_high: null` means "= eps_clip"). After resolution every key is set."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    advantage_estimator: NonEmptyStr | None = None
    disable_grpo_std_normalization: bool | None = None
    disable_rewards_normalization: bool | None = None
    normalize_advantages: bool | None = None
    gamma: float | None = None
    kl_coef: float | None = None
    use_kl_loss: bool | None = None
    kl_loss_coef: float | None = None
    kl_loss_type: Literal[KL_LOSS_TYPES] | None = None  # type: ignore[valid-type]
    use_unbiased_kl: bool | None = None
    entropy_coef: float | None = None
    eps_clip: float | None = None
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    use_tis: bool | None = None
    tis_clip: float | None = None
    tis_clip_low: float | None = None
    use_rollout_logprobs: bool | None = None
    custom_tis_function_path: NonEmptyStr | None = None

    def overrides(self) -> dict[str, Any]:
        """The keys the adapter gave (null included), by flag name."""
        return self.model_dump(exclude_unset=True)

    def settings(self) -> LossSettings:
        """The `LossSettings` of a resolved config (every key set)."""
        return LossSettings.from_flags(**self.model_dump())


assert tuple(AdapterLossSettings.model_fields) == ADAPTER_LOSS_KEYS


class AdapterRunConfig(BaseModel):
    """One adapter's run settings. `None` means "use the trainer's default" until
    `resolve_adapter_config` fills it; after resolution only `num_step`, `num_epoch`,
    `rm_type` and `custom_rm_path` may remain None (the reward then comes from the
    sample's metadata or `--rm-type`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    data: NonEmptyStr = Field(description="Dataset file (jsonl, json or parquet); absolute after resolution.")
    rank: PositiveInt | None = Field(None, description="LoRA rank, at most --lora-rank (the slot width).")
    alpha: PositiveFloat | None = Field(None, description="LoRA alpha (scaling = alpha / rank).")
    rollout_batch_size: PositiveInt | None = Field(None, description="Prompt groups per optimizer step.")
    n_samples_per_prompt: PositiveInt | None = Field(None, description="Responses per prompt.")
    save: Annotated[Path, Field(strict=False)] | None = Field(
        None, description="Save directory; default {--save}/adapters/{name}; absolute after resolution.")
    input_key: NonEmptyStr | None = Field(None, description="Prompt key of dataset rows.")
    label_key: NonEmptyStr | None = Field(None, description="Label key of dataset rows.")
    metadata_key: NonEmptyStr | None = Field(None, description="Metadata key of dataset rows.")
    rm_type: NonEmptyStr | None = Field(
        None, description="Built-in reward; unset: the sample's metadata rm_type, then --rm-type.")
    custom_rm_path: NonEmptyStr | None = Field(None, description="Dotted path to fn(args, sample) -> float.")
    custom_generate_function_path: NonEmptyStr | None = Field(
        None, description="Dotted path to async fn(input: GenerateFnInput) -> Sample; "
                          "unset: --custom-generate-function-path.")
    dynamic_sampling_filter_path: NonEmptyStr | None = Field(
        None, description="Dotted path to fn(args, samples) -> DynamicFilterOutput | bool; "
                          "unset: --dynamic-sampling-filter-path.")
    num_step: PositiveInt | None = Field(
        None, description="Optimizer steps to train, counted from the step the adapter (re)started at; "
                          "unset: num_epoch (default 1) passes over the dataset.")
    num_epoch: PositiveInt | None = Field(None, description="Epochs over the dataset (num_step wins if both).")
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Merged into every sample's metadata (the sample's keys win).")
    lr: NonNegativeFloat | None = Field(None, description="Learning rate.")
    weight_decay: NonNegativeFloat | None = Field(None, description="AdamW weight decay.")
    lr_decay_style: Literal["constant", "linear", "cosine"] | None = Field(None, description="LR schedule.")
    lr_warmup_steps: NonNegativeInt | None = Field(None, description="Warmup in optimizer steps.")
    loss: AdapterLossSettings | None = Field(
        None, description="Loss and advantage settings by Miles' flag names; keys left out take the trainer's flags.")

    @field_validator("metadata", mode="before")
    @classmethod
    def _empty_metadata(cls, value: Any) -> Any:
        return {} if value is None else value  # `metadata:` with nothing after it in YAML

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        size = len(json.dumps(value, default=str).encode())
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES} are accepted")
        return value

    @property
    def adapter_global_batch_size(self) -> int:
        """Samples per optimizer step: `rollout_batch_size * n_samples_per_prompt`."""
        return adapter_global_batch_size(resolved_field(self.rollout_batch_size, "rollout_batch_size"),
                                         resolved_field(self.n_samples_per_prompt, "n_samples_per_prompt"))

    def loss_settings(self) -> LossSettings:
        """The adapter's loss settings (a resolved config has all of them)."""
        if self.loss is None:
            raise AdapterConfigError("loss_settings needs a resolved config (call resolve_adapter_config)")
        return self.loss.settings()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (`save` as a string)."""
        out = self.model_dump()
        out["save"] = None if self.save is None else str(self.save)
        return out


def resolved_field(value: T | None, name: str) -> T:
    """A field of a resolved config (`resolve_adapter_config` filled in every default)."""
    if value is None:
        raise AdapterConfigError(f"{name} needs a resolved adapter config (call resolve_adapter_config)")
    return value


ADAPTER_CONFIG_KEYS: tuple[str, ...] = tuple(AdapterRunConfig.model_fields)


_FLAGS = MilesConfig()
"""The trainer's flags at their defaults (resolved): the one source of an adapter's defaults."""


@dataclass(frozen=True)
class AdapterDefaults:
    """The process-wide flags an adapter config falls back to.

    Built from the trainer's flags (`from_config`); constructed directly (tests, the
    standalone control plane) every field not given is the flag's own default."""

    lora_rank: int = _FLAGS.lora_rank
    lora_alpha: float = _FLAGS.lora_alpha
    rollout_batch_size: int = _FLAGS.rollout_batch_size
    n_samples_per_prompt: int = _FLAGS.n_samples_per_prompt
    save: str | None = _FLAGS.save
    input_key: str = "text"
    """Miles' adapters read prompts from `text` unless their config says otherwise (the
    flag `--input-key` is the single policy's)."""
    label_key: str | None = _FLAGS.label_key
    """None: rows carry no label (Miles' default)."""
    metadata_key: str = _FLAGS.metadata_key
    rm_type: str | None = _FLAGS.rm_type
    custom_rm_path: str | None = _FLAGS.custom_rm_path
    lr: float = _FLAGS.lr
    weight_decay: float = _FLAGS.weight_decay
    lr_decay_style: str = _FLAGS.lr_decay_style
    lr_warmup_steps: int = _FLAGS.lr_warmup_steps
    dp_size: int = resolved_field(_FLAGS.actor_num_workers, "--actor-num-workers")
    """Data-parallel train ranks (`--actor-num-workers`)."""
    max_adapter_global_batch_size: int = resolved_field(_FLAGS.multi_lora_max_adapter_global_batch_size,
                                                        "--multi-lora-max-adapter-global-batch-size")
    loss: LossSettings = _FLAGS.loss
    """The trainer's loss flags; an adapter's `loss:` keys override them."""

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> AdapterDefaults:
        return cls(
            lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
            rollout_batch_size=cfg.rollout_batch_size, n_samples_per_prompt=cfg.n_samples_per_prompt,
            save=cfg.save, label_key=cfg.label_key, metadata_key=cfg.metadata_key,
            # Miles reads --input-key for its single policy; its multi-LoRA adapters default to "text"
            input_key=cfg.input_key if cfg.multi_lora_n_adapters == 0 else "text",
            rm_type=cfg.rm_type, custom_rm_path=cfg.custom_rm_path,
            lr=cfg.lr, weight_decay=cfg.weight_decay, lr_decay_style=cfg.lr_decay_style,
            lr_warmup_steps=cfg.lr_warmup_steps, dp_size=cfg.actor_num_workers,
            max_adapter_global_batch_size=cfg.multi_lora_max_adapter_global_batch_size, loss=cfg.loss,
        )


def adapter_global_batch_size(rollout_batch_size: int, n_samples_per_prompt: int) -> int:
    return rollout_batch_size * n_samples_per_prompt


def min_groups_per_dp_split(n_samples_per_prompt: int, dp_size: int) -> int:
    """Fewest prompt groups whose samples split evenly over `dp_size` ranks.

    >>> min_groups_per_dp_split(4, 2), min_groups_per_dp_split(2, 8), min_groups_per_dp_split(3, 1)
    (1, 4, 1)
    """
    if n_samples_per_prompt <= 0 or dp_size <= 0:
        raise ValueError(f"n_samples_per_prompt ({n_samples_per_prompt}) and dp_size ({dp_size}) must be > 0")
    larger, smaller = max(n_samples_per_prompt, dp_size), min(n_samples_per_prompt, dp_size)
    if larger % smaller:
        raise ValueError(
            f"n_samples_per_prompt ({n_samples_per_prompt}) must be a divisor or a multiple of the "
            f"trainer's data-parallel size ({dp_size})"
        )
    return larger // n_samples_per_prompt


def validate_adapter_name(name: Any) -> str:
    """Names become path components and request-id prefixes (`{name}::...`)."""
    if not isinstance(name, str) or not ADAPTER_NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise AdapterConfigError(
            f"Invalid adapter name {_short_repr(name)}: use only letters, digits, '.', '_' and '-' "
            "(not '.' or '..' alone, no '/', '::' or spaces)"
        )
    if len(name) > MAX_ADAPTER_NAME_LENGTH:
        raise AdapterConfigError(
            f"Invalid adapter name {_short_repr(name)} ({len(name)} characters): "
            f"use at most {MAX_ADAPTER_NAME_LENGTH} characters"
        )
    return name


def config_from_mapping(name: str, raw: Any, source: str = "config") -> AdapterRunConfig:
    """Build an unresolved config from a mapping (parsed YAML or JSON)."""
    if not isinstance(raw, dict):
        raise AdapterConfigError(f"Adapter '{name}': {source} must be a mapping of fields, got {type(raw).__name__}")
    try:
        return AdapterRunConfig.model_validate(raw)
    except ValidationError as exc:
        raise AdapterConfigError(describe_config_errors(name, source, exc)) from None


def describe_config_errors(name: str, source: str, exc: ValidationError) -> str:
    """One message naming the adapter and every bad field (unknown keys listed first)."""
    errors = exc.errors(include_url=False)
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    unknown = sorted(str(e["loc"][-1]) for e in extra if len(e["loc"]) == 1)
    unknown_loss = sorted(f"loss.{e['loc'][-1]}" for e in extra if len(e["loc"]) == 2 and e["loc"][0] == "loss")
    parts = []
    if unknown:
        parts.append(f"unknown key(s) {unknown} in {source}; valid keys are {list(ADAPTER_CONFIG_KEYS)}")
    if unknown_loss:
        parts.append(f"unknown key(s) {unknown_loss} in {source}; valid loss keys are {list(ADAPTER_LOSS_KEYS)}")
    for error in errors:
        field = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            continue
        if error["type"] == "missing" and field == "data":
            parts.append(f"'data' is required in {source} (path to a jsonl, json or parquet file)")
        else:
            parts.append(f"{field}: {error['msg']}, got {_short_repr(error.get('input'))}")
    return f"Adapter '{name}': " + "; ".join(parts)


def parse_adapter_run_yaml(path: str | Path, name: str | None = None) -> AdapterRunConfig:
    """Read an `adapter.yaml` (safe loader, no aliases); the adapter name defaults to the file stem."""
    path = Path(path)
    name = name or path.stem
    _check_regular_file(name, "config file", str(path), path.expanduser().resolve())  # a FIFO would block
    try:
        if path.stat().st_size > MAX_CONFIG_FILE_BYTES:
            raise AdapterConfigError(
                f"Adapter '{name}': config file {path} is larger than {MAX_CONFIG_FILE_BYTES} bytes"
            )
        raw = load_yaml(path.read_bytes())
    except FileNotFoundError:
        raise AdapterConfigError(f"Adapter '{name}': config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AdapterConfigError(f"Adapter '{name}': cannot read config file {path} ({exc})") from None
    except yaml.YAMLError as exc:
        raise AdapterConfigError(f"Adapter '{name}': config file {path} is not valid YAML ({exc})") from None
    return config_from_mapping(name, raw if raw is not None else {}, source=str(path))


def resolve_adapter_config(
    name: str, raw: dict[str, Any] | AdapterRunConfig, defaults: AdapterDefaults
) -> AdapterRunConfig:
    """Fill the defaults from the process flags and apply every validation rule.

    The reward is not copied from `--rm-type`: an adapter without `rm_type` takes the
    sample's `metadata["rm_type"]` first, then `--rm-type` (resolved per sample). An
    adapter naming no reward at all gets `--custom-rm-path`, if set.
    """
    validate_adapter_name(name)
    cfg = raw if isinstance(raw, AdapterRunConfig) else config_from_mapping(name, raw)
    fallbacks = {
        "rank": defaults.lora_rank, "alpha": defaults.lora_alpha,
        "rollout_batch_size": defaults.rollout_batch_size, "n_samples_per_prompt": defaults.n_samples_per_prompt,
        "input_key": defaults.input_key, "label_key": defaults.label_key, "metadata_key": defaults.metadata_key,
        "lr": defaults.lr, "weight_decay": defaults.weight_decay, "lr_decay_style": defaults.lr_decay_style,
        "lr_warmup_steps": defaults.lr_warmup_steps,
    }
    values = cfg.model_dump()
    for key, fallback in fallbacks.items():
        if values[key] is None and not (key == "label_key" and "label_key" in cfg.model_fields_set):
            values[key] = fallback  # `label_key: null` given: rows carry no label
    values["loss"] = _resolve_loss(name, cfg.loss, defaults.loss)
    if cfg.rm_type is None and cfg.custom_rm_path is None:
        values["custom_rm_path"] = defaults.custom_rm_path
    values["data"] = str(_resolve_data(name, cfg.data))
    values["save"] = _resolve_save(name, cfg.save, defaults.save)
    try:
        filled = AdapterRunConfig.model_validate(values)
    except ValidationError as exc:  # a default out of range (flags are checked, code may not be)
        raise AdapterConfigError(describe_config_errors(name, "the trainer's defaults", exc)) from None
    _check_combination(name, filled, defaults)
    return filled


def _resolve_loss(name: str, loss: AdapterLossSettings | None, base: LossSettings) -> dict[str, Any]:
    """Every loss flag: the trainer's, with the adapter's keys over them; checked as Miles
    checks its flags."""
    overrides = loss.overrides() if loss is not None else {}
    try:
        settings = base.with_overrides(**overrides)
    except ValueError as exc:
        keys = ", ".join(sorted(overrides)) or "none"
        raise AdapterConfigError(f"Adapter '{name}': loss ({keys} over the trainer's flags): {exc}") from None
    if "custom_tis_function_path" in overrides and settings.custom_tis_function_path is not None:
        try:
            load_object(settings.custom_tis_function_path, kind="loss.custom_tis_function_path")
        except PluginError as exc:
            raise AdapterConfigError(f"Adapter '{name}': {exc}") from None
    return settings.flags()


def resolve_num_step(config: AdapterRunConfig, dataset_rows: int) -> AdapterRunConfig:
    """Fix `num_step` from the dataset's row count when the config left it unset:
    `max(1, (num_epoch or 1) * rows // rollout_batch_size)`.

    >>> cfg = AdapterRunConfig(data="d.jsonl", rollout_batch_size=4, num_epoch=3)
    >>> resolve_num_step(cfg, 10).num_step
    7
    """
    if config.num_step is not None:
        return config
    if config.rollout_batch_size is None:
        raise AdapterConfigError("resolve_num_step needs a resolved config (call resolve_adapter_config)")
    num_step = max(1, (config.num_epoch or 1) * dataset_rows // config.rollout_batch_size)
    return config.model_copy(update={"num_step": num_step})


def _check_combination(name: str, cfg: AdapterRunConfig, defaults: AdapterDefaults) -> None:
    assert cfg.rank is not None and cfg.rollout_batch_size is not None and cfg.n_samples_per_prompt is not None
    if cfg.rank > defaults.lora_rank:
        raise AdapterConfigError(
            f"Adapter '{name}': rank {cfg.rank} exceeds the slot width --lora-rank {defaults.lora_rank}; "
            f"lower rank or restart the trainer with a larger --lora-rank"
        )
    try:
        min_groups = min_groups_per_dp_split(cfg.n_samples_per_prompt, defaults.dp_size)
    except ValueError as exc:
        raise AdapterConfigError(f"Adapter '{name}': {exc}; change n_samples_per_prompt") from None
    if cfg.rollout_batch_size % min_groups:
        raise AdapterConfigError(
            f"Adapter '{name}': rollout_batch_size ({cfg.rollout_batch_size}) must be a multiple of "
            f"{min_groups} (the fewest prompt groups of {cfg.n_samples_per_prompt} samples that split "
            f"evenly over {defaults.dp_size} data-parallel ranks)"
        )
    global_batch = cfg.adapter_global_batch_size
    if global_batch > defaults.max_adapter_global_batch_size:
        raise AdapterConfigError(
            f"Adapter '{name}': rollout_batch_size * n_samples_per_prompt = {global_batch} exceeds "
            f"--multi-lora-max-adapter-global-batch-size {defaults.max_adapter_global_batch_size}; "
            "lower rollout_batch_size or n_samples_per_prompt"
        )
    if not (cfg.rm_type or cfg.custom_rm_path or defaults.rm_type or defaults.custom_rm_path):
        raise AdapterConfigError(
            f"Adapter '{name}': no reward: set rm_type or custom_rm_path in the adapter config "
            "(or start the trainer with --rm-type / --custom-rm-path)"
        )
    for key in ("custom_generate_function_path", "dynamic_sampling_filter_path"):
        if (path := getattr(cfg, key)) is not None:
            try:
                load_object(path, kind=key)
            except PluginError as exc:
                raise AdapterConfigError(f"Adapter '{name}': {exc}") from None
    if cfg.num_step is not None and cfg.num_epoch is not None:
        logger.warning("Adapter '%s': both num_step (%d) and num_epoch (%d) set; num_step wins",
                       name, cfg.num_step, cfg.num_epoch)


PLUGIN_FIELDS = ("custom_rm_path", "custom_generate_function_path", "dynamic_sampling_filter_path",
                 "loss.custom_tis_function_path")
"""The keys of an adapter config that name a function to import and call."""


def plugin_paths(cfg: AdapterRunConfig) -> dict[str, str]:
    """Each plug-in path the config names, by its key."""
    paths = {key: getattr(cfg, key) for key in PLUGIN_FIELDS if "." not in key}
    if cfg.loss is not None:
        paths["loss.custom_tis_function_path"] = cfg.loss.custom_tis_function_path
    return {key: path for key, path in paths.items() if path is not None}


def check_plugin_modules(name: str, cfg: AdapterRunConfig, modules: tuple[str, ...]) -> None:
    """AdapterConfigError unless every plug-in path of `cfg` lies in one of `modules` (a
    registration from the network may make the trainer call only those)."""
    for key, path in plugin_paths(cfg).items():
        if not path_in_modules(path, modules):
            shown = path if len(path) <= 120 else path[:120] + "..."
            raise AdapterConfigError(
                f"Adapter '{name}': {key} {shown!r} is outside the modules a registration may name "
                f"({', '.join(modules)}); start the trainer with --multi-lora-allowed-plugin-modules "
                f"naming its module, or name the function on the trainer's command line")


def path_within_roots(path: str | Path, roots: list[Path]) -> bool:
    """True when `path`, with symlinks and `..` resolved, lies inside one of `roots`."""
    resolved = Path(path).expanduser().resolve()
    return any(resolved.is_relative_to(Path(root).expanduser().resolve()) for root in roots)


def check_within_roots(name: str, what: str, path: str | Path, roots: list[Path]) -> None:
    if not path_within_roots(path, roots):
        raise AdapterConfigError(
            f"Adapter '{name}': {what} {str(path)!r} is outside the allowed roots "
            f"{[str(r) for r in roots]}; move it inside one of them or start with --multi-lora-allowed-roots"
        )


def _resolve_data(name: str, data: Any) -> Path:
    if not isinstance(data, str) or not data:
        raise AdapterConfigError(f"Adapter '{name}': 'data' must be a path string, got {data!r}")
    given = Path(data).expanduser()
    if given.suffix.lower() not in DATA_SUFFIXES:  # the name given, not a symlink's target
        raise AdapterConfigError(
            f"Adapter '{name}': data {data!r} must be a .jsonl, .json or .parquet file"
        )
    path = given.resolve()
    _check_regular_file(name, "data file", data, path)
    return path


def _check_regular_file(name: str, what: str, given: Any, path: Path) -> None:
    """Missing, unreadable, or not a regular file (a FIFO, device or directory, also
    behind a symlink): each said as it is, without opening the file."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise AdapterConfigError(f"Adapter '{name}': {what} {given!r} does not exist (resolved to {path})") from None
    except OSError as exc:
        raise AdapterConfigError(f"Adapter '{name}': {what} {given!r} cannot be read ({exc})") from None
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                                       (stat.S_ISSOCK, "a socket")) if test(mode)), "special")
        raise AdapterConfigError(
            f"Adapter '{name}': {what} {given!r} is not a regular file ({kind}, resolved to {path})"
        )


def _resolve_save(name: str, save: Path | None, default_root: str | None) -> Path:
    if save is not None:
        return Path(save).expanduser().resolve()
    if default_root is None:
        raise AdapterConfigError(
            f"Adapter '{name}': no save directory: set 'save' in the adapter config or start the trainer with --save"
        )
    return (Path(default_root).expanduser() / "adapters" / name).resolve()


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...'"

