"""Per-adapter run config (`adapter.yaml`): parsing, defaults and validation.

An adapter is one tenant: one LoRA, one dataset, one reward and one optimizer. Its
config comes from a YAML file or inline JSON (POST /adapter_runs); only `data` is
required, every other field defaults to the trainer's flag of the same meaning:

    raw = parse_adapter_run_yaml("configs/adapters/math.yaml")
    cfg = resolve_adapter_config("math", raw, AdapterDefaults.from_config(miles_cfg))

Resolution fills every default and applies every rule of DESIGN §4; each error names the
adapter and says what to change. Unknown keys are an error, so a typo never trains
silently with a default.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from miles.utils.arguments import MilesConfig

logger = logging.getLogger(__name__)

ADAPTER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]+$")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


class AdapterConfigError(ValueError):
    """An adapter config that cannot be used; the message names the adapter and the fix."""


@dataclass(frozen=True)
class AdapterRunConfig:
    """One adapter's run settings. `None` means "use the trainer's default" until
    `resolve_adapter_config` fills it; after resolution only `num_step`, `num_epoch`
    and one of `rm_type` / `custom_rm_path` may remain None."""

    data: str
    """Dataset file (jsonl, json or parquet); absolute after resolution."""
    rank: int | None = None
    """LoRA rank, at most `--lora-rank` (the slot width)."""
    alpha: float | None = None
    rollout_batch_size: int | None = None
    """Prompt groups per optimizer step of this adapter."""
    n_samples_per_prompt: int | None = None
    save: Path | None = None
    """Save directory; default `{--save}/adapters/{name}`; absolute after resolution."""
    input_key: str | None = None
    label_key: str | None = None
    metadata_key: str | None = None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    num_step: int | None = None
    """Optimizer steps to train, counted from the step the adapter (re)started at."""
    num_epoch: int | None = None
    """Epochs over the dataset; turned into `num_step` once the dataset is loaded."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Merged into every sample's metadata (the sample's own keys win)."""
    lr: float | None = None
    weight_decay: float | None = None
    lr_decay_style: str | None = None
    lr_warmup_steps: int | None = None

    @property
    def adapter_global_batch_size(self) -> int:
        """Samples per optimizer step: `rollout_batch_size * n_samples_per_prompt`."""
        if self.rollout_batch_size is None or self.n_samples_per_prompt is None:
            raise AdapterConfigError("adapter_global_batch_size needs a resolved config (call resolve_adapter_config)")
        return adapter_global_batch_size(self.rollout_batch_size, self.n_samples_per_prompt)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (`save` as a string)."""
        out = dataclasses.asdict(self)
        out["save"] = None if self.save is None else str(self.save)
        return out


ADAPTER_CONFIG_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AdapterRunConfig))


@dataclass(frozen=True)
class AdapterDefaults:
    """The process-wide flags an adapter config falls back to."""

    lora_rank: int = 16
    lora_alpha: float = 16.0
    rollout_batch_size: int = 8
    n_samples_per_prompt: int = 4
    save: str | None = None
    input_key: str = "text"
    label_key: str = "label"
    metadata_key: str = "metadata"
    rm_type: str | None = None
    custom_rm_path: str | None = None
    lr: float = 1e-4
    weight_decay: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_steps: int = 0
    dp_size: int = 1
    """Data-parallel train ranks (`--actor-num-workers`)."""
    max_adapter_global_batch_size: int = 128

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> AdapterDefaults:
        return cls(
            lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
            rollout_batch_size=cfg.rollout_batch_size, n_samples_per_prompt=cfg.n_samples_per_prompt,
            save=cfg.save, input_key=cfg.input_key, label_key=cfg.label_key, metadata_key=cfg.metadata_key,
            rm_type=cfg.rm_type, custom_rm_path=cfg.custom_rm_path,
            lr=cfg.lr, weight_decay=cfg.weight_decay, lr_decay_style=cfg.lr_decay_style,
            lr_warmup_steps=cfg.lr_warmup_steps, dp_size=cfg.actor_num_workers,
            max_adapter_global_batch_size=cfg.multi_lora_max_adapter_global_batch_size,
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
            f"Invalid adapter name {name!r}: use only letters, digits, '.', '_' and '-' "
            "(not '.' or '..' alone, no '/', '::' or spaces)"
        )
    return name


def config_from_mapping(name: str, raw: Any, source: str = "config") -> AdapterRunConfig:
    """Build an unresolved config from a mapping (parsed YAML or JSON)."""
    if not isinstance(raw, dict):
        raise AdapterConfigError(f"Adapter '{name}': {source} must be a mapping of fields, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in ADAPTER_CONFIG_KEYS)
    if unknown:
        raise AdapterConfigError(
            f"Adapter '{name}': unknown key(s) {unknown} in {source}; valid keys are {list(ADAPTER_CONFIG_KEYS)}"
        )
    if raw.get("data") in (None, ""):
        raise AdapterConfigError(f"Adapter '{name}': 'data' is required in {source} (path to a jsonl, json or parquet file)")
    values = dict(raw)
    if values.get("metadata") is None:
        values["metadata"] = {}
    if values.get("save") is not None:
        values["save"] = Path(str(values["save"]))
    return AdapterRunConfig(**values)


def parse_adapter_run_yaml(path: str | Path, name: str | None = None) -> AdapterRunConfig:
    """Read an `adapter.yaml` (safe loader); the adapter name defaults to the file stem."""
    path = Path(path)
    name = name or path.stem
    try:
        raw = yaml.safe_load(path.read_text())
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
    """Fill every default from the process flags and apply every validation rule."""
    validate_adapter_name(name)
    cfg = raw if isinstance(raw, AdapterRunConfig) else config_from_mapping(name, raw)
    filled = dataclasses.replace(
        cfg,
        data=str(_resolve_data(name, cfg.data)),
        rank=_positive_int(name, "rank", _default(cfg.rank, defaults.lora_rank)),
        alpha=_positive_number(name, "alpha", _default(cfg.alpha, defaults.lora_alpha)),
        rollout_batch_size=_positive_int(name, "rollout_batch_size", _default(cfg.rollout_batch_size, defaults.rollout_batch_size)),
        n_samples_per_prompt=_positive_int(name, "n_samples_per_prompt", _default(cfg.n_samples_per_prompt, defaults.n_samples_per_prompt)),
        save=_resolve_save(name, cfg.save, defaults.save),
        input_key=_string(name, "input_key", _default(cfg.input_key, defaults.input_key)),
        label_key=_string(name, "label_key", _default(cfg.label_key, defaults.label_key)),
        metadata_key=_string(name, "metadata_key", _default(cfg.metadata_key, defaults.metadata_key)),
        rm_type=_optional_string(name, "rm_type", _default(cfg.rm_type, defaults.rm_type)),
        custom_rm_path=_optional_string(name, "custom_rm_path", _default(cfg.custom_rm_path, defaults.custom_rm_path)),
        num_step=None if cfg.num_step is None else _positive_int(name, "num_step", cfg.num_step),
        num_epoch=None if cfg.num_epoch is None else _positive_int(name, "num_epoch", cfg.num_epoch),
        metadata=_mapping(name, "metadata", cfg.metadata),
        lr=_non_negative_number(name, "lr", _default(cfg.lr, defaults.lr)),
        weight_decay=_non_negative_number(name, "weight_decay", _default(cfg.weight_decay, defaults.weight_decay)),
        lr_decay_style=_choice(name, "lr_decay_style", _default(cfg.lr_decay_style, defaults.lr_decay_style), LR_DECAY_STYLES),
        lr_warmup_steps=_non_negative_int(name, "lr_warmup_steps", _default(cfg.lr_warmup_steps, defaults.lr_warmup_steps)),
    )
    _check_combination(name, filled, defaults)
    return filled


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
    if cfg.rm_type is None and cfg.custom_rm_path is None:
        raise AdapterConfigError(
            f"Adapter '{name}': no reward: set rm_type or custom_rm_path in the adapter config "
            "(or start the trainer with --rm-type / --custom-rm-path)"
        )
    if cfg.num_step is not None and cfg.num_epoch is not None:
        logger.warning("Adapter '%s': both num_step (%d) and num_epoch (%d) set; num_step wins",
                       name, cfg.num_step, cfg.num_epoch)


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


def _default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _resolve_data(name: str, data: Any) -> Path:
    if not isinstance(data, str) or not data:
        raise AdapterConfigError(f"Adapter '{name}': 'data' must be a path string, got {data!r}")
    path = Path(data).expanduser().resolve()
    if path.suffix.lower() not in DATA_SUFFIXES:
        raise AdapterConfigError(
            f"Adapter '{name}': data {data!r} must be a .jsonl, .json or .parquet file"
        )
    if not path.is_file():
        raise AdapterConfigError(f"Adapter '{name}': data file {data!r} does not exist (resolved to {path})")
    return path


def _resolve_save(name: str, save: Path | None, default_root: str | None) -> Path:
    if save is not None:
        return Path(save).expanduser().resolve()
    if default_root is None:
        raise AdapterConfigError(
            f"Adapter '{name}': no save directory: set 'save' in the adapter config or start the trainer with --save"
        )
    return (Path(default_root).expanduser() / "adapters" / name).resolve()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, key: str, value: Any) -> int:
    if not _is_int(value) or value <= 0:
        raise AdapterConfigError(f"Adapter '{name}': {key} must be an integer > 0, got {value!r}")
    return value


def _non_negative_int(name: str, key: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise AdapterConfigError(f"Adapter '{name}': {key} must be an integer >= 0, got {value!r}")
    return value


def _positive_number(name: str, key: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise AdapterConfigError(f"Adapter '{name}': {key} must be a number > 0, got {value!r}")
    return float(value)


def _non_negative_number(name: str, key: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise AdapterConfigError(f"Adapter '{name}': {key} must be a number >= 0, got {value!r}")
    return float(value)


def _string(name: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise AdapterConfigError(f"Adapter '{name}': {key} must be a non-empty string, got {value!r}")
    return value


def _optional_string(name: str, key: str, value: Any) -> str | None:
    return None if value is None else _string(name, key, value)


def _choice(name: str, key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise AdapterConfigError(f"Adapter '{name}': {key} must be one of {list(choices)}, got {value!r}")
    return value


def _mapping(name: str, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AdapterConfigError(f"Adapter '{name}': {key} must be a mapping, got {type(value).__name__}")
    return dict(value)
