"""Activation recomputation of decoder layers (`--recompute-granularity full|selective`).

`full`: a recomputed layer keeps only its input through the forward; the backward runs the
layer again to get the activations its gradient needs. Memory for activations drops from
every layer's to one layer's (plus each layer's input) at the price of a second forward of
the recomputed layers.

    recompute_decoder_layers(model, method="uniform")          # every decoder layer
    recompute_decoder_layers(model, method="block", num_layers=4)  # the first four

The second forward routes every sample through the slot of the first
(`lora.active_routing`), wherever the autograd engine runs it; without gradients (rollout
logprobs, the reference model) layers run as usual.

`selective`: every layer keeps its GEMM outputs; the norm outputs and the SiLU-gated
activations, which are elementwise functions of tensors kept anyway, hold no memory
between the forward and the backward and are formed again when the backward reaches them.
`--recompute-modules` (Megatron's names) picks the parts: `layernorm` (the default) the norm
outputs, `mlp` the whole MLP with the norm before it, run again from the residual.

    release_cheap_activations(model)                          # layernorm
    release_cheap_activations(model, modules={"layernorm", "mlp"})
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from miles.lora import active_routing, restore_routing

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def apply_recompute(model: PreTrainedModel, granularity: str | None, method: str | None = None,
                    num_layers: int | None = None, modules: Collection[str] | None = None) -> None:
    """The train actor's `--recompute-granularity` (None: keep every activation) and
    `--recompute-modules`, logged."""
    if granularity == "full":
        recomputed = recompute_decoder_layers(model, method=method or "uniform", num_layers=num_layers)
        logger.info("Recomputing %d decoder layer(s) in the backward", recomputed)
    elif granularity == "selective":
        modules = DEFAULT_MODULES if modules is None else frozenset(modules)
        changed = release_cheap_activations(model, modules=modules)
        if changed:
            parts = ["the MLP and its norm" if "mlp" in modules else "gated activations"]
            parts += ["norm outputs"] if "layernorm" in modules else []
            logger.info("Forming %s again in the backward in %d decoder layer(s)", " and ".join(parts), changed)
        else:
            logger.warning("--recompute-granularity selective has no effect on %s: its decoder layers are none of "
                           "%s (use full)", type(model).__name__, ", ".join(sorted(SEQUENTIAL_PRE_NORM_LAYERS)))


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The decoder layers of a Hugging Face causal LM, in order."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__}: no decoder layer list (`model.get_decoder().layers`) to recompute")
    return list(layers)


def recompute_decoder_layers(model: PreTrainedModel, *, method: str = "uniform", num_layers: int | None = None) -> int:
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


# ---- selective: the cheap activations ---------------------------------------------------

SEQUENTIAL_PRE_NORM_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                                        "Qwen3DecoderLayer"})
"""Decoder layers (transformers' classes) whose forward is `x + attn(norm_1(x))`, then
`h + mlp(norm_2(h))`, each norm's output read by its block alone: where releasing a norm's
output once its block has run is safe. Parallel-residual layers read it twice."""


DEFAULT_MODULES = frozenset({"layernorm"})
"""`--recompute-modules` of the torch backend when not given."""


def release_cheap_activations(model: PreTrainedModel, modules: Collection[str] = DEFAULT_MODULES) -> int:
    """`--recompute-granularity selective` on the torch backend: drop the activations that are
    cheap to form again and refill them when the backward reaches the block that needs them;
    returns how many decoder layers changed. `modules` as described below.

    In each decoder layer of `SEQUENTIAL_PRE_NORM_LAYERS` (input norm, attention, residual,
    post-attention norm, MLP, residual; nothing else reads a norm's output):
    - the two norms' outputs, which the attention and MLP projections keep for their weight
      gradients, are released after the block that reads them and formed again from the
      norm's input (which the norm's own backward keeps anyway);
    - the MLP keeps its gate and up projections only: `silu(gate) * up` is one node keeping
      those two (not also silu(gate)), and its output, which the down projection keeps, is
      released and formed again from them.
    Only elementwise work runs twice; every GEMM output is kept. The refilled tensors are the
    same computation on the same inputs, so gradients equal those of keeping everything,
    bit for bit. A layer with another MLP releases the norm outputs only; layers of other
    classes run as before. Without "layernorm" in `modules` the norm outputs are kept. With
    "mlp", the post-attention norm and the MLP run as one region that keeps only its input
    (the residual, kept anyway) and runs again in the backward: the MLP's GEMMs twice, the
    same gradients bit for bit.

    All of it is spared where the LoRA layers keep their inputs as they are (the actors sort
    a batch by slot; with the same number of rows in every slot it is the grouped layout);
    where they keep gathered copies, only silu(gate) is."""
    changed = 0
    for layer in decoder_layers(model):
        if type(layer).__name__ not in SEQUENTIAL_PRE_NORM_LAYERS:
            continue
        input_norm, attention, post_norm, mlp = (_child(layer, name) for name in (
            "input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))
        # The MLP first: the release of the norm's output wraps the MLP's forward.
        if "mlp" in modules:
            _recompute_norm_and_block(post_norm, mlp)
        elif _is_silu_gated(mlp):
            mlp.forward = _lean_gated_mlp(mlp)
        if "layernorm" in modules:
            _release_norm_output_after(input_norm, attention)
            if "mlp" not in modules:
                _release_norm_output_after(post_norm, mlp)
        changed += 1
    return changed


def _child(module: nn.Module, name: str) -> nn.Module:
    """The submodule `name` of a decoder layer or MLP (the Hugging Face attribute names)."""
    child = getattr(module, name)
    if not isinstance(child, nn.Module):
        raise TypeError(f"{type(module).__name__}.{name} is a {type(child).__name__}, not a module")
    return child


def _recompute_norm_and_block(norm: nn.Module, block: nn.Module) -> None:
    """`block(norm(x))` as one recomputed region: the norm passes its input on, and the block
    runs both, keeping only x for the backward (`_recomputed`)."""
    norm_forward, block_forward = norm.forward, block.forward
    norm.forward = lambda hidden_states: hidden_states
    block.forward = _recomputed(lambda hidden_states: block_forward(norm_forward(hidden_states)))


def _release_norm_output_after(norm: nn.Module, block: nn.Module) -> None:
    """`block(norm(x))`: once the block has run, release the norm's output; the block's
    backward first forms it again from x."""
    norm_forward, block_forward = norm.forward, block.forward
    last: list[tuple[torch.Tensor, torch.Tensor]] = []

    @functools.wraps(norm_forward)
    def run_norm(hidden_states: torch.Tensor) -> torch.Tensor:
        normed = norm_forward(hidden_states)
        last[:] = [(hidden_states, normed)] if torch.is_grad_enabled() else []
        return normed

    @functools.wraps(block_forward)
    def run_block(*args: Any, **kwargs: Any) -> Any:
        out = block_forward(*args, **kwargs)
        block_input = args[0] if args else kwargs.get("hidden_states")
        if last and last[0][1] is block_input:
            hidden_states, normed = last.pop()
            _release_until_backward(normed, lambda target: target.copy_(norm_forward(hidden_states)), out)
        return out

    norm.forward, block.forward = run_norm, run_block


def _is_silu_gated(mlp: nn.Module) -> bool:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))` with SiLU (torch's or transformers' module)."""
    from transformers.activations import SiLUActivation

    parts = all(isinstance(getattr(mlp, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj"))
    return parts and type(getattr(mlp, "act_fn", None)) in (nn.SiLU, SiLUActivation)


def _lean_gated_mlp(mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    forward = mlp.forward

    @functools.wraps(forward)
    def run(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return forward(x)
        gate, up = _child(mlp, "gate_proj")(x), _child(mlp, "up_proj")(x)
        silu_again: list[torch.Tensor] = []  # the refill's silu(gate), for the node's backward right after
        gated = _SiluMul.apply(gate, up, silu_again)

        def form_into(target: torch.Tensor) -> None:
            silu_again.append(F.silu(gate))
            torch.mul(silu_again[0], up, out=target)

        out = _child(mlp, "down_proj")(gated)
        _release_until_backward(gated, form_into, out)
        return out

    return run


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up; the backward takes silu(gate) from `silu_again`
    where the refill of the output left it, else forms it. The ops are autograd's own for
    the two-op form (`silu_backward` for the gate), so the gradients are the same bits."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, silu_again: list[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.silu_again = silu_again
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        gate, up = ctx.saved_tensors
        silu = ctx.silu_again.pop() if ctx.silu_again else F.silu(gate)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * silu if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up, None


def _release_until_backward(tensor: torch.Tensor, form_into: Callable[[torch.Tensor], Any], consumer_out: Any) -> None:
    """Free `tensor`'s memory now; when the gradient of `consumer_out` (the output of the block
    that read it) is formed, before any node of that block runs backward, form it again
    into the same storage (`form_into` writes a tensor on that storage). Writes through
    another tensor leave this one's version alone, so the nodes that saved it unpack it as
    saved. A tensor that does not own its whole storage, or a block whose output needs no
    gradient, is left as is."""
    out = consumer_out[0] if isinstance(consumer_out, tuple) else consumer_out
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if (not isinstance(out, torch.Tensor) or not out.requires_grad or not tensor.is_contiguous()
            or tensor.storage_offset() != 0 or storage.nbytes() != nbytes):
        return
    pending = [(tensor, form_into)]  # emptied by the refill: the hook outlives it as long as the graph does

    def refill(grad: torch.Tensor) -> None:
        if pending:
            target, form_again = pending.pop()
            target.untyped_storage().resize_(nbytes)
            alias = torch.empty(0, dtype=target.dtype, device=target.device)
            alias.set_(target.untyped_storage(), 0, target.shape, target.stride())
            with torch.no_grad():
                form_again(alias)

    out.register_hook(refill)
    storage.resize_(0)
