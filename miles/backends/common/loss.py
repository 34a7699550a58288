"""Advantages and policy losses of the train ranks: pure tensor math, no model, no Ray.

`LossSettings` (Miles' flag names and defaults, one per adapter), `compute_advantages`
and `policy_loss_terms` implement Miles' estimators (grpo, gspo, reinforce_plus_plus,
reinforce_plus_plus_baseline), KL estimators (k1, k2, k3, low_var_kl), dual-clip PPO,
TIS with a lower bound or a custom TIS function, and the entropy bonus, with every
setting gathered per sample so adapters with different settings share a batch:

    adv_NT = compute_advantages(settings, rewards_N, mask_NT, group_sizes=[4, 4])
    params = LossParams.gather(settings_by_slot, slot_B)
    terms = policy_loss_terms(logprobs_BT, old_logprobs_BT, adv_BT, mask_BT, params)
    terms.loss_B.sum().backward()

Shape suffixes: N samples of a whole batch, B samples of a micro-batch, T tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles.utils.loss_settings import KL_LOSS_TYPES, LossSettings
from miles.utils.plugins import PluginError, load_object
from miles.utils.types import Sample

GRPO_STD_EPS = 1e-6


def grpo_advantages(rewards_N: Tensor, group_sizes: list[int]) -> Tensor:
    """Rewards centred per prompt group and divided by (std + 1e-6).

    The division happens only when the group has more than one sample and a nonzero
    (unbiased, as `Tensor.std`) standard deviation; a one-sample group gets 0 and a
    group of equal rewards gets 0 too. Group sizes may differ (one per adapter).
    """
    return normalize_group_rewards(rewards_N, group_sizes, divide_by_std=True)


# ---------------------------------------------------------------------------
# Miles' loss and advantage settings, per adapter.
#
# The functions below follow Miles' `loss_hub` semantics (advantage estimators, KL
# estimators, dual-clip PPO, TIS, entropy bonus) on padded [B, T] tensors. Every
# setting is a per-sample tensor gathered from the sample's adapter, so adapters with
# different settings train in one mixed batch and each sample's loss is exactly the
# loss it would get in a batch of its adapter alone.
# ---------------------------------------------------------------------------

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound before `exp` in the PPO ratio and in `low_var_kl` (as Miles)."""
LOW_VAR_KL_CLAMP = 10.0
"""`low_var_kl` is clamped to [-10, 10] per token (as Miles); the other estimators are not."""
WHITEN_EPS = 1e-8


# --- KL estimators ----------------------------------------------------------


