"""Tolerances derived from the computation, so a comparison holds on any CPU.

Two evaluations of one float sum in different orders (another micro-batch split, another
number of ranks, another SIMD width or thread count) differ by at most about
`n · eps · Σ|terms|` (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2).
AdamW then divides each gradient element by its own root-mean-square, so a weight
inherits that difference scaled by `lr / (sqrt(v) + eps)`: `AdamBound` tracks it per
element from the optimizer's own second moments.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps


def reduction_terms(tokens: int, width: int) -> int:
    """Terms summed into one gradient element of a linear layer: every token of the batch,
    each a product contracted over the layer's width."""
    return tokens * width


def sum_tolerance(magnitude: float, terms: int, eps: float = EPS32) -> float:
    """How far two orders of a sum of `terms` terms whose magnitude is `magnitude` may differ."""
    return terms * eps * abs(magnitude)


class AdamBound:
    """Per-element bound on how far AdamW weights may drift apart when the gradients that
    step them agree only to `terms · eps` relative to their largest element.

    Call `observe(v, terms)` with the reference run's second moments after each of its
    steps; `bound` is then, per element, the sum over steps of
    `2 · lr · terms · eps · max|g_k| / (sqrt(v̂_k) + adam_eps)`, with `max|g_k|` over the
    element's tensor (the scale of its gradient sums; the first moment and the root of the
    second each move by at most the gradient's own difference). Elements
    that never had a gradient are exactly equal in both runs, and their bound is 0.
    """

    def __init__(self, *, lr: float, beta2: float = 0.999, adam_eps: float = 1e-8) -> None:
        self.lr, self.beta2, self.adam_eps = lr, beta2, adam_eps
        self.previous: list[torch.Tensor] | None = None
        self.steps = 0
        self.bound: list[torch.Tensor] = []

    def observe(self, moments: list[torch.Tensor], terms: int) -> None:
        moments = [v.detach().clone() for v in moments]
        previous = self.previous or [torch.zeros_like(v) for v in moments]
        self.bound = self.bound or [torch.zeros_like(v) for v in moments]
        self.steps += 1
        # v_k = beta2 v_{k-1} + (1 - beta2) g_k², so the step's gradient is read back from v.
        squares = [((v - self.beta2 * p) / (1 - self.beta2)).clamp_min(0) for v, p in zip(moments, previous)]
        for total, v, square in zip(self.bound, moments, squares):
            largest = float(square.max()) ** 0.5  # the scale of this tensor's gradient sums
            rms = (v / (1 - self.beta2 ** self.steps)).sqrt()
            drift = 2 * self.lr * terms * EPS32 * largest / (rms + self.adam_eps)
            total += torch.where(v > 0, drift, torch.zeros_like(drift))
        self.previous = moments

    def median(self) -> float:
        """The median bound over the elements that had a gradient: what a wrong update
        (each moves by about lr a step) must stand out against."""
        live = torch.cat([b[b > 0] for b in self.bound])
        return float(live.median())


def within(a: list[torch.Tensor], b: list[torch.Tensor], bound: list[torch.Tensor]) -> float:
    """The largest |a - b| / bound over every element (≤ 1: within the bound; 0/0 counts 0)."""
    worst = 0.0
    for x, y, t in zip(a, b, bound):
        diff = (x - y).abs()
        ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / t)
        worst = max(worst, float(ratio.max()))
    return worst
