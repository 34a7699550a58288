"""Standard PEFT adapter directories: write a slot out, read an adapter into a slot.

A directory holds `adapter_config.json` and `adapter_model.safetensors` with PEFT's
parameter names sliced to the adapter's rank, so `peft.PeftModel.from_pretrained(base,
path)` loads what `export_peft_adapter` writes, and `load_peft_adapter` reads what PEFT
saves. Writes go to a temporary sibling directory that is renamed into place, so a
reader never sees half a directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from miles.lora.model import require_lora, resolve_targets
from miles.lora.slots import get_slot_weights, peft_names, set_slot_weights, slot_rank_alpha

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_adapter_config(
    *, rank: int, alpha: float, target_modules: list[str], base_model_name_or_path: str | None
) -> dict[str, Any]:
    """The contents of `adapter_config.json` for a plain LoRA of a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "target_modules": sorted(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": base_model_name_or_path,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_peft_dir(path: str | os.PathLike, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any]) -> Path:
    """Write a PEFT directory atomically (temporary sibling, then rename); replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(cpu, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2, sort_keys=True))
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_peft_dir(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, adapter config) of a PEFT directory."""
    path = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a PEFT adapter directory: {name} is missing")
    config = json.loads((path / CONFIG_FILE).read_text())
    return load_file(str(path / WEIGHTS_FILE)), config


def _wrapped_short_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name in require_lora(model)}


def _export_targets(model: nn.Module, target_modules: str | Sequence[str] | None) -> set[str]:
    wrapped = _wrapped_short_names(model)
    targets = None if target_modules is None else resolve_targets(target_modules)
    if targets is None:
        return wrapped
    missing = targets - wrapped
    if missing:
        raise ValueError(f"cannot export target_modules {sorted(missing)}: "
                         f"they are not multi-LoRA layers (wrapped: {sorted(wrapped)})")
    return targets


def export_peft_adapter(
    model: nn.Module,
    slot: int,
    path: str | os.PathLike,
    *,
    rank: int | None = None,
    alpha: float | None = None,
    target_modules: str | Sequence[str] | None = None,
) -> Path:
    """Write `slot`'s adapter as a PEFT directory at `path` (atomically).

    `rank`/`alpha` default to the slot's and must match it when given;
    `target_modules` ("all-linear", comma string or names; default all wrapped layers)
    limits the exported layers and is written to the config as explicit names.
    """
    slot_rank, slot_alpha = slot_rank_alpha(model, slot)
    if rank is not None and rank != slot_rank:
        raise ValueError(f"slot {slot} holds a rank-{slot_rank} adapter, not rank {rank}")
    if alpha is not None and abs(alpha - slot_alpha) > 1e-6 * max(1.0, abs(alpha)):
        raise ValueError(f"slot {slot} holds an adapter with alpha {slot_alpha}, not {alpha}")
    targets = _export_targets(model, target_modules)
    weights = get_slot_weights(model, slot)
    tensors: dict[str, torch.Tensor] = {}
    for module_name in require_lora(model):
        if module_name.rsplit(".", 1)[-1] in targets:
            for key in peft_names(module_name):
                tensors[key] = weights[key]
    name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    config = peft_adapter_config(
        rank=slot_rank, alpha=slot_alpha, target_modules=sorted(targets), base_model_name_or_path=name_or_path
    )
    return write_peft_dir(path, tensors, config)


UNSUPPORTED_PEFT_FEATURES = {
    "use_dora": "DoRA",
    "use_rslora": "rank-stabilised LoRA",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "modules_to_save",
    "layers_to_transform": "layers_to_transform",
    "lora_bias": "LoRA biases (lora_bias)",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable_token_indices",
    "fan_in_fan_out": "transposed (fan_in_fan_out) weights",
}
"""PEFT config keys the slot page table cannot hold, and what each one is (named in the error)."""


def check_peft_config(config: dict[str, Any], source: str | os.PathLike, *, covers: Callable[[str], bool],
                      lora_layers: Sequence[str], max_rank: int) -> tuple[int, float]:
    """(rank, alpha) of a PEFT `adapter_config.json` that slots of width `max_rank` can hold,
    for either backend's page table; a ValueError names `source`, what is wrong and the fix.

    `covers(target)`: whether an entry of the config's `target_modules` is one of the model's
    LoRA layers, whose short names `lora_layers` lists for the message.
    """
    path = Path(source)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type is {config.get('peft_type')!r}; only LORA adapters load into slots")
    for key, what in UNSUPPORTED_PEFT_FEATURES.items():
        if config.get(key):
            raise ValueError(f"{path}: {what} is not supported by the slot page table; save the adapter without it")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={config.get('bias')!r} is not supported; train the adapter with bias='none'")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        missing = {t for t in targets if not covers(t)}
        if missing:
            raise ValueError(f"{path}: adapter targets {sorted(missing)} which are not multi-LoRA layers of this "
                             f"model (its LoRA layers: {sorted(lora_layers)}); widen the slots' target modules "
                             "(--target-modules, or inject_multi_lora's target_modules)")
    if "r" not in config or "lora_alpha" not in config:
        raise ValueError(f"{path}: adapter_config.json lacks 'r' or 'lora_alpha'")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    if rank > max_rank:
        raise ValueError(f"{path}: adapter rank {rank} exceeds the slot width max_rank={max_rank}; raise --lora-rank")
    return rank, alpha


def load_peft_adapter(model: nn.Module, slot: int, path: str | os.PathLike) -> tuple[int, float]:
    """Load the PEFT adapter directory at `path` into `slot`; return its (rank, alpha).

    Raises ValueError when the rank exceeds the slot width, when the adapter targets
    layers that are not wrapped, or when it uses a PEFT feature the page table lacks.
    """
    path = Path(path)
    tensors, config = read_peft_dir(path)
    return load_peft_tensors(model, slot, tensors, config, source=str(path))


def load_peft_tensors(model: nn.Module, slot: int, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                      *, source: str = "adapter") -> tuple[int, float]:
    """`load_peft_adapter` for tensors and `adapter_config.json` contents already in memory.

    `source` names where they came from in error messages.
    """
    layers = require_lora(model)
    short = _wrapped_short_names(model)

    def covers(target: str) -> bool:
        # PEFT writes short names ("q_proj") or, for "all-linear", full module paths.
        return target in short or target in layers or any(name.endswith(f".{target}") for name in layers)

    rank, alpha = check_peft_config(config, source, covers=covers, lora_layers=sorted(short),
                                    max_rank=next(iter(layers.values())).max_rank)
    set_slot_weights(model, slot, tensors, rank=rank, alpha=alpha)
    return rank, alpha