def safe_log_ratio(log_ratio: Tensor) -> Tensor:
    """NaN -> 0, then clamp to [-20, 20] (the bound Miles applies before `exp`)."""
    log_ratio = torch.nan_to_num(log_ratio.float(), nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _kl_estimate(kl_type: str, log_ratio: Tensor) -> Tensor:
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio**2 / 2.0
    neg = -log_ratio
    if kl_type == "low_var_kl":
        neg = safe_log_ratio(neg)
    return torch.exp(neg) - 1 - neg


def approx_kl(
    logprobs: Tensor, ref_logprobs: Tensor, kl_type: str, importance_ratio: Tensor | None = None
) -> Tensor:
    """Schulman's per-token estimators of KL(policy || reference), d = logp - ref_logp.

    k1: d; k2: d^2 / 2; k3 and low_var_kl: e^-d + d - 1 (low_var_kl clamps -d to
    [-20, 20] first and the result to [-10, 10]; the others are not clamped). With
    `importance_ratio` (`--use-unbiased-kl`) the estimate is multiplied by it first.
    """
    if kl_type not in KL_LOSS_TYPES:
        raise ValueError(f"unknown KL estimator {kl_type!r}; choose one of {', '.join(KL_LOSS_TYPES)}")
    kl = _kl_estimate(kl_type, logprobs.float() - ref_logprobs.float())
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_type == "low_var_kl":
        kl = kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return kl


def approx_kl_per_sample(
    logprobs_BT: Tensor, ref_logprobs_BT: Tensor, kl_type_B: Tensor, importance_ratio_BT: Tensor | None = None
) -> Tensor:
    """`approx_kl` with the estimator chosen per sample (`kl_type_B` indexes KL_LOSS_TYPES).

    Each estimator runs only on its own rows, so an overflow in an estimator a sample
    does not use cannot reach that sample's gradient.
    """
    kl = torch.zeros(logprobs_BT.shape, dtype=torch.float32, device=logprobs_BT.device)
    kinds = kl_type_B.to(logprobs_BT.device)
    for code in sorted(set(kinds.tolist())):
        rows = (kinds == code).nonzero().squeeze(1)
        ratio = None if importance_ratio_BT is None else importance_ratio_BT[rows]
        kl = kl.index_put((rows,), approx_kl(logprobs_BT[rows], ref_logprobs_BT[rows], KL_LOSS_TYPES[code], ratio))
    return kl


# --- Advantages -------------------------------------------------------------


def normalize_group_rewards(
    rewards_N: Tensor, group_sizes: Sequence[int], *, divide_by_std: bool, eps: float = GRPO_STD_EPS
) -> Tensor:
    """Rewards centred per prompt group; divided by (unbiased std + eps) when asked, the
    group has more than one sample and its std is nonzero (Miles' reward post-processing)."""
    if sum(group_sizes) != rewards_N.numel():
        raise ValueError(
            f"group sizes sum to {sum(group_sizes)} but there are {rewards_N.numel()} rewards: "
            "pass the size of every consecutive prompt group"
        )
    if any(size <= 0 for size in group_sizes):
        raise ValueError(f"every prompt group needs at least one sample, got sizes {list(group_sizes)}")
    out = []
    for group in torch.split(rewards_N.to(torch.float32), list(group_sizes)):
        centred = group - group.mean()
        if divide_by_std and group.numel() > 1:
            std = group.std()
            if std > 0:
                centred = centred / (std + eps)
        out.append(centred)
    return torch.cat(out)


def masked_whiten(values_NT: Tensor, mask_NT: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var over the masked tokens.

    Every position is shifted and scaled (masked ones too; the loss masks them out), as
    Miles' `--normalize-advantages`.
    """
    mask = mask_NT.to(torch.float32)
    count = mask.sum()
    if count == 0:
        raise ValueError("cannot normalize advantages: no response tokens in the batch")
    values = values_NT.to(torch.float32)
    mean = (values * mask).sum() / count
    var = (values**2 * mask).sum() / count - mean**2
    if count >= 2:
        var = var * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + eps)


def discounted_returns(token_rewards_NT: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} along the last dimension (G after the end is 0)."""
    returns = torch.zeros_like(token_rewards_NT)
    running = torch.zeros_like(token_rewards_NT[..., 0])
    for t in range(token_rewards_NT.shape[-1] - 1, -1, -1):
        running = token_rewards_NT[..., t] + gamma * running
        returns[..., t] = running
    return returns


def compute_advantages(
    settings: LossSettings,
    rewards_N: Tensor,
    mask_NT: Tensor,
    *,
    group_sizes: Sequence[int],
    kl_NT: Tensor | None = None,
) -> Tensor:
    """Per-token advantages [N, T] of one adapter's samples, as Miles computes them.

    - grpo / gspo: the group-normalized reward on every token (centred per prompt group,
      divided by std + 1e-6 unless `grpo_std_normalization` is off; no centring with
      `rewards_normalization` off). The KL is not part of the advantage.
    - reinforce_plus_plus: token rewards `-kl_coef * kl`, plus the raw reward at the last
      response token, discounted with `gamma` over the response.
    - reinforce_plus_plus_baseline: the group-centred reward (no std) `- kl_coef * kl` per token.
    Then `normalize_advantages` whitens over the masked tokens of these samples.

    `kl_NT` is the per-token KL estimate to the reference (`approx_kl` of the old logprobs,
    with `kl_loss_type`); it is only read when `kl_coef != 0`. `mask_NT` is 1 on the
    response tokens. Rows of padding beyond a response are 0 before whitening.
    """
    estimator = settings.advantage_estimator
    if rewards_N.dim() != 1 or rewards_N.shape[0] != mask_NT.shape[0]:
        raise ValueError(f"rewards {tuple(rewards_N.shape)} and mask {tuple(mask_NT.shape)} must agree on N")
    mask = mask_NT.to(torch.float32)
    if settings.kl_coef != 0 and estimator.startswith("reinforce_plus_plus"):
        if kl_NT is None:
            raise ValueError("--kl-coef shapes the reward with the KL to the base model: pass kl_NT")
        kl = kl_NT.to(torch.float32) * mask
    else:
        kl = torch.zeros_like(mask)

    rewards = rewards_N.to(torch.float32)
    normalizes = estimator in ("grpo", "gspo", "reinforce_plus_plus_baseline") and settings.rewards_normalization
    if normalizes:
        divide = estimator in ("grpo", "gspo") and settings.grpo_std_normalization
        rewards = normalize_group_rewards(rewards, group_sizes, divide_by_std=divide)

    if estimator in ("grpo", "gspo"):
        advantages = rewards.unsqueeze(1) * mask
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = (rewards.unsqueeze(1) - settings.kl_coef * kl) * mask
    else:  # reinforce_plus_plus
        if bool((mask.sum(dim=1) == 0).any()):
            raise ValueError("reinforce_plus_plus needs at least one response token per sample")
        token_rewards = -settings.kl_coef * kl
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
        token_rewards = token_rewards.clone()
        token_rewards[torch.arange(mask.shape[0]), last] += rewards
        # Miles discounts over the whole response; tokens after the last response token
        # hold zero reward here, so they do not change the returns before it.
        advantages = discounted_returns(token_rewards, settings.gamma) * mask

    if settings.normalize_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages


# --- Policy loss with per-sample settings -------------------------------------


SAMPLE_LEVEL_ESTIMATORS = ("grpo", "gspo")
"""Estimators whose advantage is the same on every response token of a sample."""


def adapter_token_advantages(
    rewards_N: Tensor,
    group_sizes: Sequence[int],
    group_adapters: Sequence[str],
    response_masks: Sequence[Sequence[int]],
    settings: dict[str, LossSettings],
    reward_kl: Sequence[Sequence[float] | None] | None = None,
) -> list[float | list[float]]:
    """Each sample's advantages in a mixed batch, each adapter's from its own samples and
    settings alone (`compute_advantages`), so they do not depend on the other adapters.

    A sample of an estimator in SAMPLE_LEVEL_ESTIMATORS gets one float (its value on every
    response token); a reinforce++ sample gets a list, one value per response token.
    `response_masks[i]` is 1 on the response tokens of sample i that carry loss: they
    weight `--normalize-advantages`, which whitens over all of the adapter's samples in
    the batch (every data-parallel rank's share: the batch is whole here).
    `reward_kl[i]` is sample i's per-response-token KL to the base model, needed for the
    samples of adapters whose reinforce++ reward is shaped by `--kl-coef` (`needs_reward_kl`).
    """
    if len(group_sizes) != len(group_adapters):
        raise ValueError(f"{len(group_sizes)} group sizes but {len(group_adapters)} group adapters")
    starts = [sum(group_sizes[:g]) for g in range(len(group_sizes))]
    out: list[float | list[float]] = [0.0] * rewards_N.shape[0]
    for adapter in dict.fromkeys(group_adapters):
        setting = settings[adapter]
        groups = [g for g, name in enumerate(group_adapters) if name == adapter]
        rows = [i for g in groups for i in range(starts[g], starts[g] + group_sizes[g])]
        width = max([len(response_masks[i]) for i in rows] + [1])
        mask = torch.zeros(len(rows), width)
        for r, i in enumerate(rows):
            mask[r, : len(response_masks[i])] = torch.as_tensor(list(response_masks[i]), dtype=torch.float32)
        kl = None
        if needs_reward_kl(setting):
            known = [] if reward_kl is None else [values for i in rows if (values := reward_kl[i]) is not None]
            if len(known) != len(rows):
                raise ValueError(f"adapter '{adapter}': --kl-coef {setting.kl_coef} shapes the "
                                 f"{setting.advantage_estimator} reward with the KL to the base model: pass reward_kl")
            kl = torch.zeros(len(rows), width)
            for r, values in enumerate(known):
                kl[r, : len(values)] = torch.as_tensor(list(values), dtype=torch.float32)
        adv_NT = compute_advantages(setting, rewards_N[rows], mask, group_sizes=[group_sizes[g] for g in groups],
                                    kl_NT=kl)
        if setting.advantage_estimator in SAMPLE_LEVEL_ESTIMATORS:
            tokens = mask.sum(dim=1)
            per_sample = torch.where(tokens > 0, (adv_NT * mask).sum(dim=1) / tokens.clamp(min=1),
                                     torch.zeros_like(tokens))
            for r, i in enumerate(rows):
                out[i] = float(per_sample[r])
        else:
            for r, i in enumerate(rows):
                out[i] = adv_NT[r, : len(response_masks[i])].tolist()
    return out


def batch_advantages(
    samples: Sequence[Sample],
    group_sizes: Sequence[int],
    settings: Mapping[str, LossSettings],
    reward_kl: Sequence[Sequence[float] | None] | None = None,
) -> list[float | list[float]]:
    """`adapter_token_advantages` of whole prompt groups of samples (consecutive, `group_sizes`
    long), each adapter with `settings[adapter]`: what the train group hands its ranks. A
    sample's loss mask (all ones when None) weights `--normalize-advantages`."""
    starts = [sum(group_sizes[:g]) for g in range(len(group_sizes))]
    group_adapters = [samples[start].adapter for start in starts]
    masks = [s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids) for s in samples]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return adapter_token_advantages(rewards, group_sizes, group_adapters, masks, dict(settings), reward_kl)


def needs_reward_kl(settings: LossSettings) -> bool:
    """Whether the adapter's advantages need the per-token KL to the base model (reinforce++ with `--kl-coef`)."""
    return settings.kl_coef != 0 and settings.advantage_estimator.startswith("reinforce_plus_plus")


@dataclass(frozen=True)
class LossParams:
    """Per-sample loss settings of a mixed batch: [B] tensors gathered by adapter."""

    eps_clip_B: Tensor
    eps_clip_high_B: Tensor
    eps_clip_c_B: Tensor
    """Dual-clip bound; NaN where dual clip is off."""
    gspo_B: Tensor
    """True where the ratio is the sequence-level GSPO ratio."""
    use_tis_B: Tensor
    tis_clip_B: Tensor
    tis_clip_low_B: Tensor
    use_rollout_logprobs_B: Tensor
    use_kl_loss_B: Tensor
    kl_loss_coef_B: Tensor
    kl_type_B: Tensor
    """Index into KL_LOSS_TYPES."""
    use_unbiased_kl_B: Tensor
    entropy_coef_B: Tensor
    custom_tis_paths: tuple[str | None, ...]
    """Per sample: the custom TIS function path (None for the built-in TIS)."""

    @classmethod
    def gather(cls, settings: Sequence[LossSettings], index_B: Sequence[int] | Tensor) -> LossParams:
        """Settings per sample: `settings[index_B[i]]` for sample i (e.g. indexed by slot)."""
        idx = torch.as_tensor(index_B, dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(settings)):
            raise ValueError(f"sample settings index out of range: {idx.tolist()} with {len(settings)} settings")

        def col(values, dtype=torch.float32) -> Tensor:
            return torch.tensor(values, dtype=dtype)[idx]

        nan = float("nan")
        return cls(
            eps_clip_B=col([s.eps_clip for s in settings]),
            eps_clip_high_B=col([s.clip_high for s in settings]),
            eps_clip_c_B=col([nan if s.eps_clip_c is None else s.eps_clip_c for s in settings]),
            gspo_B=col([s.advantage_estimator == "gspo" for s in settings], torch.bool),
            use_tis_B=col([s.use_tis for s in settings], torch.bool),
            tis_clip_B=col([s.tis_clip for s in settings]),
            tis_clip_low_B=col([s.tis_clip_low for s in settings]),
            use_rollout_logprobs_B=col([s.use_rollout_logprobs for s in settings], torch.bool),
            use_kl_loss_B=col([s.use_kl_loss for s in settings], torch.bool),
            kl_loss_coef_B=col([s.kl_loss_coef for s in settings]),
            kl_type_B=col([KL_LOSS_TYPES.index(s.kl_loss_type) for s in settings], torch.long),
            use_unbiased_kl_B=col([s.use_unbiased_kl for s in settings], torch.bool),
            entropy_coef_B=col([s.entropy_coef for s in settings]),
            custom_tis_paths=tuple(
                settings[i].custom_tis_function_path if settings[i].use_tis else None for i in idx.tolist()
            ),
        )

    @classmethod
    def uniform(cls, settings: LossSettings, batch_size: int) -> LossParams:
        return cls.gather([settings], [0] * batch_size)

    def to(self, device: torch.device | str) -> LossParams:
        moved: dict[str, Any] = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in self.__dict__.items()}
        return LossParams(**moved)


