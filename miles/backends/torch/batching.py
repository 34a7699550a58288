"""Micro-batches of mixed-adapter samples for one forward/backward of a train actor.

Samples are stably sorted by slot (so each slot is one contiguous segment of the
page-table layers), cut into micro-batches of `micro_batch_size`, and padded on the
right. Tokens of a sample are `prompt_ids + response_ids`; only response tokens carry
loss. Logprob position t predicts token t + 1, so the response mask and the engine's
rollout logprobs are laid out on the `L - 1` next-token positions:

    for mb in make_micro_batches(samples, advantages, micro_batch_size=8):
        logprobs_BT = next_token_logprobs(model(mb.input_ids_BL, ...).logits, mb.input_ids_BL)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.utils.types import Sample


@dataclass
class MicroBatch:
    input_ids_BL: Tensor
    attention_mask_BL: Tensor
    response_mask_BT: Tensor
    """1 where next-token position t predicts a response token (T = L - 1)."""
    rollout_logprobs_BT: Tensor
    """The engine's logprob of each response token, 0 elsewhere."""
    advantages_B: Tensor
    slots: list[int]
    adapters: list[str]
    indices: list[int]
    """Position of each row's sample in the list given to `make_micro_batches`."""

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            input_ids_BL=self.input_ids_BL.to(device),
            attention_mask_BL=self.attention_mask_BL.to(device),
            response_mask_BT=self.response_mask_BT.to(device),
            rollout_logprobs_BT=self.rollout_logprobs_BT.to(device),
            advantages_B=self.advantages_B.to(device),
            slots=self.slots,
            adapters=self.adapters,
            indices=self.indices,
        )


def make_micro_batches(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    micro_batch_size: int | None,
    *,
    pad_id: int = 0,
    need_rollout_logprobs: bool = False,
) -> list[MicroBatch]:
    """Sort by slot (stable), split into micro-batches and pad each on the right."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    for sample in samples:
        _check_sample(sample, need_rollout_logprobs)
    order = sorted(range(len(samples)), key=lambda i: samples[i].slot)
    size = micro_batch_size or max(1, len(order))
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    return [_pad([samples[i] for i in chunk], [advantages[i] for i in chunk], chunk, pad_id) for chunk in chunks]


def _check_sample(sample: Sample, need_rollout_logprobs: bool) -> None:
    if not sample.prompt_ids:
        raise ValueError(f"sample {sample.group_index}/{sample.index} of adapter '{sample.adapter}' has an empty prompt")
    if need_rollout_logprobs and len(sample.rollout_logprobs) != len(sample.response_ids):
        raise ValueError(
            f"sample {sample.group_index}/{sample.index} of adapter '{sample.adapter}' has "
            f"{len(sample.rollout_logprobs)} rollout logprobs for {len(sample.response_ids)} response tokens; "
            "--use-tis needs the engine's logprob of every response token (return_logprob)"
        )


def _pad(samples: list[Sample], advantages: list[float], indices: list[int], pad_id: int) -> MicroBatch:
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    batch, length = len(samples), max(max(lengths), 2)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    response_mask = torch.zeros((batch, length - 1), dtype=torch.float32)
    rollout_logprobs = torch.zeros((batch, length - 1), dtype=torch.float32)
    for b, (sample, n) in enumerate(zip(samples, lengths)):
        input_ids[b, :n] = torch.tensor(sample.prompt_ids + sample.response_ids, dtype=torch.long)
        attention[b, :n] = 1
        start, end = len(sample.prompt_ids) - 1, n - 1
        response_mask[b, start:end] = 1.0
        if sample.rollout_logprobs and len(sample.rollout_logprobs) == end - start:
            rollout_logprobs[b, start:end] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    return MicroBatch(
        input_ids_BL=input_ids,
        attention_mask_BL=attention,
        response_mask_BT=response_mask,
        rollout_logprobs_BT=rollout_logprobs,
        advantages_B=torch.tensor(advantages, dtype=torch.float32),
        slots=[s.slot for s in samples],
        adapters=[s.adapter for s in samples],
        indices=list(indices),
    )


def next_token_logprobs(logits_BLV: Tensor, input_ids_BL: Tensor) -> Tensor:
    """log p(token t+1 | tokens <= t) for t in 0..L-2, in float32."""
    logprobs = torch.log_softmax(logits_BLV[:, :-1].float(), dim=-1)
    return torch.gather(logprobs, 2, input_ids_BL[:, 1:].unsqueeze(-1)).squeeze(-1)


def response_logprobs(logprobs_BT: Tensor, batch: MicroBatch) -> list[list[float]]:
    """Each sample's logprobs of its response tokens, as lists."""
    out = []
    for b in range(logprobs_BT.shape[0]):
        keep = batch.response_mask_BT[b].bool()
        out.append(logprobs_BT[b][keep].tolist())
    return out
