"""A megatron-core GPTModel built from a Hugging Face Llama or Qwen2 directory.

    shape = ModelShape.from_hf(hf_config)                       # the architecture, once
    model = build_gpt_model(shape, dtype=torch.float32)         # this TP rank's shard
    load_hf_weights(model, shape, hf_state_dict)                # HF names -> this shard
    logits_BSV = forward_logits(model, shape, input_ids_BS)     # gathered over TP, HF vocab

The mapping between Hugging Face and Megatron names and layouts is written once, as
pure functions of tensors (`hf_to_megatron`, `megatron_to_hf`), so that it round-trips
losslessly and is testable without a process group:

- `q_proj`, `k_proj`, `v_proj` fuse into `linear_qkv`, grouped by query group: for each
  of the `num_query_groups` groups its query heads, then its key head, then its value
  head (biases the same way, for Qwen2). A TP rank holds a contiguous run of groups.
- `gate_proj`, `up_proj` fuse into `linear_fc1`: each TP rank holds its gate rows, then
  its up rows (the local halves feed SwiGLU).
- `o_proj` / `down_proj` are row-parallel (input columns split over TP), embeddings and
  the output layer vocab-parallel (rows split, the vocabulary padded to a multiple of the
  TP size with zero rows that `forward_logits` cuts off again).

The local layer spec (no Transformer Engine) is used, so the same model runs on CPU
over gloo (see `cpu_shims`) and on GPUs.

Activation recomputation takes Megatron's own settings (`recompute_settings`): "full"
recomputes whole decoder layers in the backward (`uniform`: every layer, in chunks of
`recompute_num_layers`; `block`: the first `recompute_num_layers`), "selective" the core
attention. Megatron recomputes only modules in training mode; the backend runs its model
in eval mode, so `allow_recompute_in_eval` opens the two gates after `.eval()`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

HF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ModelShape:
    """The architecture of a Hugging Face Llama/Qwen2 model, as Megatron needs it."""

    arch: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_hf(cls, config: dict) -> ModelShape:
        archs = config.get("architectures") or []
        arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
        if arch is None:
            raise ValueError(f"the Megatron backend builds {sorted(HF_ARCHS)} models; this checkpoint is {archs}")
        rope_scaling = config.get("rope_scaling")
        if rope_scaling not in (None, {}) and (rope_scaling.get("rope_type") or rope_scaling.get("type")) != "default":
            raise ValueError(f"rope_scaling {config['rope_scaling']} is not supported by the Megatron backend")
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        rope = config.get("rope_parameters") or {}
        return cls(
            arch=arch, vocab_size=config["vocab_size"], hidden_size=hidden,
            ffn_hidden_size=config["intermediate_size"], num_layers=config["num_hidden_layers"], num_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads, rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        )

    def padded_vocab(self, tp_size: int) -> int:
        return -(-self.vocab_size // tp_size) * tp_size

    def check_tp(self, tp_size: int) -> None:
        for what, n in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_query_groups),
                        ("intermediate_size", self.ffn_hidden_size)):
            if n % tp_size:
                raise ValueError(f"--tensor-model-parallel-size {tp_size} does not divide the model's {what} ({n})")


# ---- the mapping, as pure tensor functions --------------------------------------------


def _layer(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: ModelShape, tp_rank: int, tp_size: int) -> Tensor:
    """This rank's `linear_qkv` rows (weight [out, in] or bias [out]) from HF q, k, v."""
    groups, per_group, d = shape.num_query_groups, shape.num_heads // shape.num_query_groups, shape.head_dim
    tail = q.shape[1:]
    q_G = q.reshape(groups, per_group * d, *tail)
    k_G = k.reshape(groups, d, *tail)
    v_G = v.reshape(groups, d, *tail)
    fused = torch.cat([q_G, k_G, v_G], dim=1).chunk(tp_size, dim=0)[tp_rank]
    return fused.reshape(-1, *tail)


def split_qkv(fused_shards: list[Tensor], shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    """HF q, k, v from every rank's `linear_qkv` rows (in TP order)."""
    groups, per_group, d = shape.num_query_groups, shape.num_heads // shape.num_query_groups, shape.head_dim
    fused = torch.cat(fused_shards, dim=0)
    tail = fused.shape[1:]
    fused_G = fused.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = fused_G.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(hf: dict[str, Tensor], shape: ModelShape, tp_rank: int = 0, tp_size: int = 1) -> dict[str, Tensor]:
    """This TP rank's Megatron state dict (base weights) from a full HF state dict."""
    shape.check_tp(tp_size)
    col = lambda t: t.chunk(tp_size, dim=0)[tp_rank]  # noqa: E731  (output rows)
    row = lambda t: t.chunk(tp_size, dim=1)[tp_rank]  # noqa: E731  (input columns)

    def vocab(t: Tensor) -> Tensor:
        padded = t.new_zeros(shape.padded_vocab(tp_size), t.shape[1])
        padded[: t.shape[0]] = t
        return col(padded)

    out = {"embedding.word_embeddings.weight": vocab(hf["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = vocab(hf["lm_head.weight"])
    for i in range(shape.num_layers):
        h, m = _layer(i)
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape, tp_rank, tp_size)
        if shape.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], shape, tp_rank, tp_size)
        out[m + "self_attention.linear_proj.weight"] = row(hf[attn + "o_proj.weight"])
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [col(hf[h + "mlp.gate_proj.weight"]), col(hf[h + "mlp.up_proj.weight"])], dim=0)
        out[m + "mlp.linear_fc2.weight"] = row(hf[h + "mlp.down_proj.weight"])
    return {k: v.clone() for k, v in out.items()}


