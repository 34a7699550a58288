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

Client datums (`client_loss.ClientRow`) join the same micro-batches: a mixed micro-batch
holds its RL samples in rows 0..R-1 and its client datums after them (`MicroBatch.client`),
all in one forward; every position of a client row scores its datum's own target token
(`MicroBatch.target_tokens_BL`, `target_logprobs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles.backends.common.client_loss import ClientInputs, ClientRow
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
class ClientPart:
    """The client datums of a micro-batch: its rows `start`.. (after its RL samples)."""

    start: int
    rows: list[ClientRow]
    inputs: ClientInputs
    """Their loss inputs, padded to the micro-batch's length."""

    def to(self, device: torch.device | str) -> ClientPart:
        return ClientPart(start=self.start, rows=self.rows, inputs=self.inputs.to(device))


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
    """Position of each RL row's sample in the list given to `make_micro_batches`."""
    client: ClientPart | None = None
    """Client datums after the RL rows (their RL fields are zero); None: RL samples only."""

    @property
    def n_samples(self) -> int:
        """Rows 0..n_samples-1 are RL samples."""
        return len(self.indices)

    def target_tokens_BL(self) -> Tensor:
        """The token each position scores: an RL row's next token (its last position: the pad
        id, scored by nothing), a client row's datum target."""
        next_BL = torch.nn.functional.pad(self.input_ids_BL[:, 1:], (0, 1))
        if self.client is None:
            return next_BL
        return torch.cat([next_BL[: self.client.start], self.client.inputs.targets_CL.to(next_BL.device)])

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
            client=None if self.client is None else self.client.to(device),
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
    client: Sequence[ClientRow] = (),
) -> list[MicroBatch]:
    """Sort by slot (stable), split into micro-batches and pad each on the right.

    `client` rows are cut with the samples by the same rules (their length: their tokens)
    and put after the samples of their micro-batch.

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
    slots = [s.slot for s in samples] + [r.slot for r in client]
    if max_tokens is not None:
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples] + [r.length for r in client]
        chunks = _pack_by_tokens(slots, lengths, max_tokens)
    else:
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        size = micro_batch_size or max(1, len(order))
        chunks = [order[i : i + size] for i in range(0, len(order), size)]
    if not client:
        return [_pad([samples[i] for i in chunk], [advantages[i] for i in chunk], chunk, pad_id) for chunk in chunks]
    n = len(samples)
    return [_pad_mixed([i for i in chunk if i < n], [client[i - n] for i in chunk if i >= n], samples, advantages,
                       pad_id) for chunk in chunks]


def _pack_by_tokens(slots: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices in (slot, length) order, cut where the padded size would pass the budget."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    lengths = [max(n, MIN_ROW_TOKENS) for n in lengths]
    order = sorted(range(len(slots)), key=lambda i: (slots[i], lengths[i]))
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


def _pad_mixed(indices: list[int], rows: list[ClientRow], samples: Sequence[Sample],
               advantages: Sequence[Advantage], pad_id: int) -> MicroBatch:
    """The samples `indices`, then the client `rows`, padded to one length."""
    chosen = [samples[i] for i in indices]
    length = max([len(s.prompt_ids) + len(s.response_ids) for s in chosen] + [r.length for r in rows])
    mb = _pad(chosen, [advantages[i] for i in indices], indices, pad_id, length=length)
    ids = torch.full((len(rows), mb.input_ids_BL.shape[1]), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for c, row in enumerate(rows):
        ids[c, : row.length] = torch.tensor(row.tokens, dtype=torch.long)
        attention[c, : row.length] = 1
    zeros_CT = torch.zeros((len(rows), mb.response_mask_BT.shape[1]), dtype=torch.float32)
    return MicroBatch(
        input_ids_BL=torch.cat([mb.input_ids_BL, ids]),
        attention_mask_BL=torch.cat([mb.attention_mask_BL, attention]),
        response_mask_BT=torch.cat([mb.response_mask_BT, zeros_CT]),
        loss_mask_BT=torch.cat([mb.loss_mask_BT, zeros_CT]),
        rollout_logprobs_BT=torch.cat([mb.rollout_logprobs_BT, zeros_CT]),
        advantages_BT=torch.cat([mb.advantages_BT, zeros_CT]),
        slots=mb.slots + [r.slot for r in rows],
        adapters=mb.adapters + [r.adapter for r in rows],
        indices=mb.indices,
        client=ClientPart(start=len(chosen), rows=rows, inputs=ClientInputs.collate(rows, ids.shape[1])),
    )


def _pad(samples: list[Sample], advantages: list[Advantage], indices: list[int], pad_id: int,
         length: int | None = None) -> MicroBatch:
    """`length`: pad to at least that many tokens (default: the longest sample's)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    batch, length = len(samples), max(lengths + ([] if length is None else [length]) + [MIN_ROW_TOKENS])
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


def target_logprobs(logits_BLV: Tensor, targets_BL: Tensor, *, chunk_elements: int = 2**20) -> Tensor:
    """log softmax(logits)[target] at every position, in float32, shape [B, L]: position t
    scores `targets_BL[:, t]` (any token), a block of about `chunk_elements` logits at a
    time, as `next_token_logprobs` does."""
    if logits_BLV.shape[:2] != targets_BL.shape:
        raise ValueError(f"logits cover {list(logits_BLV.shape[:2])} positions, "
                         f"the targets {list(targets_BL.shape)}")
    block_tokens = max(1, chunk_elements // logits_BLV.shape[-1])
    return _ChunkedTokenLogprobs.apply(logits_BLV, targets_BL, block_tokens)


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
    """logit[target] - logsumexp(logits) over positions 0..T-1 of [B, K, V] logits, T = K - 1
    (next tokens: the last position predicts nothing) or K (`target_logprobs`)."""

    @staticmethod
    def forward(ctx, logits_BKV: Tensor, targets_BT: Tensor, block_tokens: int) -> Tensor:  # type: ignore[override]
        batch, n_pos = targets_BT.shape
        blocks = _blocks(batch, n_pos, block_tokens)
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
        # The blocks cover every position with a target (next tokens: all but the last, which
        # predicts nothing): only the others are zeroed, not the whole [B, K, V] gradient.
        grad_logits = torch.empty_like(logits_BKV)
        grad_logits[:, targets_BT.shape[1] :] = 0
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


def activation_token_budget(samples: Sequence[Sample], budget_bytes: int, bytes_per_token: int,
                            extra_lengths: Sequence[int] = ()) -> int | None:
    """The `max_tokens` of `make_micro_batches` that keeps each micro-batch's activations
    within `budget_bytes`, evened out over the micro-batches needed; None when the whole
    (padded) batch fits. `extra_lengths`: the tokens of the client rows trained with them."""
    lengths = [max(len(s.prompt_ids) + len(s.response_ids), MIN_ROW_TOKENS) for s in samples]
    lengths += [max(n, MIN_ROW_TOKENS) for n in extra_lengths]
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

    def max_tokens(self, samples: Sequence[Sample], extra_lengths: Sequence[int] = ()) -> int | None:
        return activation_token_budget(samples, self.budget_bytes, self.bytes_per_token, extra_lengths)
