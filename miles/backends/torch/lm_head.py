"""The LM head fused with next-token logprobs (and entropy): no [N, vocab] logits held.

A train step needs only each position's logprob of its next token (and, with an entropy
bonus, the entropy of its next-token distribution), never the logits themselves. The
plain path holds the [B, K, V] logits, and in the backward their [B, K, V] gradient too,
hundreds of MB on a 32k vocabulary. Here the frozen head (and its slot LoRA, below) runs on
the decoder's final hidden states a chunk of rows at a time, and each chunk's softmax
becomes, while it is at hand, the [rows, H] derivative of the logprob (and entropy) by
the hidden states; the backward only scales those by the upstream gradient. The same two
GEMMs as the plain head's forward and backward (three with entropy), and at most one
chunk of logits alive.

    head_VH = fused_head_weight(model)  # None when the model's head is not a plain linear
    hidden_BLH = model.get_decoder()(input_ids=ids_BL, attention_mask=mask_BL).last_hidden_state
    logprobs_BT, entropy_BT = lm_head_logprobs(hidden_BLH[:, :-1], head_VH, ids_BL[:, 1:], entropy=True)

With a slot LoRA on the head (`--lora-unembed`: the head is a `MultiLoRALinear`), each row's
logits are h W^T + s (h A^T) B^T of its slot. The low-rank part goes in as two operands,
`slot_head_lora`: u [B, T, K] (each row's scaled h A^T on its slot's K = max_rank columns
of the slots up to the highest present, zero elsewhere) and b [V, K] (those slots' B side by
side), made with autograd, so A's gradient flows through u. The fused head then needs the
gradient by b as well, b^T-weighted by every row's upstream gradient, which the forward
cannot form: that variant keeps no derivatives and runs the chunks again in the backward
(one more logits GEMM).

    lora = slot_head_lora(model.get_output_embeddings(), hidden_BLH[:, :-1], slots)
    logprobs_BT = lm_head_logprobs(hidden_BLH[:, :-1], head_VH, ids_BL[:, 1:], lora=lora)

Shape suffixes: B rows, T positions, N = B x T flattened positions, H hidden, V vocabulary,
K the stacked slot columns of a head LoRA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from miles.lora.layer import MultiLoRALinear

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CHUNK_LOGITS = 2**23
"""Logits (rows x vocabulary) computed at a time: 32 MB in float32. Each chunk's two GEMMs
read the whole head weight, so fewer, larger chunks run faster (a 60M train step with
2**22: 3 % slower than the model's head; 2**23: the same)."""

FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Architectures whose logits are exactly `lm_head(final hidden states)`: no logit
soft-capping, scale or bias (SmolLM2 is a llama; tied embeddings are fine)."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def fused_head_weight(model: PreTrainedModel) -> Tensor | None:
    """The head weight [V, H] of `model` when its logits are exactly `hidden @ weight.T`
    (a frozen bias-free `nn.Linear` on an architecture of `FUSED_MODEL_TYPES` whose config
    sets no logit transform), plus a slot LoRA where the head carries one (`head_lora_layer`);
    None otherwise, and the caller keeps the model's own head."""
    config = model.config.get_text_config()
    head = model.get_output_embeddings()
    if isinstance(head, MultiLoRALinear):
        head = head.base
    if config.model_type not in FUSED_MODEL_TYPES or type(head) is not nn.Linear or head.bias is not None:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    if head.weight.requires_grad:
        return None
    return head.weight


def head_lora_layer(model: PreTrainedModel) -> MultiLoRALinear | None:
    """The slot LoRA of `model`'s head (`inject_multi_lora` with `lm_head`); None: a plain head."""
    head = model.get_output_embeddings()
    return head if isinstance(head, MultiLoRALinear) else None


def slot_head_lora(layer: MultiLoRALinear, hidden_BTH: Tensor, slots: Sequence[int]) -> tuple[Tensor, Tensor] | None:
    """The low-rank part of the head's logits for rows of `slots` (-1: the base alone) as
    (u [B, T, K], b [V, K]): u @ b.T is each row's s (h A^T) B^T of its slot. Made with
    autograd (A's and B's gradients flow through them); None when no row has a slot."""
    ids = [int(s) for s in slots]
    if len(ids) != hidden_BTH.shape[0]:
        raise ValueError(f"{len(ids)} slots for {hidden_BTH.shape[0]} rows of hidden states")
    present = [s for s in ids if s >= 0]
    if not present:
        return None
    n_cols, rank = max(present) + 1, layer.max_rank
    a_KH = layer.lora_A[:n_cols].reshape(n_cols * rank, -1)
    b_VK = layer.lora_B[:n_cols].permute(1, 0, 2).reshape(layer.out_features, n_cols * rank)
    scale_BK = torch.zeros(len(ids), n_cols * rank, dtype=a_KH.dtype)
    for row, slot in enumerate(ids):
        if slot >= 0:
            scale_BK[row, slot * rank : (slot + 1) * rank] = layer.slot_scales[slot]
    u_BTK = (hidden_BTH.to(a_KH.dtype) @ a_KH.t()) * scale_BK.to(a_KH.device)[:, None, :]
    return u_BTK, b_VK


def lm_head_logprobs(
    hidden_BTH: Tensor, weight_VH: Tensor, targets_BT: Tensor, *, entropy: bool = False,
    chunk_logits: int = CHUNK_LOGITS, lora: tuple[Tensor, Tensor] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(hidden @ weight.T)[target] per position, float32 [B, T]; with `entropy`,
    also -sum p log p of each position's distribution [B, T].

    The numbers are those of `log_softmax(F.linear(hidden, weight).float())` gathered at
    the targets (the logits are computed in the hidden states' dtype and read in float32,
    as the model's own head and `next_token_logprobs` do), `chunk_logits` logits at a time.
    Gradients flow to `hidden_BTH` only; `weight_VH` must not require grad.

    With `lora` = (u [B, T, K], b [V, K]) from `slot_head_lora`, the logits are
    hidden @ weight.T + u @ b.T (the LoRA term in float32), and gradients flow to u and b too.
    """
    if weight_VH.requires_grad:
        raise ValueError("lm_head_logprobs takes a frozen head weight: it computes no gradient for it")
    batch, n_pos, hidden = hidden_BTH.shape
    if targets_BT.shape != (batch, n_pos):
        raise ValueError(f"targets have shape {list(targets_BT.shape)}, expected {[batch, n_pos]}")
    rows = max(1, chunk_logits // weight_VH.shape[0])
    if lora is not None:
        u_BTK, b_VK = lora
        out = _FusedLoRAHeadLogprobs.apply(hidden_BTH.reshape(-1, hidden), weight_VH,
                                           u_BTK.reshape(batch * n_pos, -1), b_VK, targets_BT.reshape(-1), rows,
                                           entropy)
    else:
        out = _FusedHeadLogprobs.apply(hidden_BTH.reshape(-1, hidden), weight_VH, targets_BT.reshape(-1), rows,
                                       entropy)
    if entropy:
        return out[0].view(batch, n_pos), out[1].view(batch, n_pos)
    return out.view(batch, n_pos)


class _FusedHeadLogprobs(torch.autograd.Function):
    """logprob of each row's target (and entropy) under softmax(hidden_NH @ weight_VH.T).

    The gradient is formed in the forward, where the chunk's softmax is at hand: with the
    head frozen, d logprob/d hidden = -(p - onehot(y)) @ W and dH/d hidden =
    -(p * (log p + H)) @ W, each an [N, H] matrix that the upstream per-row gradient
    only scales. So the forward keeps two (one without entropy) [N, H] matrices instead
    of the logits, runs the same GEMMs the plain head runs in its forward and backward,
    and the backward is elementwise. A forward without grad runs the logits GEMM only.
    Each chunk works in two [rows, V] float32 buffers taken once per call, so the chunks
    leave no holes in the heap (with entropy, its log-softmax takes a third per chunk).
    """

    @staticmethod
    def forward(ctx, hidden_NH: Tensor, weight_VH: Tensor, targets_N: Tensor, rows: int, entropy: bool):  # type: ignore[override]
        n = hidden_NH.shape[0]
        with_grad = ctx.needs_input_grad[0]
        logprobs_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        entropy_N = torch.empty_like(logprobs_N) if entropy else None
        dlogp_NH = torch.empty_like(hidden_NH, dtype=weight_VH.dtype) if with_grad else None
        dent_NH = torch.empty_like(hidden_NH, dtype=weight_VH.dtype) if with_grad and entropy else None
        logits_buf, probs_buf = _buffers(hidden_NH, weight_VH, rows)
        for start in range(0, n, rows):
            chunk = slice(start, start + rows)
            targets_R1 = targets_N[chunk, None]
            logits = _chunk_logits(hidden_NH[chunk], weight_VH, logits_buf)
            exp = probs_buf[: logits.shape[0]]
            max_R = logits.amax(dim=-1)
            max_R = torch.where(torch.isinf(max_R), 0.0, max_R)
            target_logit_R = logits.gather(-1, targets_R1).squeeze(-1)
            # log p as `entropy_from_logits` computes it, so the entropy rounds the same
            logp = torch.log_softmax(logits, dim=-1) if entropy_N is not None else None
            shifted = logits.sub_(max_R[:, None])
            sum_R = torch.exp(shifted, out=exp).sum(dim=-1)
            log_sum_R = sum_R.log()
            logprobs_N[chunk] = target_logit_R - (log_sum_R + max_R)  # logit[y] - logsumexp
            if entropy_N is None and not with_grad:
                continue
            if entropy_N is None or logp is None:
                probs = exp.div_(sum_R[:, None])
            else:
                probs = torch.exp(logp, out=exp)
                plogp = logp.mul_(probs)
                entropy_R = -plogp.sum(dim=-1)
                entropy_N[chunk] = entropy_R
                if dent_NH is not None:  # p (log p + H)
                    torch.mm(plogp.addcmul_(probs, entropy_R[:, None]).to(weight_VH.dtype), weight_VH,
                             out=dent_NH[chunk])
            if dlogp_NH is not None:
                p_minus_onehot = probs.scatter_add_(-1, targets_R1,
                                                    torch.full_like(targets_R1, -1.0, dtype=probs.dtype))
                torch.mm(p_minus_onehot.to(weight_VH.dtype), weight_VH, out=dlogp_NH[chunk])
        ctx.save_for_backward(dlogp_NH, dent_NH)
        ctx.hidden_dtype = hidden_NH.dtype
        return logprobs_N if entropy_N is None else (logprobs_N, entropy_N)

    @staticmethod
    def backward(ctx, grad_logprobs_N: Tensor, grad_entropy_N: Tensor | None = None):  # type: ignore[override]
        dlogp_NH, dent_NH = ctx.saved_tensors
        grad_NH = dlogp_NH.float() * grad_logprobs_N.float()[:, None]
        if dent_NH is not None and grad_entropy_N is not None:
            grad_NH.addcmul_(dent_NH.float(), grad_entropy_N.float()[:, None])
        return grad_NH.neg_().to(ctx.hidden_dtype), None, None, None, None


class _FusedLoRAHeadLogprobs(torch.autograd.Function):
    """`_FusedHeadLogprobs` for logits hidden_NH @ weight_VH.T + u_NK @ b_VK.T.

    b's gradient sums every row's upstream-weighted d logits by u, so it cannot be formed in
    the forward as the hidden states' is: the forward keeps only its inputs, and the
    backward runs each chunk's logits and softmax again and forms, with the chunk's
    d loss / d logits G = g_logp (onehot(y) - p) - g_H p (log p + H), the three products
    G @ W (hidden), G @ b (u) and G^T @ u (summed into b's).
    """

    @staticmethod
    def forward(ctx, hidden_NH: Tensor, weight_VH: Tensor, u_NK: Tensor, b_VK: Tensor,  # type: ignore[override]
                targets_N: Tensor, rows: int, entropy: bool):
        n = hidden_NH.shape[0]
        logprobs_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        entropy_N = torch.empty_like(logprobs_N) if entropy else None
        logits_buf, _ = _buffers(hidden_NH, weight_VH, rows)
        b_KV = b_VK.float().t()
        for start in range(0, n, rows):
            chunk = slice(start, start + rows)
            logits = _chunk_logits(hidden_NH[chunk], weight_VH, logits_buf).addmm_(u_NK[chunk].float(), b_KV)
            logp = torch.log_softmax(logits, dim=-1)
            logprobs_N[chunk] = logp.gather(-1, targets_N[chunk, None]).squeeze(-1)
            if entropy_N is not None:
                entropy_N[chunk] = -(logp.exp() * logp).sum(dim=-1)
        ctx.save_for_backward(hidden_NH, weight_VH, u_NK, b_VK, targets_N)
        ctx.rows, ctx.entropy = rows, entropy
        return logprobs_N if entropy_N is None else (logprobs_N, entropy_N)

    @staticmethod
    def backward(ctx, grad_logprobs_N: Tensor, grad_entropy_N: Tensor | None = None):  # type: ignore[override]
        hidden_NH, weight_VH, u_NK, b_VK, targets_N = ctx.saved_tensors
        rows = ctx.rows
        grad_h_NH = torch.empty(hidden_NH.shape, dtype=torch.float32, device=hidden_NH.device)
        grad_u_NK = torch.empty(u_NK.shape, dtype=torch.float32, device=u_NK.device)
        grad_b_VK = torch.zeros(b_VK.shape, dtype=torch.float32, device=b_VK.device)
        logits_buf, _ = _buffers(hidden_NH, weight_VH, rows)
        b_VK32 = b_VK.float()
        for start in range(0, hidden_NH.shape[0], rows):
            chunk = slice(start, start + rows)
            logits = _chunk_logits(hidden_NH[chunk], weight_VH, logits_buf).addmm_(u_NK[chunk].float(), b_VK32.t())
            logp = torch.log_softmax(logits, dim=-1)
            probs = logp.exp()
            # d logprob[y] / d logits = onehot(y) - p, times the upstream gradient
            g_R1 = grad_logprobs_N[chunk, None].float()
            grad_logits = probs.mul(-g_R1).scatter_add_(-1, targets_N[chunk, None], g_R1)
            if ctx.entropy and grad_entropy_N is not None:  # d H / d logits = -p (log p + H)
                entropy_R1 = -(probs * logp).sum(dim=-1, keepdim=True)
                grad_logits.addcmul_(probs * (logp + entropy_R1), grad_entropy_N[chunk, None].float(), value=-1.0)
            grad_h_NH[chunk] = grad_logits.to(weight_VH.dtype) @ weight_VH
            grad_u_NK[chunk] = grad_logits @ b_VK32
            grad_b_VK.addmm_(grad_logits.t(), u_NK[chunk].float())
        return (grad_h_NH.to(hidden_NH.dtype), None, grad_u_NK.to(u_NK.dtype), grad_b_VK.to(b_VK.dtype),
                None, None, None)


def _buffers(hidden_NH: Tensor, weight_VH: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    shape = (min(rows, hidden_NH.shape[0]), weight_VH.shape[0])
    return (torch.empty(shape, dtype=torch.float32, device=hidden_NH.device),
            torch.empty(shape, dtype=torch.float32, device=hidden_NH.device))


def _chunk_logits(hidden_RH: Tensor, weight_VH: Tensor, buf: Tensor) -> Tensor:
    """The chunk's logits in float32, in `buf`: the GEMM in the weight's dtype, as the
    model's own head computes them."""
    out = buf[: hidden_RH.shape[0]]
    if weight_VH.dtype == torch.float32:
        return torch.mm(hidden_RH, weight_VH.t(), out=out)
    return out.copy_(F.linear(hidden_RH, weight_VH))
