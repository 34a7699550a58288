"""Next-token choice of the builtin engine: logprobs, greedy, temperature, top-k, top-p.

Logprobs are `log_softmax` of the raw logits (temperature 1, before any filtering), so
they equal what the trainer computes for the same tokens; the filters only shape the
distribution that tokens are drawn from. Each row may carry its own `torch.Generator`
(requests with `sampling_params.seed`), which makes a seeded request reproducible
whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.utils.types import SamplingParams


@dataclass
class RowSampling:
    """How to pick the next token of one batch row."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_params(cls, params: SamplingParams, generator: torch.Generator | None) -> RowSampling:
        return cls(params.temperature, params.top_p, params.top_k, generator)


def validate_sampling_params(params: SamplingParams) -> None:
    """Raise ValueError with what to change when the params cannot be served."""
    if params.top_k < -1:
        raise ValueError(f"sampling_params.top_k must be -1 or 0 (off) or >= 1, got {params.top_k}")
    stops = [params.stop] if isinstance(params.stop, str) else (params.stop or [])
    if any(not s for s in stops):
        raise ValueError("sampling_params.stop must not contain empty strings")
    if any(t < 0 for t in params.stop_token_ids or []):
        raise ValueError("sampling_params.stop_token_ids must be non-negative token ids")


def filter_logits(logits_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to -inf (one row)."""
    if top_k > 0 and top_k < logits_V.shape[-1]:
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_V, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep a token when the mass before it is below top_p, so the top token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits_V = logits_V.masked_fill(drop, float("-inf"))
    return logits_V


def choose_tokens(logits_BV: torch.Tensor, rows: list[RowSampling],
                  default_generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Pick one token per row; return the tokens and their raw-logit logprobs."""
    logits_BV = logits_BV.float()
    logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    tokens_B = torch.argmax(logits_BV, dim=-1)
    for i, row in enumerate(rows):
        if row.greedy:
            continue
        scaled_V = filter_logits(logits_BV[i] / row.temperature, row.top_k, row.top_p)
        probs_V = torch.softmax(scaled_V, dim=-1)
        generator = row.generator if row.generator is not None else default_generator
        tokens_B[i] = torch.multinomial(probs_V, 1, generator=generator)[0]
    chosen_B = logprobs_BV.gather(1, tokens_B[:, None])[:, 0]
    return tokens_B.tolist(), chosen_B.tolist()
