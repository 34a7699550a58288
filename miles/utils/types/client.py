"""Client-driven work: what a Tinker client asks of its adapter, in our own types.

A client-driven adapter has no dataset and no reward: its client sends datums with a
loss (`forward_backward`), runs without grad (`forward`) and steps the optimizer with
the Adam settings of that call (`optim_step`). The gateway translates the SDK's wire
types into these at the edge; the driver packs them, with the server-driven RL batch,
into one train call; the backend gives back one `DatumOutput` per datum.

    datum = ClientDatum(tokens=[1, 5, 9], inputs={"target_tokens": [5, 9, 2], "weights": [0, 1, 1]})
    work = ClientWork(adapter="sft-1", slot=3, datums=[datum], loss=ClientLoss("cross_entropy"))
    result = await backend.train(rollout_id, batch, client=[work])   # result.client[0][0].outputs["logprobs"]
    await backend.step_adapters(["sft-1"], adam={"sft-1": AdamStep(learning_rate=1e-4)})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ClientLossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
"""The built-in losses of the Tinker protocol that the backend computes."""

CLIENT_LOSSES: tuple[ClientLossName, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")


@dataclass(frozen=True)
class ClientLoss:
    """A built-in loss and its `loss_fn_config` (clip thresholds, beta, ...)."""

    name: ClientLossName
    config: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientDatum:
    """One datum: its input tokens and its per-position loss inputs.

    `inputs` holds, by the SDK's names, one value per input position: `target_tokens`
    (ints: the token whose logprob position i scores), and by loss `weights`,
    `logprobs` (the sampler's), `advantages`, the per-position clip thresholds
    (`clip_low_threshold`, `clip_high_threshold`) or GSPO's `sequence_ratio_mask`
    (`miles.backends.common.client_loss` checks them and says which field is wrong).
    """

    tokens: list[int]
    inputs: dict[str, list[float] | list[int]]


@dataclass(frozen=True)
class ClientWork:
    """One client call's datums for one adapter, as a part of a train call."""

    adapter: str
    slot: int
    datums: list[ClientDatum]
    loss: ClientLoss | None
    """None: only the forward outputs (logprobs), whatever inputs the datums carry."""
    backward: bool = True
    """False for `forward`: no gradient, no change to the slot."""


@dataclass(frozen=True)
class DatumOutput:
    """What one datum gave: `loss_fn_outputs` by the SDK's names (`logprobs`, and with
    cross_entropy `elementwise_loss`, the outputs Tinker's docs define), one value per
    input position."""

    outputs: dict[str, list[float]]
    loss: float = 0.0
    """The datum's summed loss (0 without one)."""


@dataclass(frozen=True)
class AdamStep:
    """The Adam settings of one `optim_step` (Tinker's `AdamParams`)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """0: no clipping."""