@dataclass
class PolicyTerms:
    """Per-sample results of `policy_loss_terms`; the micro-batch loss is `loss_B.sum()`.

    Every `_B` value except `loss_B` is detached and is a token mean over the sample's
    response tokens (after any TIS rejection mask), as Miles' `sum_of_sample_mean`.
    """

    loss_B: Tensor
    pg_loss_B: Tensor
    pg_clipfrac_B: Tensor
    ppo_kl_B: Tensor
    entropy_B: Tensor
    kl_loss_B: Tensor
    tis_B: Tensor
    tis_clipfrac_B: Tensor
    ois_B: Tensor
    tokens_B: Tensor


TisFunction = Callable[..., tuple[Tensor, list[Tensor], dict[str, Tensor]]]
"""Miles' custom TIS signature: `fn(args, *, pg_loss, train_log_probs, rollout_log_probs,
loss_masks, **kwargs) -> (pg_loss, loss_masks, metrics)` on tokens packed per sample."""


def load_tis_function(path: str) -> TisFunction:
    """Import `--custom-tis-function-path` (`pkg.module.fn` or `pkg.module:fn`)."""
    fn = load_object(path, kind="--custom-tis-function-path")
    if not callable(fn):
        raise PluginError(f"--custom-tis-function-path {path!r} is not callable (got {type(fn).__name__})")
    return fn


