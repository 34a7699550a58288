"""Micro-batches of mixed-adapter samples for one forward/backward of a train actor.

Samples are stably sorted by slot (so each slot is one contiguous segment of the
page-table layers), cut into micro-batches of `micro_batch_size` samples or of at most
`max_tokens` padded tokens (rows x longest row), and padded on the right. Tokens of a
sample are `prompt_ids + response_ids`; only response tokens carry loss. Logprob
position t predicts token t + 1, so the response mask and the engine's rollout logprobs
are laid out on the `L - 1` next-token positions:

    for mb in make_micro_batches(samples, advantages, micro_batch_size=8):
        logits = model(mb.input_ids_BL, ..., logits_to_keep=logits_to_keep(mb)).logits
        logprobs_BT = next_token_logprobs(logits, mb.input_ids_BL)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles.utils.types import Sample

MIN_ROW_TOKENS = 2
"""A padded row holds at least two tokens: one next-token position."""

CPU_ACTIVATION_BUDGET_MB = 1024
"""A CPU train rank given no micro-batch size cuts the batch so that the activations its
backward keeps stay near this (`--activation-budget-mb`). SmolLM2-135M, 32 x 64 tokens:
micro-batches of up to 704 tokens peak at 0.19-0.21 of the memory of 8 PEFT trainers
against 0.32-0.34 for the whole batch (512 MiB: 0.16); their step took 0.98-1.15x the
whole batch's by wall clock in three runs on a shared VM, the same by process CPU time.
The 60M and tiny benchmark models' batches fit and stay one forward."""


@dataclass
class MicroBatch:
    input_ids_BL: Tensor
    attention_mask_BL: Tensor
    response_mask_BT: Tensor
    """1 where next-token position t predicts a response token (T = L - 1)."""
    loss_mask_BT: Tensor
    """`response_mask_BT` times each sample's `loss_mask` (0 on tool outputs and other
    environment tokens): the positions that carry loss."""
    rollout_logprobs_BT: Tensor
    """The engine's logprob of each response token, 0 elsewhere."""
    advantages_BT: Tensor
    """Each response token's advantage (a sample-level advantage on all of its response
    tokens), 0 elsewhere."""
    slots: list[int]
    adapters: list[str]
    indices: list[int]
    """Position of each row's sample in the list given to `make_micro_batches`."""

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            input_ids_BL=self.input_ids_BL.to(device),
            attention_mask_BL=self.attention_mask_BL.to(device),
            response_mask_BT=self.response_mask_BT.to(device),
            loss_mask_BT=self.loss_mask_BT.to(device),
            rollout_logprobs_BT=self.rollout_logprobs_BT.to(device),
            advantages_BT=self.advantages_BT.to(device),
            slots=self.slots,
            adapters=self.adapters,
            indices=self.indices,
        )


Advantage = float | Sequence[float]
"""A sample's advantage: one value for all its response tokens, or one per response token."""


def make_micro_batches(
    samples: Sequence[Sample],
    advantages: Sequence[Advantage],
    micro_batch_size: int | None,
    *,
    max_tokens: int | None = None,
    pad_id: int = 0,
    need_rollout_logprobs: bool = False,
) -> list[MicroBatch]:
    """Sort by slot (stable), split into micro-batches and pad each on the right.

    With `max_tokens` (`--use-dynamic-batch-size --max-tokens-per-gpu`) the samples are
    ordered by slot, then length, and packed greedily so that no micro-batch holds more
    than `max_tokens` tokens once padded (rows x longest row); a sample longer than that
    is a micro-batch of its own. `micro_batch_size` is then not used. Either way every
    sample's loss is its own, so the summed gradient does not depend on the split.
    """
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    for sample, advantage in zip(samples, advantages):
        _check_sample(sample, need_rollout_logprobs)
        if isinstance(advantage, Sequence) and len(advantage) != len(sample.response_ids):
            raise ValueError(
                f"sample {sample.group_index}/{sample.index} of adapter '{sample.adapter}' has "
                f"{len(advantage)} token advantages for {len(sample.response_ids)} response tokens"
            )
    if max_tokens is not None:
        chunks = _pack_by_tokens(samples, max_tokens)
    else:
        order = sorted(range(len(samples)), key=lambda i: samples[i].slot)
        size = micro_batch_size or max(1, len(order))
        chunks = [order[i : i + size] for i in range(0, len(order), size)]
    return [_pad([samples[i] for i in chunk], [advantages[i] for i in chunk], chunk, pad_id) for chunk in chunks]