def megatron_to_hf(shards: list[dict[str, Tensor]], shape: ModelShape) -> dict[str, Tensor]:
    """The full HF state dict from every TP rank's Megatron state dict (in TP order)."""
    first = shards[0]
    cat0 = lambda key: torch.cat([s[key] for s in shards], dim=0)  # noqa: E731
    cat1 = lambda key: torch.cat([s[key] for s in shards], dim=1)  # noqa: E731
    out = {"model.embed_tokens.weight": cat0("embedding.word_embeddings.weight")[: shape.vocab_size],
           "model.norm.weight": first["decoder.final_layernorm.weight"]}
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = cat0("output_layer.weight")[: shape.vocab_size]
    for i in range(shape.num_layers):
        h, m = _layer(i)
        attn = h + "self_attn."
        out[h + "input_layernorm.weight"] = first[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
        q, k, v = split_qkv([s[m + "self_attention.linear_qkv.weight"] for s in shards], shape)
        out[attn + "q_proj.weight"], out[attn + "k_proj.weight"], out[attn + "v_proj.weight"] = q, k, v
        if shape.qkv_bias:
            q, k, v = split_qkv([s[m + "self_attention.linear_qkv.bias"] for s in shards], shape)
            out[attn + "q_proj.bias"], out[attn + "k_proj.bias"], out[attn + "v_proj.bias"] = q, k, v
        out[attn + "o_proj.weight"] = cat1(m + "self_attention.linear_proj.weight")
        gates, ups = zip(*(s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards))
        out[h + "mlp.gate_proj.weight"] = torch.cat(gates, dim=0)
        out[h + "mlp.up_proj.weight"] = torch.cat(ups, dim=0)
        out[h + "mlp.down_proj.weight"] = cat1(m + "mlp.linear_fc2.weight")
    return {k: v.clone() for k, v in out.items()}


# ---- the model --------------------------------------------------------------------------


def recompute_settings(shape: ModelShape, granularity: str | None, method: str | None = None,
                       num_layers: int | None = None, modules: Sequence[str] | None = None) -> dict:
    """`TransformerConfig`'s recompute fields for the `--recompute-*` flags (empty: keep every
    activation). "full" defaults to `uniform` over chunks of one layer; `block` defaults to
    every layer. "selective" recomputes `modules` (`--recompute-modules`; default core
    attention, Megatron's default `recompute_modules`)."""
    if modules is not None and granularity != "selective":
        raise ValueError("recompute_modules choose what recompute_granularity='selective' recomputes")
    if granularity is None:
        if method is not None or num_layers is not None:
            raise ValueError("recompute_method and recompute_num_layers need recompute_granularity='full'")
        return {}
    if granularity == "selective":
        if method is not None or num_layers is not None:
            raise ValueError("selective recomputation takes no recompute_method or recompute_num_layers "
                             "(they choose the layers of recompute_granularity='full')")
        chosen = {} if modules is None else {"recompute_modules": list(modules)}
        return {"recompute_granularity": "selective", **chosen}
    if granularity != "full":
        raise ValueError(f"recompute_granularity must be 'full' or 'selective', got {granularity!r}")
    method = method or "uniform"
    if method not in ("uniform", "block"):
        raise ValueError(f"recompute_method must be 'uniform' or 'block', got {method!r}")
    if num_layers is None:
        num_layers = 1 if method == "uniform" else shape.num_layers
    if num_layers <= 0:
        raise ValueError(f"recompute_num_layers must be > 0, got {num_layers}")
    if method == "uniform" and shape.num_layers % num_layers:
        # Megatron's uniform chunks run past the last layer otherwise (an IndexError in the forward).
        raise ValueError(f"--recompute-num-layers {num_layers} does not divide the model's {shape.num_layers} "
                         "layers: uniform recomputation runs whole chunks of that many layers; pick a divisor "
                         "or --recompute-method block")
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": num_layers}


def transformer_config(shape: ModelShape, *, tp_size: int, dtype: torch.dtype, sequence_parallel: bool = False,
                       recompute: dict | None = None):
    """The `TransformerConfig` of this shape; `recompute` from `recompute_settings`."""
    from megatron.core.transformer import TransformerConfig

    with warnings.catch_warnings():
        # Selective recomputation warns that Transformer Engine's fused core attention needs
        # none; the local spec's core attention is unfused, so the warning does not apply.
        warnings.filterwarnings("ignore", message="If you are using transformer_engine")
        return TransformerConfig(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
            num_attention_heads=shape.num_heads, num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
            normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
            hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            tensor_model_parallel_size=tp_size, sequence_parallel=sequence_parallel,
            params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
            use_cpu_initialization=True, perform_initialization=False,
            **(recompute or {}),
        )


def build_gpt_model(shape: ModelShape, *, dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                    recompute: dict | None = None):
    """This TP rank's GPTModel shard (uninitialised weights; `load_hf_weights` fills them).

    `recompute`: `recompute_settings(...)`; call `allow_recompute_in_eval` after `.eval()`.
    Needs `megatron.core.parallel_state.initialize_model_parallel` to have run.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from miles.backends.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    shape.check_tp(tp_size)
    config = transformer_config(shape, tp_size=tp_size, dtype=dtype, sequence_parallel=sequence_parallel,
                                recompute=recompute)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.padded_vocab(tp_size), max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope", rotary_base=shape.rope_theta,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
    )
    for p in model.parameters():
        p.requires_grad_(False)
    if config.recompute_granularity == "full":
        # Megatron's checkpoint is reentrant: a chunk's output needs gradients only if its
        # input does, and the frozen embedding's output does not. Without this the LoRA
        # weights of the recomputed layers would get none (HF's `enable_input_require_grads`).
        model.embedding.register_forward_hook(_output_needs_grad)
    return model


def _output_needs_grad(module, args, output: Tensor) -> Tensor | None:
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


def allow_recompute_in_eval(model) -> None:
    """Let the model recompute in eval mode.

    Megatron recomputes only in training mode (`TransformerBlock.forward` checks
    `self.training` for full, each layer's `Attention.forward` for selective); the backend
    keeps its model in eval mode. This sets the flag of just those modules, after `.eval()`
    (their submodules stay in eval mode); besides recomputation it only picks inference
    paths of theirs that this backend never takes, so the numbers do not change. A no-op
    without recomputation.
    """
    granularity = model.config.recompute_granularity
    gates = []
    if granularity == "full":
        gates = [model.decoder]
    elif granularity == "selective":
        gates = [layer.self_attention for layer in model.decoder.layers]
    for module in gates:
        module.training = True


def read_hf_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face directory's safetensors files (one or sharded)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (the Megatron backend reads safetensors only)")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


@torch.no_grad()
def load_hf_weights(model, shape: ModelShape, hf_state: dict[str, Tensor]) -> None:
    """Copy a full HF state dict into this TP rank's model shard."""
    from megatron.core import parallel_state

    local = hf_to_megatron(hf_state, shape, parallel_state.get_tensor_model_parallel_rank(),
                           parallel_state.get_tensor_model_parallel_world_size())
    params = base_state_dict(model)
    missing = sorted(set(params) - set(local))
    unexpected = sorted(set(local) - set(params))
    if missing or unexpected:
        raise ValueError(f"HF -> Megatron mapping does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, target in params.items():
        if target.shape != local[name].shape:
            raise ValueError(f"{name}: the model has shape {list(target.shape)}, "
                             f"the mapping gives {list(local[name].shape)}")
        target.copy_(local[name])


def base_state_dict(model) -> dict[str, Tensor]:
    """The model's base parameters by Megatron name (LoRA wrappers' `base.` stripped, LoRA left out)."""
    out = {}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        out[name.replace(".base.", ".")] = param
    return out


def causal_mask(seq_len: int, device: torch.device) -> Tensor:
    """Megatron's attention mask: [1, 1, S, S], True where a query must not look."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def forward_logits(model, shape: ModelShape, input_ids_BS: Tensor) -> Tensor:
    """Logits [B, S, vocab] (gathered over TP, padding columns cut off).

    Right padding needs no padding mask: a real token only attends to earlier tokens.
    """
    from megatron.core import parallel_state

    batch, seq = input_ids_BS.shape
    position_ids_BS = torch.arange(seq, device=input_ids_BS.device).expand(batch, seq)
    local_BSV = model(input_ids_BS, position_ids_BS, causal_mask(seq, input_ids_BS.device))
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() > 1:
        local_BSV = _GatherLastDim.apply(local_BSV, group)
    return local_BSV[..., : shape.vocab_size]


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim over a TP group (backward: this rank's slice).

    Megatron's `gather_from_tensor_model_parallel_region` allocates its output on
    `torch.cuda.current_device()`; this one works wherever the input lives.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        import torch.distributed as dist

        ctx.rank, ctx.size = group.rank(), group.size()
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None