def _pack(x_BT: Tensor, mask_BT: Tensor, rows: list[int]) -> list[Tensor]:
    return [x_BT[i][mask_BT[i]] for i in rows]


def _apply_custom_tis(
    path: str,
    rows: list[int],
    pg_loss_BT: Tensor,
    old_BT: Tensor,
    rollout_BT: Tensor,
    active_BT: Tensor,
    settings_args: Any,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Run a Miles-style TIS function on `rows`; returns its pg loss, mask and metrics in [len(rows), T]."""
    fn = load_tis_function(path)
    lengths = [int(active_BT[i].sum()) for i in rows]
    flat_loss = torch.cat(_pack(pg_loss_BT, active_BT, rows)) if rows else pg_loss_BT.new_zeros(0)
    new_loss, new_masks, metrics = fn(
        settings_args,
        pg_loss=flat_loss,
        train_log_probs=_pack(old_BT, active_BT, rows),
        rollout_log_probs=_pack(rollout_BT, active_BT, rows),
        loss_masks=[torch.ones(n, dtype=pg_loss_BT.dtype, device=pg_loss_BT.device) for n in lengths],
        total_lengths=lengths,
        response_lengths=lengths,
        parallel_state=None,
        max_seq_lens=None,
    )
    sub_active = active_BT[rows]
    loss_out = torch.zeros_like(pg_loss_BT[rows])
    loss_out[sub_active] = new_loss
    mask_out = torch.zeros_like(pg_loss_BT[rows])
    mask_out[sub_active] = torch.cat([m.to(loss_out.dtype) for m in new_masks]) if new_masks else loss_out.new_zeros(0)
    metrics_out = {}
    for key, value in metrics.items():
        full = torch.zeros_like(pg_loss_BT[rows])
        full[sub_active] = value.detach().to(full.dtype)
        metrics_out[key] = full
    return loss_out, mask_out, metrics_out


def policy_loss_terms(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    params: LossParams,
    *,
    rollout_logprobs_BT: Tensor | None = None,
    ref_logprobs_BT: Tensor | None = None,
    entropy_BT: Tensor | None = None,
    tis_args: Any = None,
) -> PolicyTerms:
    """Miles' policy loss per sample, each sample with its own settings (`params`).

    Per token, with `old` the trainer's old logprobs (or the engine's where
    `use_rollout_logprobs`) and `ppo_kl = old - logp` (GSPO: its sequence mean over the
    response tokens, the same on every token):
        r = exp(clamp(-ppo_kl, -20, 20))
        pg = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))
        dual clip (A < 0): pg = min(pg, -eps_clip_c A)
        TIS: pg *= clamp(exp(old - rollout), tis_clip_low, tis_clip)  (detached), or the
             custom TIS function's weights and rejection mask
    and per sample (token means over the response):
        loss = mean(pg) - entropy_coef * mean(entropy) + kl_loss_coef * mean(kl)
    with `kl = approx_kl(logp, ref, kl_loss_type)` (times `exp(logp - old)` for the
    unbiased KL) where `use_kl_loss`. `advantages` is [B] or [B, T]. `tis_args` is
    passed to a custom TIS function as its `args`.
    """
    active = mask_BT.bool()
    mask = active.to(torch.float32)
    B = logprobs_BT.shape[0]
    logp = logprobs_BT.float()
    adv = advantages.to(logp.device).float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand_as(logp)
    adv = _masked(adv, active)

    needs_rollout = bool(params.use_rollout_logprobs_B.any() or params.use_tis_B.any())
    if needs_rollout and rollout_logprobs_BT is None:
        raise ValueError("--use-tis and --use-rollout-logprobs need the engine's logprobs of every response token")
    trainer_old = old_logprobs_BT.detach().float()
    old = trainer_old
    if bool(params.use_rollout_logprobs_B.any()):
        old = torch.where(_col(params.use_rollout_logprobs_B, logp), _engine_logprobs(rollout_logprobs_BT), old)

    ppo_kl = _ppo_kl(old, logp, mask, active, params)
    pg, clipfrac = _clipped_policy_gradient(ppo_kl, adv, params)
    tis = _importance_weights(pg, trainer_old, rollout_logprobs_BT, mask, active, params, tis_args)

    denom = tis.weight_mask.sum(dim=1).clamp(min=1)

    def token_mean(x: Tensor) -> Tensor:
        return (x * tis.weight_mask).sum(dim=1) / denom

    def mean_before_rejection(x: Tensor) -> Tensor:
        # TIS metrics count every response token, rejected ones too (as Miles)
        return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)

    pg_loss_B = token_mean(tis.pg)
    loss_B = pg_loss_B

    entropy_B = torch.zeros(B, device=logp.device)
    if entropy_BT is not None:
        entropy_B = token_mean(entropy_BT.float())
    if bool((params.entropy_coef_B != 0).any()):
        if entropy_BT is None:
            raise ValueError("--entropy-coef needs the per-token entropy of the policy (entropy_BT)")
        loss_B = loss_B - params.entropy_coef_B.to(logp.device) * entropy_B

    kl_loss_B = torch.zeros(B, device=logp.device)
    if bool(params.use_kl_loss_B.any()):
        kl = _kl_to_reference(logp, old, ref_logprobs_BT, active, params)
        kl_loss_B = torch.where(params.use_kl_loss_B.to(logp.device), token_mean(kl), 0.0)
        loss_B = loss_B + params.kl_loss_coef_B.to(logp.device) * kl_loss_B

    return PolicyTerms(
        loss_B=loss_B,
        pg_loss_B=pg_loss_B.detach(),
        pg_clipfrac_B=token_mean(clipfrac).detach(),
        ppo_kl_B=token_mean(ppo_kl).detach(),
        entropy_B=entropy_B.detach(),
        kl_loss_B=kl_loss_B.detach(),
        tis_B=mean_before_rejection(tis.weights).detach(),
        tis_clipfrac_B=mean_before_rejection(tis.clipfrac).detach(),
        ois_B=mean_before_rejection(torch.exp(-ppo_kl).detach()).detach(),
        tokens_B=mask.sum(dim=1),
    )


def _col(t_B: Tensor, like_BT: Tensor) -> Tensor:
    """A per-sample [B] value as a [B, 1] column on `like_BT`'s device."""
    return t_B.to(like_BT.device).view(like_BT.shape[0], 1)


