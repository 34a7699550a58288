"""The Tinker protocol's built-in losses, per datum, over a padded [B, T] block of client rows.

A client datum (`ClientDatum`) scores one target token per input position (position i of
its tokens scores `target_tokens[i]`, whatever it is). Every loss is a token *sum* over
the datum's positions (no mean, no batch normalisation: Tinker's convention), with
`lp` the trainer's logprob of the target, `q` the sampler's (`logprobs`), `A` the
`advantages` and `lo`/`hi` the clip thresholds:

    cross_entropy        -w lp                                  (`weights`, default 1)
    importance_sampling  -exp(lp - q) A
    ppo                  -min(r A, clip(r, lo, hi) A),           r = exp(lp - q)
    cispo                -sg(clip(r, lo, hi)) lp A
    dro                  -(lp A - beta/2 (lp - q)^2)
    gspo                 ppo with every token's ratio sg(s) exp(lp - sg(lp)), where
                         log s is the mean of sg(lp) - q over the sequence-ratio tokens

Thresholds come from `loss_fn_config` (`clip_low_threshold`, `clip_high_threshold`:
default 0.8 and 1.2, Tinker's eps 0.2; `beta`: default 0.05), and per position from the
datum's inputs of the same names, which win. GSPO's sequence-ratio tokens are those
`sequence_ratio_mask` marks; without one, those with a nonzero advantage (the sampled
tokens that carry loss).

    rows = client_rows(works, vocab_size=model.vocab_size)     # validated, ValueError naming the field
    inputs = ClientInputs.collate(rows, length=L)               # padded [C, L]
    out = client_loss_terms(logprobs_CL, inputs)                # loss_C, elementwise_CL

Shape suffixes: C client rows, L positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.utils.types.client import CLIENT_LOSSES, ClientDatum, ClientLossName, ClientWork, DatumOutput

LOSS_INDEX: dict[str, int] = {name: i for i, name in enumerate(CLIENT_LOSSES)}
NO_LOSS = -1
"""The loss index of a row whose work has no loss (`forward` for its logprobs only)."""

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.05

CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
    "cispo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
    "dro": frozenset({"beta"}),
    "gspo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
}
"""The `loss_fn_config` keys each loss reads; any other key is an error (a typo must not train with defaults)."""

INPUT_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset({"weights"}),
    "importance_sampling": frozenset({"logprobs", "advantages"}),
    "ppo": frozenset({"logprobs", "advantages", "clip_low_threshold", "clip_high_threshold"}),
    "cispo": frozenset({"logprobs", "advantages", "clip_low_threshold", "clip_high_threshold"}),
    "dro": frozenset({"logprobs", "advantages"}),
    "gspo": frozenset({"logprobs", "advantages", "clip_low_threshold", "clip_high_threshold",
                       "sequence_ratio_mask"}),
}
"""The per-position inputs each loss reads besides `target_tokens`."""
KNOWN_INPUTS = frozenset({"target_tokens"}).union(*INPUT_KEYS.values())

REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
}


@dataclass(frozen=True)
class ClientRow:
    """One validated client datum: a row of a train micro-batch."""

    work: int
    """Index of its `ClientWork` in the train call."""
    datum: int
    """Index of the datum in that work."""
    adapter: str
    slot: int
    tokens: list[int]
    targets: list[int]
    loss: int
    """`LOSS_INDEX` of its loss, or `NO_LOSS`."""
    weights: list[float]
    sampling_logprobs: list[float]
    advantages: list[float]
    clip_low: list[float]
    clip_high: list[float]
    ratio_mask: list[float]
    beta: float
    backward: bool

    @property
    def length(self) -> int:
        return len(self.tokens)


def client_rows(works: Sequence[ClientWork], vocab_size: int | None = None) -> list[ClientRow]:
    """Every datum of `works` as a validated row; ValueError naming the work, datum and field
    of the first bad one (`vocab_size`: tokens must be in 0..vocab_size-1)."""
    rows = []
    for w, work in enumerate(works):
        if work.loss is not None and work.loss.name not in LOSS_INDEX:
            raise ValueError(f"client work {w} of adapter '{work.adapter}': unknown loss {work.loss.name!r}; "
                             f"the built-in losses are {list(CLIENT_LOSSES)}")
        if work.backward and work.loss is None:
            raise ValueError(f"client work {w} of adapter '{work.adapter}' asks for a backward without a loss: "
                             "give it a loss, or set backward=False for a forward")
        if work.loss is not None:
            unknown = sorted(set(work.loss.config) - CONFIG_KEYS[work.loss.name])
            if unknown:
                raise ValueError(f"client work {w} of adapter '{work.adapter}': loss_fn_config keys {unknown} are "
                                 f"not read by loss {work.loss.name!r} (it reads "
                                 f"{sorted(CONFIG_KEYS[work.loss.name]) or 'none'})")
        for d, datum in enumerate(work.datums):
            rows.append(_row(w, d, work, datum, vocab_size))
    return rows


def _row(w: int, d: int, work: ClientWork, datum: ClientDatum, vocab_size: int | None) -> ClientRow:
    where = f"client work {w} of adapter '{work.adapter}', datum {d}"
    n = len(datum.tokens)
    if n == 0:
        raise ValueError(f"{where}: tokens is empty")
    _check_tokens(datum.tokens, vocab_size, f"{where}: tokens")
    if "target_tokens" not in datum.inputs:
        raise ValueError(f"{where}: inputs lack 'target_tokens' (the token each position scores)")
    loss: ClientLossName | None = None if work.loss is None else work.loss.name
    # Inputs of another loss are ignored (a client may score its RL datums with
    # cross_entropy); a name no loss reads is a typo, and an error.
    unknown = sorted(set(datum.inputs) - KNOWN_INPUTS)
    if unknown:
        raise ValueError(f"{where}: inputs {unknown} are read by no loss (known: {sorted(KNOWN_INPUTS)})")
    for key, given in datum.inputs.items():
        if len(given) != n:
            raise ValueError(f"{where}: '{key}' has {len(given)} values for {n} tokens (one per position)")
    for key in REQUIRED_INPUTS[loss] if loss is not None else ():
        if key not in datum.inputs:
            raise ValueError(f"{where}: loss {loss!r} needs the input '{key}'")
    targets = [int(t) for t in datum.inputs["target_tokens"]]
    if any(t != v for t, v in zip(targets, datum.inputs["target_tokens"])):
        raise ValueError(f"{where}: 'target_tokens' must be integers")
    _check_tokens(targets, vocab_size, f"{where}: target_tokens")
    config = work.loss.config if work.loss is not None else {}

    def values(key: str, default: float) -> list[float]:
        got = datum.inputs.get(key)
        out = [float(default)] * n if got is None else [float(v) for v in got]
        if not all(math.isfinite(v) for v in out):
            raise ValueError(f"{where}: '{key}' holds a value that is not finite")
        return out

    advantages = values("advantages", 0.0)
    ratio_mask = values("sequence_ratio_mask", 0.0) if "sequence_ratio_mask" in datum.inputs \
        else [1.0 if a != 0 else 0.0 for a in advantages]
    return ClientRow(
        work=w, datum=d, adapter=work.adapter, slot=work.slot, tokens=list(datum.tokens), targets=targets,
        loss=NO_LOSS if loss is None else LOSS_INDEX[loss], weights=values("weights", 1.0),
        sampling_logprobs=values("logprobs", 0.0), advantages=advantages,
        clip_low=values("clip_low_threshold", config.get("clip_low_threshold", DEFAULT_CLIP_LOW)),
        clip_high=values("clip_high_threshold", config.get("clip_high_threshold", DEFAULT_CLIP_HIGH)),
        ratio_mask=ratio_mask, beta=float(config.get("beta", DEFAULT_DRO_BETA)), backward=work.backward,
    )


def _check_tokens(tokens: Sequence[int], vocab_size: int | None, what: str) -> None:
    if vocab_size is None:
        return
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} holds {bad[:5]}, outside the model's vocabulary 0..{vocab_size - 1}")


@dataclass
class ClientInputs:
    """The loss inputs of C client rows, padded on the right to L positions."""

    targets_CL: Tensor
    mask_CL: Tensor
    """1 on the datum's positions, 0 on padding."""
    loss_C: Tensor
    """Each row's `LOSS_INDEX` (or `NO_LOSS`)."""
    weights_CL: Tensor
    sampling_logprobs_CL: Tensor
    advantages_CL: Tensor
    clip_low_CL: Tensor
    clip_high_CL: Tensor
    ratio_mask_CL: Tensor
    beta_C: Tensor

    @classmethod
    def collate(cls, rows: Sequence[ClientRow], length: int) -> ClientInputs:
        def pad(field: str, dtype: torch.dtype) -> Tensor:
            out = torch.zeros((len(rows), length), dtype=dtype)
            for c, row in enumerate(rows):
                values = getattr(row, field)
                out[c, : len(values)] = torch.tensor(values, dtype=dtype)
            return out

        mask = torch.zeros((len(rows), length), dtype=torch.float32)
        for c, row in enumerate(rows):
            mask[c, : row.length] = 1.0
        return cls(
            targets_CL=pad("targets", torch.long), mask_CL=mask,
            loss_C=torch.tensor([r.loss for r in rows], dtype=torch.long),
            weights_CL=pad("weights", torch.float32), sampling_logprobs_CL=pad("sampling_logprobs", torch.float32),
            advantages_CL=pad("advantages", torch.float32), clip_low_CL=pad("clip_low", torch.float32),
            clip_high_CL=pad("clip_high", torch.float32), ratio_mask_CL=pad("ratio_mask", torch.float32),
            beta_C=torch.tensor([r.beta for r in rows], dtype=torch.float32),
        )

    def to(self, device: torch.device | str) -> ClientInputs:
        return ClientInputs(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


@dataclass
class ClientLossTerms:
    loss_C: Tensor
    """Each row's summed loss (0 for a row without a loss)."""
    elementwise_CL: Tensor
    """Each position's loss term (0 on padding)."""


def client_loss_terms(logprobs_CL: Tensor, inputs: ClientInputs) -> ClientLossTerms:
    """Each row's loss (its own kind and settings) from the trainer's logprobs of its targets."""
    lp = logprobs_CL.float()
    q, adv, mask = inputs.sampling_logprobs_CL, inputs.advantages_CL, inputs.mask_CL.bool()
    lo, hi = inputs.clip_low_CL, inputs.clip_high_CL
    elementwise = torch.zeros_like(lp)
    for name, index in LOSS_INDEX.items():
        rows = (inputs.loss_C == index).nonzero().flatten()
        if rows.numel() == 0:
            continue
        sub = _LOSSES[name](lp[rows], q[rows], adv[rows], lo[rows], hi[rows], inputs, rows)
        elementwise = elementwise.index_put((rows,), sub)
    elementwise = torch.where(mask, elementwise, torch.zeros_like(elementwise))
    return ClientLossTerms(loss_C=elementwise.sum(dim=-1), elementwise_CL=elementwise)


def _cross_entropy(lp, q, adv, lo, hi, inputs: ClientInputs, rows: Tensor) -> Tensor:
    return -lp * inputs.weights_CL[rows]


def _importance_sampling(lp, q, adv, lo, hi, inputs: ClientInputs, rows: Tensor) -> Tensor:
    return -torch.exp(lp - q) * adv


def _ppo(lp, q, adv, lo, hi, inputs: ClientInputs, rows: Tensor) -> Tensor:
    return _clipped_objective(torch.exp(lp - q), adv, lo, hi)


def _cispo(lp, q, adv, lo, hi, inputs: ClientInputs, rows: Tensor) -> Tensor:
    weight = torch.minimum(torch.maximum(torch.exp(lp - q), lo), hi).detach()
    return -weight * lp * adv


def _dro(lp, q, adv, lo, hi, inputs: ClientInputs, rows: Tensor) -> Tensor:
    beta = inputs.beta_C[rows].unsqueeze(-1)
    return -(lp * adv - 0.5 * beta * (lp - q).square())


def _gspo(lp, q, adv, lo, hi, inputs: ClientInputs, rows: Tensor) -> Tensor:
    in_ratio = inputs.ratio_mask_CL[rows] * inputs.mask_CL[rows]
    count = in_ratio.sum(dim=-1, keepdim=True)
    log_s = ((lp.detach() - q) * in_ratio).sum(dim=-1, keepdim=True) / count.clamp(min=1.0)
    ratio = torch.exp(log_s + lp - lp.detach())  # the sequence ratio's value, the token's own gradient
    return _clipped_objective(ratio, adv, lo, hi)


def _clipped_objective(ratio: Tensor, adv: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    clipped = torch.minimum(torch.maximum(ratio, lo), hi)
    return -torch.minimum(ratio * adv, clipped * adv)


_LOSSES = {
    "cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling, "ppo": _ppo, "cispo": _cispo,
    "dro": _dro, "gspo": _gspo,
}


def datum_outputs(rows: Sequence[ClientRow], logprobs_CL: Tensor, terms: ClientLossTerms | None) -> list[DatumOutput]:
    """Each row's `DatumOutput`: `logprobs` of its targets, and with cross_entropy its
    `elementwise_loss` (the outputs Tinker's docs define), one per position."""
    logprobs = logprobs_CL.detach().float().cpu()
    elementwise = None if terms is None else terms.elementwise_CL.detach().cpu()
    losses = [0.0] * len(rows) if terms is None else terms.loss_C.detach().cpu().tolist()
    out = []
    for c, row in enumerate(rows):
        outputs = {"logprobs": logprobs[c, : row.length].tolist()}
        if elementwise is not None and row.loss == LOSS_INDEX["cross_entropy"]:
            outputs["elementwise_loss"] = elementwise[c, : row.length].tolist()
        out.append(DatumOutput(outputs=outputs, loss=float(losses[c]) if row.loss != NO_LOSS else 0.0))
    return out
