"""Per-slot weight operations on an injected model, in PEFT's parameter names.

A slot's weights travel as `{name: tensor}` with PEFT's names
(`base_model.model.<module path>.lora_A.weight` [rank, in] and `.lora_B.weight`
[out, rank]), sliced to the adapter's rank, so the same dict is written to a PEFT
directory, pushed to inference engines or loaded back into any slot.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from miles.lora.layer import MultiLoRALinear, check_rank
from miles.lora.model import require_lora

PEFT_PREFIX = "base_model.model."
_A_SUFFIX = ".lora_A.weight"
_B_SUFFIX = ".lora_B.weight"


def peft_names(module_name: str) -> tuple[str, str]:
    """PEFT's names of the A and B weights of the wrapped linear `module_name`."""
    return PEFT_PREFIX + module_name + _A_SUFFIX, PEFT_PREFIX + module_name + _B_SUFFIX


def _check_slot(modules: dict[str, MultiLoRALinear], slot: int) -> None:
    n_slots = next(iter(modules.values())).n_slots
    if not 0 <= slot < n_slots:
        raise ValueError(f"slot {slot} does not exist: the page table has {n_slots} slots (0..{n_slots - 1})")


def fresh_lora_weights(shapes: dict[str, tuple[int, int]], *, rank: int, generator: torch.Generator | None = None
                       ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A fresh adapter's (A [rank, in], B [out, rank]) per module name, from `{name: (in, out)}`.

    A is kaiming_uniform(a=sqrt(5)) (PEFT's default), drawn on the CPU from `generator` in
    the order of `shapes`, so a seed gives the same adapter anywhere (every backend draws
    here); B is zero.
    """
    out = {}
    for name, (in_features, out_features) in shapes.items():
        a = torch.empty(rank, in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        out[name] = (a, torch.zeros(out_features, rank, dtype=torch.float32))
    return out


def fresh_slot_weights(model: nn.Module, *, rank: int, generator: torch.Generator | None = None
                       ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`fresh_lora_weights` for the model's LoRA layers in module order, not written anywhere."""
    modules = require_lora(model)
    check_rank(rank, next(iter(modules.values())).max_rank)
    shapes = {name: (module.in_features, module.out_features) for name, module in modules.items()}
    return fresh_lora_weights(shapes, rank=rank, generator=generator)


def init_slot(
    model: nn.Module, slot: int, *, rank: int, alpha: float, generator: torch.Generator | None = None
) -> None:
    """Fresh adapter in `slot` (`fresh_slot_weights`), scaling alpha / rank."""
    modules = require_lora(model)
    _check_slot(modules, slot)
    for name, (a, b) in fresh_slot_weights(model, rank=rank, generator=generator).items():
        modules[name].set_slot(slot, a, b, alpha=alpha)


def peft_tensors(weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`{module name: (A, B)}` in PEFT's names."""
    tensors: dict[str, torch.Tensor] = {}
    for name, (a, b) in weights.items():
        a_name, b_name = peft_names(name)
        tensors[a_name], tensors[b_name] = a, b
    return tensors


def clear_slot(model: nn.Module, slot: int) -> None:
    """Empty `slot` in every layer: A, B and scaling zero, rank 0."""
    modules = require_lora(model)
    _check_slot(modules, slot)
    for module in modules.values():
        module.clear_slot(slot)


def slot_rank_alpha(model: nn.Module, slot: int) -> tuple[int, float]:
    """(rank, alpha) of the adapter in `slot`; rank 0 means the slot is empty."""
    modules = require_lora(model)
    _check_slot(modules, slot)
    module = next(iter(modules.values()))
    return module.ranks[slot], module.alphas[slot]


def set_slot_weights(
    model: nn.Module, slot: int, tensors: dict[str, torch.Tensor], *, rank: int, alpha: float
) -> None:
    """Load an adapter given in PEFT names into `slot`.

    Wrapped layers the adapter does not cover get a zero delta in this slot. A tensor
    for a layer that is not wrapped, or of the wrong shape, raises ValueError and
    leaves the slot as it was.
    """
    modules = require_lora(model)
    _check_slot(modules, slot)
    check_rank(rank, next(iter(modules.values())).max_rank)
    if alpha <= 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha}")
    by_module = _split_by_module(tensors, set(modules))
    for name, (a, b) in by_module.items():
        module = modules[name]
        if a.shape != (rank, module.in_features) or b.shape != (module.out_features, rank):
            raise ValueError(
                f"{name}: expected lora_A [{rank}, {module.in_features}] and lora_B "
                f"[{module.out_features}, {rank}] for rank {rank}, got {list(a.shape)} and {list(b.shape)}"
            )
    for name, module in modules.items():
        if name in by_module:
            a, b = by_module[name]
            module.set_slot(slot, a, b, alpha=alpha)
        else:
            zeros_a = torch.zeros(rank, module.in_features)
            zeros_b = torch.zeros(module.out_features, rank)
            module.set_slot(slot, zeros_a, zeros_b, alpha=alpha)


def _split_by_module(tensors: dict[str, torch.Tensor],
                     wrapped: set[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, value in tensors.items():
        if key.startswith(PEFT_PREFIX) and key.endswith((_A_SUFFIX, _B_SUFFIX)):
            module_name = key[len(PEFT_PREFIX) : -len(_A_SUFFIX)]
            if module_name in wrapped:
                halves.setdefault(module_name, {})[key[-len(_A_SUFFIX) :]] = value
                continue
        unknown.append(key)
    if unknown:
        shown = ", ".join(sorted(unknown)[:5])
        raise ValueError(
            f"{len(unknown)} adapter tensors match no multi-LoRA layer of this model (e.g. {shown}); "
            "inject_multi_lora with target_modules that cover the adapter's, and use PEFT names "
            "'base_model.model.<module>.lora_A.weight'"
        )
    incomplete = sorted(name for name, pair in halves.items() if len(pair) != 2)
    if incomplete:
        raise ValueError(f"adapter has lora_A without lora_B (or the reverse) for {incomplete}")
    return {name: (pair[_A_SUFFIX], pair[_B_SUFFIX]) for name, pair in halves.items()}


def get_slot_weights(model: nn.Module, slot: int) -> dict[str, torch.Tensor]:
    """Slot `slot`'s adapter in PEFT names, sliced to its rank (detached CPU copies)."""
    modules = require_lora(model)
    _check_slot(modules, slot)
    if next(iter(modules.values())).ranks[slot] == 0:
        raise ValueError(f"slot {slot} is empty: init_slot or load an adapter into it first")
    return peft_tensors({name: module.slot_tensors(slot) for name, module in modules.items()})
