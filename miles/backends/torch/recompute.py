"""Activation recomputation of decoder layers (`--recompute-granularity full`).

A recomputed layer keeps only its input through the forward; the backward runs the layer
again to get the activations its gradient needs. Memory for activations drops from every
layer's to one layer's (plus each layer's input) at the price of a second forward of the
recomputed layers.

    recompute_decoder_layers(model, method="uniform")          # every decoder layer
    recompute_decoder_layers(model, method="block", num_layers=4)  # the first four

The second forward routes every sample through the slot of the first
(`lora.active_routing`), wherever the autograd engine runs it; without gradients (rollout
logprobs, the reference model) layers run as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from miles.backends.lora import active_routing, restore_routing


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face causal LM, in order."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__}: no decoder layer list (`model.get_decoder().layers`) to recompute")
    return list(layers)


def recompute_decoder_layers(model: nn.Module, *, method: str = "uniform", num_layers: int | None = None) -> int:
    """Recompute every decoder layer (`uniform`) or the first `num_layers` (`block`, default
    all) in the backward; returns how many layers are recomputed."""
    if method not in ("uniform", "block"):
        raise ValueError(f"recompute method must be 'uniform' or 'block', got {method!r}")
    layers = decoder_layers(model)
    chosen = layers if method == "uniform" or num_layers is None else layers[:num_layers]
    for layer in chosen:
        layer.forward = _recomputed(layer.forward)
    return len(chosen)


def _recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(hidden_states, *args, **kwargs)
        routing = active_routing()

        def replay(hidden_states: torch.Tensor) -> Any:
            with restore_routing(routing):
                return forward(hidden_states, *args, **kwargs)

        return torch.utils.checkpoint.checkpoint(replay, hidden_states, use_reentrant=False)

    return run
