"""GRPO advantages and the per-token PPO-clip policy loss of the train actors.

Pure tensor math, no model and no Ray, so every number can be checked by hand:

    adv_N = grpo_advantages(rewards_N, group_sizes=[4, 4, 2])
    out = policy_loss(logprobs_BT, old_logprobs_BT, adv_B, mask_BT, config=LossConfig())
    out.loss_B.sum().backward()

Shape suffixes: N samples of a whole batch, B samples of a micro-batch, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from miles.utils.arguments import MilesConfig

GRPO_STD_EPS = 1e-6


def grpo_advantages(rewards_N: Tensor, group_sizes: list[int]) -> Tensor:
    """Rewards centred per prompt group and divided by (std + 1e-6).

    The division happens only when the group has more than one sample and a nonzero
    (unbiased, as `Tensor.std`) standard deviation; a one-sample group gets 0 and a
    group of equal rewards gets 0 too. Group sizes may differ (one per adapter).
    """
    if sum(group_sizes) != rewards_N.numel():
        raise ValueError(
            f"group sizes sum to {sum(group_sizes)} but there are {rewards_N.numel()} rewards: "
            "pass the size of every consecutive prompt group"
        )
    if any(size <= 0 for size in group_sizes):
        raise ValueError(f"every prompt group needs at least one sample, got sizes {group_sizes}")
    rewards_N = rewards_N.to(torch.float32)
    out = []
    for group in torch.split(rewards_N, group_sizes):
        centred = group - group.mean()
        if group.numel() > 1:
            std = group.std()
            if std > 0:
                centred = centred / (std + GRPO_STD_EPS)
        out.append(centred)
    return torch.cat(out)


@dataclass(frozen=True)
class LossConfig:
    """The loss flags a train actor needs."""

    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    use_tis: bool = False
    tis_clip: float = 2.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.eps_clip < 0 or self.eps_clip_high < 0:
            raise ValueError("--eps-clip and --eps-clip-high must be >= 0")
        if self.use_tis and self.tis_clip <= 0:
            raise ValueError("--tis-clip must be > 0 with --use-tis")
        if self.kl_coef < 0:
            raise ValueError("--kl-coef must be >= 0")

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> LossConfig:
        return cls(
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high if cfg.eps_clip_high is not None else cfg.eps_clip,
            use_tis=cfg.use_tis,
            tis_clip=cfg.tis_clip,
            kl_coef=cfg.kl_coef,
        )


@dataclass
class PolicyLossOutput:
    """Per-sample results; the micro-batch loss is `loss_B.sum()` (weight 1 per sample)."""

    loss_B: Tensor
    """Token mean of the per-token loss over each sample's response tokens."""
    clipped_tokens_B: Tensor
    """Response tokens whose clipped term was the active one (detached)."""
    kl_B: Tensor
    """Token mean of the k3 KL estimate to the reference (zeros without a reference)."""
    tis_B: Tensor
    """Token mean of the TIS weight (ones without TIS)."""
    tokens_B: Tensor
    """Response tokens per sample."""


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Low-variance estimate of KL(policy || reference) per token: e^d - d - 1, d = ref - logp."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    *,
    config: LossConfig,
    rollout_logprobs_BT: Tensor | None = None,
    ref_logprobs_BT: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO-clip loss per sample, with optional TIS weight and KL-to-reference term.

    Per token: `max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))` with
    `r = exp(logp - old_logp)`; times `min(exp(old_logp - rollout_logp), tis_clip)`
    (detached) with TIS; plus `kl_coef * k3(logp, ref_logp)` with a reference.
    `mask_BT` is 1 on response tokens. A sample without response tokens gets loss 0.
    """
    mask = mask_BT.to(logprobs_BT.dtype)
    tokens_B = mask.sum(dim=1)
    adv_BT = advantages_B.to(logprobs_BT.dtype).unsqueeze(1)
    ratio = torch.exp(logprobs_BT - old_logprobs_BT)
    unclipped = -adv_BT * ratio
    clipped = -adv_BT * torch.clamp(ratio, 1 - config.eps_clip, 1 + config.eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clipped_tokens_B = ((clipped > unclipped).to(mask.dtype) * mask).sum(dim=1).detach()

    tis_BT = torch.ones_like(per_token)
    if config.use_tis:
        if rollout_logprobs_BT is None:
            raise ValueError("use_tis needs the engine's rollout logprobs of every response token")
        tis_BT = torch.clamp(torch.exp(old_logprobs_BT - rollout_logprobs_BT), max=config.tis_clip).detach()
        per_token = per_token * tis_BT

    kl_BT = torch.zeros_like(per_token)
    if ref_logprobs_BT is not None:
        kl_BT = k3_kl(logprobs_BT, ref_logprobs_BT)
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl_BT

    denom = tokens_B.clamp(min=1)
    return PolicyLossOutput(
        loss_B=(per_token * mask).sum(dim=1) / denom,
        clipped_tokens_B=clipped_tokens_B,
        kl_B=((kl_BT * mask).sum(dim=1) / denom).detach(),
        tis_B=((tis_BT * mask).sum(dim=1) / denom).detach(),
        tokens_B=tokens_B.detach(),
    )