def _pack_by_tokens(samples: Sequence[Sample], max_tokens: int) -> list[list[int]]:
    """Sample indices in (slot, length) order, cut where the padded size would pass the budget."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    lengths = [max(len(s.prompt_ids) + len(s.response_ids), MIN_ROW_TOKENS) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: (samples[i].slot, lengths[i]))
    chunks: list[list[int]] = []
    longest = 0
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * max(longest, lengths[i]) <= max_tokens:
            chunks[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            chunks.append([i])
            longest = lengths[i]
    return chunks


def _check_sample(sample: Sample, need_rollout_logprobs: bool) -> None:
    if not sample.prompt_ids:
        raise ValueError(f"sample {sample.group_index}/{sample.index} of adapter '{sample.adapter}' "
                         "has an empty prompt")
    if sample.loss_mask is not None and len(sample.loss_mask) != len(sample.response_ids):
        raise ValueError(
            f"sample {sample.group_index}/{sample.index} of adapter '{sample.adapter}' has a loss mask of "
            f"{len(sample.loss_mask)} entries for {len(sample.response_ids)} response tokens"
        )
    if need_rollout_logprobs and len(sample.rollout_logprobs) != len(sample.response_ids):
        raise ValueError(
            f"sample {sample.group_index}/{sample.index} of adapter '{sample.adapter}' has "
            f"{len(sample.rollout_logprobs)} rollout logprobs for {len(sample.response_ids)} response tokens; "
            "--use-tis needs the engine's logprob of every response token (return_logprob)"
        )


def _pad(samples: list[Sample], advantages: list[Advantage], indices: list[int], pad_id: int) -> MicroBatch:
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    batch, length = len(samples), max(max(lengths), MIN_ROW_TOKENS)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    response_mask = torch.zeros((batch, length - 1), dtype=torch.float32)
    loss_mask = torch.zeros((batch, length - 1), dtype=torch.float32)
    rollout_logprobs = torch.zeros((batch, length - 1), dtype=torch.float32)
    advantages_BT = torch.zeros((batch, length - 1), dtype=torch.float32)
    for b, (sample, n) in enumerate(zip(samples, lengths)):
        input_ids[b, :n] = torch.tensor(sample.prompt_ids + sample.response_ids, dtype=torch.long)
        attention[b, :n] = 1
        start, end = len(sample.prompt_ids) - 1, n - 1
        response_mask[b, start:end] = 1.0
        advantages_BT[b, start:end] = torch.as_tensor(advantages[b], dtype=torch.float32)
        if sample.loss_mask is not None:
            loss_mask[b, start:end] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        else:
            loss_mask[b, start:end] = 1.0
        if sample.rollout_logprobs and len(sample.rollout_logprobs) == end - start:
            rollout_logprobs[b, start:end] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    return MicroBatch(
        input_ids_BL=input_ids,
        attention_mask_BL=attention,
        response_mask_BT=response_mask,
        loss_mask_BT=loss_mask,
        rollout_logprobs_BT=rollout_logprobs,
        advantages_BT=advantages_BT,
        slots=[s.slot for s in samples],
        adapters=[s.adapter for s in samples],
        indices=list(indices),
    )


def next_token_logprobs(logits_BKV: Tensor, input_ids_BL: Tensor, *, chunk_elements: int = 2**20) -> Tensor:
    """log p(token t+1 | tokens <= t) for t in 0..L-2, in float32, shape [B, L - 1].

    `logits_BKV` may cover only the last K <= L positions (a forward run with
    `logits_to_keep=K`, see `logits_to_keep`); positions before them get 0. The value is
    `logit[target] - logsumexp(logits)`, computed a block of about `chunk_elements`
    logits at a time (a few MB: the block stays in cache between the passes), so
    neither a float32 [B, T, V] log-softmax nor its gradient's temporaries are ever
    held: the backward writes softmax-minus-one-hot straight into the logits' gradient.
    """
    n_keep, length = logits_BKV.shape[1], input_ids_BL.shape[1]
    if not 1 <= n_keep <= length:
        raise ValueError(f"logits cover {n_keep} positions but the batch has {length} tokens per row")
    targets_BK = input_ids_BL[:, length - n_keep + 1 :]
    block_tokens = max(1, chunk_elements // logits_BKV.shape[-1])
    logprobs_BK = _ChunkedTokenLogprobs.apply(logits_BKV, targets_BK, block_tokens)
    return torch.nn.functional.pad(logprobs_BK, (length - n_keep, 0))


def logits_to_keep(batch: MicroBatch) -> int:
    """How many final positions of `batch` need logits: from the first position that
    predicts a response token (in any row) to the end. Pass it as the forward's
    `logits_to_keep` and the prompt positions before it cost no LM-head or softmax work."""
    rows, cols = torch.nonzero(batch.response_mask_BT, as_tuple=True)
    length = batch.input_ids_BL.shape[1]
    return length if cols.numel() == 0 else length - int(cols.min())


def _blocks(batch: int, n_pos: int, block_tokens: int) -> list[tuple[slice, slice]]:
    """(rows, positions) blocks of about `block_tokens` positions: whole rows when rows
    are short, pieces of one row when they are long."""
    if n_pos <= block_tokens:
        rows = block_tokens // max(1, n_pos)
        return [(slice(b, b + rows), slice(0, n_pos)) for b in range(0, batch, rows)]
    return [(slice(b, b + 1), slice(t, min(t + block_tokens, n_pos)))
            for b in range(batch) for t in range(0, n_pos, block_tokens)]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """logit[target] - logsumexp(logits) over positions 0..K-2 of [B, K, V] logits."""

    @staticmethod
    def forward(ctx, logits_BKV: Tensor, targets_BT: Tensor, block_tokens: int) -> Tensor:  # type: ignore[override]
        blocks = _blocks(*targets_BT.shape, block_tokens)
        out_BT = torch.empty(targets_BT.shape, dtype=torch.float32, device=logits_BKV.device)
        lse_BT = torch.empty_like(out_BT)
        for rows, pos in blocks:
            x = logits_BKV[rows, pos].float()
            lse = torch.logsumexp(x, dim=-1)
            lse_BT[rows, pos] = lse
            out_BT[rows, pos] = x.gather(-1, targets_BT[rows, pos, None]).squeeze(-1) - lse
        ctx.save_for_backward(logits_BKV, targets_BT, lse_BT)
        ctx.blocks = blocks
        return out_BT

    @staticmethod
    def backward(ctx, grad_BT: Tensor):  # type: ignore[override]
        logits_BKV, targets_BT, lse_BT = ctx.saved_tensors
        # The blocks cover every position but the last (it predicts nothing): only that one
        # is zeroed, not the whole [B, K, V] gradient.
        grad_logits = torch.empty_like(logits_BKV)
        grad_logits[:, -1] = 0
        grad_BT = grad_BT.float()
        for rows, pos in ctx.blocks:
            g_bt1 = grad_BT[rows, pos, None]
            # d(logit[y] - lse)/d logits = onehot(y) - softmax
            if grad_logits.dtype == torch.float32:  # computed in place in the gradient's block
                probs = torch.sub(logits_BKV[rows, pos], lse_BT[rows, pos, None], out=grad_logits[rows, pos]).exp_()
            else:
                probs = torch.exp(logits_BKV[rows, pos].float() - lse_BT[rows, pos, None])
            g = probs.mul_(g_bt1).neg_().scatter_add_(-1, targets_BT[rows, pos, None], g_bt1)
            if grad_logits.dtype != torch.float32:
                grad_logits[rows, pos] = g.to(grad_logits.dtype)
        return grad_logits, None, None


def response_logprobs(logprobs_BT: Tensor, batch: MicroBatch) -> list[list[float]]:
    """Each sample's logprobs of its response tokens, as lists."""
    out = []
    for b in range(logprobs_BT.shape[0]):
        keep = batch.response_mask_BT[b].bool()
        out.append(logprobs_BT[b][keep].tolist())
    return out


