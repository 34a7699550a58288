"""A model's multi-LoRA layers: injection, lookup, delta mode and slot routing.

    names = inject_multi_lora(model, n_slots=4, max_rank=8, target_modules="all-linear")
    init_slot(model, 0, rank=8, alpha=16)
    with use_slots(model, [0, 0, -1, 2]):
        logits = model(input_ids_BT).logits
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from miles.lora.delta import STRATEGIES, DeltaMode
from miles.lora.layer import MultiLoRALinear
from miles.lora.routing import routed
from miles.lora.slot_batch import SlotBatch, slot_batch


def resolve_targets(target_modules: str | Sequence[str]) -> set[str] | None:
    """None means all-linear; otherwise the set of module short names to wrap."""
    if isinstance(target_modules, str):
        if target_modules.strip() == "all-linear":
            return None
        names = [n.strip() for n in target_modules.split(",")]
    else:
        names = [str(n).strip() for n in target_modules]
    names = [n for n in names if n]
    if not names:
        raise ValueError("target_modules is empty: give 'all-linear' or names such as 'q_proj,v_proj'")
    return set(names)


def _decoder_layers_prefix(model: nn.Module) -> str:
    """Name prefix of the decoder blocks ("model.layers." for HF Llama/Qwen2)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers"):
            return name + "."
    raise ValueError("no decoder layers (an nn.ModuleList named '...layers') found: is this a Hugging Face causal LM?")


UNEMBED_TARGET = "lm_head"
"""The target name of the unembedding (the output embeddings, PEFT's name for them too)."""


def split_unembed(target_modules: str | Sequence[str]) -> tuple[str | list[str], bool]:
    """(the decoder layers' targets, whether the unembedding is targeted too) of a
    `target_modules` that may name `lm_head` beside them ("all-linear,lm_head")."""
    names = [n.strip() for n in (target_modules.split(",") if isinstance(target_modules, str) else target_modules)]
    unembed = UNEMBED_TARGET in names
    rest = [n for n in names if n and n != UNEMBED_TARGET]
    if rest == ["all-linear"]:
        return "all-linear", unembed
    return rest, unembed


def inject_multi_lora(
    model: nn.Module, *, n_slots: int, max_rank: int, target_modules: str | Sequence[str]
) -> list[str]:
    """Wrap the targeted linear layers in place; return their names.

    `target_modules` is "all-linear" (every nn.Linear inside the decoder layers, never
    lm_head or embeddings), a comma string or a list of module short names, any of which
    may add `lm_head`: the unembedding (the model's output embeddings, a plain linear, tied
    to the input embeddings or not) gets a slot LoRA as well ("all-linear,lm_head"). Base
    weights are frozen; every slot starts empty (A = B = 0, scaling 0).
    """
    if lora_modules(model):
        raise ValueError("model already has multi-LoRA layers: inject_multi_lora must be called once")
    decoder_targets, unembed = split_unembed(target_modules)
    head = model.get_output_embeddings() if unembed else None  # type: ignore[operator]
    if unembed and type(head) is not nn.Linear:
        raise ValueError(f"lm_head LoRA needs the model's output embeddings to be a plain nn.Linear, "
                         f"not {type(head).__name__}: leave out lm_head (--lora-unembed)")
    targets = resolve_targets(decoder_targets) if decoder_targets or not unembed else set()
    prefix = _decoder_layers_prefix(model)
    chosen = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.startswith(prefix)
        and (targets is None or name.rsplit(".", 1)[-1] in targets)
    ]
    if head is not None:
        chosen.append(next(name for name, module in model.named_modules() if module is head))
    if targets:
        missing = targets - {name.rsplit(".", 1)[-1] for name in chosen}
        if missing:
            raise ValueError(f"target_modules {sorted(missing)} match no nn.Linear in the decoder layers of this model")
    for p in model.parameters():
        p.requires_grad_(False)
    _LAYERS.pop(model, None)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, MultiLoRALinear(getattr(parent, child), n_slots=n_slots, max_rank=max_rank))
    return chosen


def lora_modules(model: nn.Module) -> dict[str, MultiLoRALinear]:
    """Every multi-LoRA layer of `model`, by module name (the name of the wrapped linear)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MultiLoRALinear)}


def slot_parameters(model: nn.Module) -> list[nn.Parameter]:
    """All lora_A / lora_B parameters (every slot) in module order."""
    params: list[nn.Parameter] = []
    for module in lora_modules(model).values():
        params.extend([module.lora_A, module.lora_B])
    return params


def set_delta_mode(model: nn.Module, mode: DeltaMode) -> None:
    """Force one delta strategy (`miles.lora.delta`: segment, gather, stacked, jagged or
    row-wise) for every layer ("auto" picks per batch)."""
    if mode != "auto" and mode not in STRATEGIES:
        *others, last = ("auto", *STRATEGIES)
        raise ValueError(f"delta mode must be {', '.join(map(repr, others))} or {last!r}, got {mode!r}")
    for module in require_lora(model).values():
        module.delta_mode = mode


def require_lora(model: nn.Module) -> dict[str, MultiLoRALinear]:
    """The model's multi-LoRA layers by module name; ValueError when it has none."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("model has no multi-LoRA layers: call inject_multi_lora(model, ...) first")
    return modules


@contextlib.contextmanager
def use_slots(model: nn.Module, slot_ids: Sequence[int] | torch.Tensor) -> Iterator[SlotBatch]:
    """Route sample i of the batches run inside the block through slot `slot_ids[i]`.

    `-1` means base model only. Outside any block the model is the base model. Nested
    blocks (and other threads or asyncio tasks) see their own slots; the previous
    routing is restored on exit. A layer recomputed in the backward keeps the routing of
    its forward (`miles.lora.routing.active_routing`), so `backward()` may run outside the block.
    """
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = tuple(require_lora(model).values())
    first = layers[0]
    ids = slot_ids.reshape(-1).tolist() if isinstance(slot_ids, torch.Tensor) else slot_ids
    batch = slot_batch(tuple(ids), first.lora_A.device, first.slot_scales, first.max_rank)
    for slot in batch.present:
        if slot >= first.n_slots:
            raise ValueError(f"slot {slot} does not exist: "
                             f"the page table has {first.n_slots} slots (0..{first.n_slots - 1})")
    with routed(layers, batch):
        yield batch


# The multi-LoRA layers of a model, found once (a decode step must not walk the module tree).
_LAYERS: weakref.WeakKeyDictionary[nn.Module, tuple[MultiLoRALinear, ...]] = weakref.WeakKeyDictionary()