def _masked(x_BT: Tensor, active_BT: Tensor) -> Tensor:
    """Non-finite values and tokens outside the response become 0."""
    return torch.where(active_BT, torch.nan_to_num(x_BT, nan=0.0, posinf=0.0, neginf=0.0), 0.0)


def _ppo_kl(old_BT: Tensor, logp_BT: Tensor, mask_BT: Tensor, active_BT: Tensor, params: LossParams) -> Tensor:
    """`old - logp` per token; for GSPO samples its mean over the response on every token."""
    token_kl = old_BT - logp_BT
    seq_kl = (token_kl * mask_BT).sum(dim=1, keepdim=True) / mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
    ppo_kl = torch.where(_col(params.gspo_B, logp_BT), seq_kl.expand_as(token_kl), token_kl)
    return _masked(ppo_kl, active_BT)


def _clipped_policy_gradient(ppo_kl_BT: Tensor, adv_BT: Tensor, params: LossParams) -> tuple[Tensor, Tensor]:
    """PPO's clipped term with each sample's clip range, and the dual clip where set;
    returns the per-token loss and where the clipped term was the active one."""
    ratio = torch.exp(safe_log_ratio(-ppo_kl_BT))
    loss1 = -ratio * adv_BT
    loss2 = -ratio.clamp(1 - _col(params.eps_clip_B, adv_BT), 1 + _col(params.eps_clip_high_B, adv_BT)) * adv_BT
    pg = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).float()
    dual = _col(~torch.isnan(params.eps_clip_c_B), adv_BT)
    loss3 = -torch.nan_to_num(_col(params.eps_clip_c_B, adv_BT)) * adv_BT
    return torch.where(dual & (adv_BT < 0), torch.minimum(loss3, pg), pg), clipfrac