def activation_bytes_per_token(model_config: Any, dtype_bytes: int, recompute_granularity: str | None) -> int:
    """About what the backward keeps per token of a decoder-only model, from its shape.

    Per layer, keeping everything: six hidden-sized tensors (the norms' inputs, the LoRA
    inputs, the query and the attention output) and four intermediate-sized ones (gate,
    up, silu(gate) and the down projection's input). SmolLM2-135M: 9,600 floats a token a
    layer here, about 9,900 counted by saved-tensor hooks (keys and values, LoRA
    intermediates). `selective` drops two hidden- and two intermediate-sized tensors;
    `full` keeps each layer's input, and one layer's worth during its backward."""
    hidden = model_config.hidden_size
    intermediate = getattr(model_config, "intermediate_size", None) or 4 * hidden
    layers = model_config.num_hidden_layers
    per_layer = 6 * hidden + 4 * intermediate
    if recompute_granularity == "full":
        floats = layers * hidden + per_layer
    elif recompute_granularity == "selective":
        floats = layers * (4 * hidden + 2 * intermediate)
    else:
        floats = layers * per_layer
    return floats * dtype_bytes


def activation_token_budget(samples: Sequence[Sample], budget_bytes: int, bytes_per_token: int) -> int | None:
    """The `max_tokens` of `make_micro_batches` that keeps each micro-batch's activations
    within `budget_bytes`, evened out over the micro-batches needed; None when the whole
    (padded) batch fits."""
    lengths = [max(len(s.prompt_ids) + len(s.response_ids), MIN_ROW_TOKENS) for s in samples]
    if not lengths:
        return None
    longest = max(lengths)
    padded = len(lengths) * longest
    limit = max(1, budget_bytes // bytes_per_token)
    if padded <= limit:
        return None
    even = math.ceil(padded / math.ceil(padded / limit))
    return max(1, min(limit, math.ceil(even / longest) * longest))


@dataclass
class ActivationBudget:
    """Training micro-batches sized by estimated activation memory (`--activation-budget-mb`)."""

    budget_bytes: int
    bytes_per_token: int
    announced: bool = False
    """Whether a split has been logged (once per rank)."""

    def max_tokens(self, samples: Sequence[Sample]) -> int | None:
        return activation_token_budget(samples, self.budget_bytes, self.bytes_per_token)