@dataclass
class _Weighted:
    pg: Tensor
    """Per-token loss after the importance weights."""
    weight_mask: Tensor
    """Tokens in the loss's token means (a custom TIS may reject some)."""
    weights: Tensor
    """Raw TIS weights (ones where no TIS applies), for the metrics."""
    clipfrac: Tensor


def _engine_logprobs(rollout_logprobs_BT: Tensor | None) -> Tensor:
    """The engine's logprobs, detached, as float32 (`policy_loss_terms` checked they were given)."""
    if rollout_logprobs_BT is None:
        raise ValueError("--use-tis and --use-rollout-logprobs need the engine's logprobs of every response token")
    return rollout_logprobs_BT.detach().float()


def _importance_weights(pg_BT: Tensor, trainer_old_BT: Tensor, rollout_logprobs_BT: Tensor | None,
                        mask_BT: Tensor, active_BT: Tensor, params: LossParams, tis_args: Any) -> _Weighted:
    """Built-in TIS (clamped, detached weights) or each sample's custom TIS function."""
    pg, weight_mask = pg_BT, mask_BT
    weights, clipfrac = torch.ones_like(pg_BT), torch.zeros_like(pg_BT)
    no_custom_B = torch.tensor([p is None for p in params.custom_tis_paths], dtype=torch.bool)
    builtin_tis = params.use_tis_B & no_custom_B.to(params.use_tis_B.device)
    if bool(builtin_tis.any()):
        raw = torch.exp(trainer_old_BT - _engine_logprobs(rollout_logprobs_BT))
        clamped = torch.minimum(torch.maximum(raw, _col(params.tis_clip_low_B, pg)), _col(params.tis_clip_B, pg))
        on = _col(builtin_tis, pg)
        pg = torch.where(on, pg * clamped, pg)
        weights = torch.where(on, raw, weights)
        clipfrac = torch.where(on, (clamped != raw).float(), clipfrac)
    for path in sorted({p for p in params.custom_tis_paths if p is not None}):
        rows = [i for i, p in enumerate(params.custom_tis_paths) if p == path]
        sub_loss, sub_mask, metrics = _apply_custom_tis(
            path, rows, pg, trainer_old_BT, _engine_logprobs(rollout_logprobs_BT), active_BT, tis_args
        )
        index = torch.tensor(rows, device=pg.device)
        pg = pg.index_put((index,), sub_loss)
        weight_mask = weight_mask.index_put((index,), sub_mask)
        if "tis" in metrics:
            weights = weights.index_put((index,), metrics["tis"])
        if "tis_clipfrac" in metrics:
            clipfrac = clipfrac.index_put((index,), metrics["tis_clipfrac"])
    return _Weighted(pg=pg, weight_mask=weight_mask, weights=weights, clipfrac=clipfrac)


def _kl_to_reference(logp_BT: Tensor, old_BT: Tensor, ref_logprobs_BT: Tensor | None, active_BT: Tensor,
                     params: LossParams) -> Tensor:
    """Each sample's KL estimator to the base model (times `exp(logp - old)` where unbiased)."""
    if ref_logprobs_BT is None:
        raise ValueError("--use-kl-loss needs the base model's logprobs (ref_logprobs_BT)")
    importance = None
    if bool(params.use_unbiased_kl_B.any()):
        unbiased = torch.exp(logp_BT - old_BT)
        importance = torch.where(_col(params.use_unbiased_kl_B, logp_BT), unbiased, torch.ones_like(unbiased))
    kl = approx_kl_per_sample(logp_BT, ref_logprobs_BT.detach(), params.kl_type_B, importance)
    return _masked(kl, active_BT)


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Per-token entropy -sum p log p of the softmax over the last dimension."""
    logp = torch.log_softmax(logits_BTV.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
