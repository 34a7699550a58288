"""Loss math against numbers worked out by hand."""

from __future__ import annotations

import math
import statistics
import sys
import textwrap

import pytest
import torch

from miles.backends.common.loss import (
    LossParams,
    LossSettings,
    approx_kl,
    approx_kl_per_sample,
    compute_advantages,
    entropy_from_logits,
    grpo_advantages,
    masked_whiten,
    policy_loss_terms,
)


def test_advantages_groups_of_different_sizes_and_zero_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 1.0, 5.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(rewards, [4, 2, 1, 3])
    # group [1,0,1,0]: mean 0.5, unbiased std sqrt(1/3)
    s4 = math.sqrt(1 / 3) + 1e-6
    # group [3,1]: mean 2, unbiased std sqrt(2)
    s2 = math.sqrt(2) + 1e-6
    expected = [0.5 / s4, -0.5 / s4, 0.5 / s4, -0.5 / s4, 1 / s2, -1 / s2, 0.0, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_advantages_reject_sizes_that_do_not_cover_the_rewards():
    with pytest.raises(ValueError, match="group sizes sum to 3"):
        grpo_advantages(torch.zeros(4), [2, 1])
    with pytest.raises(ValueError, match="at least one sample"):
        grpo_advantages(torch.zeros(2), [2, 0])


def _clip_case():
    # Four samples of one token each: (advantage, ratio) = (+1, 1.5), (-1, 0.5), (+1, 0.5), (-1, 1.5).
    ratios = torch.tensor([[1.5], [0.5], [0.5], [1.5]])
    old = torch.zeros(4, 1)
    logp = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    return logp, old, adv


def test_ppo_clip_on_both_sides():
    logp, old, adv = _clip_case()
    out = terms(logp, old, adv, torch.ones(4, 1), LossSettings(eps_clip=0.2, eps_clip_high=0.28))
    # (+1, 1.5): max(-1.5, -1.28) = -1.28 clipped; (-1, 0.5): max(0.5, 0.8) = 0.8 clipped;
    # (+1, 0.5): max(-0.5, -0.8) = -0.5; (-1, 1.5): max(1.5, 1.2) = 1.5.
    assert out.loss_B.tolist() == pytest.approx([-1.28, 0.8, -0.5, 1.5], abs=1e-6)
    assert out.pg_clipfrac_B.tolist() == [1.0, 1.0, 0.0, 0.0]  # one token each: clipped or not
    out.loss_B.sum().backward()
    # d(-A r)/d logp = -A r where unclipped; zero where the clipped term is active.
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.5, 1.5], abs=1e-6)


def test_token_mean_per_sample_ignores_masked_tokens():
    logp = torch.log(torch.tensor([[1.0, 1.1, 7.0], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = terms(logp, torch.zeros(2, 3), torch.tensor([2.0, -1.0]), mask, LossSettings(eps_clip=0.5, eps_clip_high=0.5))
    # sample 0: tokens -2*1.0 and -2*1.1 (inside the clip range), mean -2.1; token 3 is padding.
    assert out.loss_B.tolist() == pytest.approx([-2.1, 1.0], abs=1e-6)
    assert out.tokens_B.tolist() == [2.0, 1.0]


def test_tis_weight_is_capped_and_detached():
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[-math.log(3.0), math.log(2.0)]])  # weights exp(0 - rollout): 3 -> cap 2, 0.5
    out = terms(logp, old, torch.tensor([1.0]), torch.ones(1, 2), LossSettings(use_tis=True, tis_clip=2.0),
                rollout_logprobs_BT=rollout)
    # per token -A * r * w with r = 1: -2 and -0.5, token mean -1.25
    assert out.loss_B.item() == pytest.approx(-1.25, abs=1e-6)
    # the metrics are Miles': the raw weights' mean (3, 0.5) and the share that was clamped
    assert out.tis_B.item() == pytest.approx(1.75, abs=1e-6)
    assert out.tis_clipfrac_B.item() == pytest.approx(0.5, abs=1e-6)
    out.loss_B.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-1.0, -0.25], abs=1e-6)


def test_tis_without_rollout_logprobs_is_an_error():
    with pytest.raises(ValueError, match="engine's logprobs of every response token"):
        terms(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), LossSettings(use_tis=True))


def test_k3_kl_value_and_penalty():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    # d = ln(0.5): e^d - d - 1 = 0.5 + ln 2 - 1
    expected_kl = 0.5 + math.log(2) - 1
    assert approx_kl(logp, ref, "k3").item() == pytest.approx(expected_kl, abs=1e-7)
    settings = LossSettings(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    out = terms(logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 1), settings, ref_logprobs_BT=ref)
    assert out.kl_loss_B.item() == pytest.approx(expected_kl, abs=1e-7)
    assert out.loss_B.item() == pytest.approx(0.1 * expected_kl, abs=1e-7)
    assert approx_kl(ref, ref, "k3").item() == 0.0



# --- Miles' settings: advantages -------------------------------------------------

RPP = dict(normalize_advantages=True)


def _whiten_by_hand(values: list[float]) -> tuple[float, float]:
    """Mean and 1/sqrt(unbiased var + 1e-8) of the response-token values."""
    return statistics.mean(values), 1 / math.sqrt(statistics.variance(values) + 1e-8)


def test_grpo_and_gspo_advantages_are_the_normalized_reward_on_every_response_token():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 1.0])
    mask = torch.tensor([[1, 1, 0]] * 4 + [[1, 0, 0], [1, 1, 1]])
    s4, s2 = math.sqrt(1 / 3) + 1e-6, math.sqrt(2) + 1e-6
    per_sample = [0.5 / s4, -0.5 / s4, 0.5 / s4, -0.5 / s4, 1 / s2, -1 / s2]
    for estimator in ("grpo", "gspo"):
        adv = compute_advantages(LossSettings(advantage_estimator=estimator), rewards, mask, group_sizes=[4, 2])
        expected = [a * m for a, row in zip(per_sample, mask.tolist()) for m in row]
        assert adv.flatten().tolist() == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_only_centres_and_disabled_reward_normalization_keeps_raw_rewards():
    rewards, mask = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0]), torch.ones(5, 1)
    dr = compute_advantages(LossSettings(grpo_std_normalization=False), rewards, mask, group_sizes=[3, 2])
    assert dr.flatten().tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0], abs=1e-6)
    raw = compute_advantages(LossSettings(rewards_normalization=False), rewards, mask, group_sizes=[3, 2])
    assert raw.flatten().tolist() == [1.0, 0.0, 0.0, 3.0, 1.0]


def test_normalize_advantages_whitens_over_response_tokens_only():
    rewards = torch.tensor([2.0, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = compute_advantages(
        LossSettings(rewards_normalization=False, normalize_advantages=True), rewards, mask, group_sizes=[1, 1]
    )
    mean, inv = _whiten_by_hand([2.0, 2.0, 2.0, 0.0])  # padding zeros do not enter the statistics
    assert adv[0].tolist() == pytest.approx([(2 - mean) * inv] * 3, abs=1e-5)
    assert adv[1].tolist() == pytest.approx([(0 - mean) * inv] * 3, abs=1e-5)


def test_reinforce_plus_plus_discounts_kl_shaped_token_rewards_then_whitens():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    settings = LossSettings(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=0.9, **RPP)
    adv = compute_advantages(settings, rewards, mask, group_sizes=[1, 1], kl_NT=kl)
    # sample 0: token rewards -0.05, -0.1, -0.15 + 1; returns backwards with gamma 0.9
    g02 = 0.85
    g01 = -0.1 + 0.9 * g02
    g00 = -0.05 + 0.9 * g01
    # sample 1: -0.2, -0.25 + 0 (reward at its last response token); the padded 9.0 is ignored
    g11 = -0.25
    g10 = -0.2 + 0.9 * g11
    mean, inv = _whiten_by_hand([g00, g01, g02, g10, g11])
    assert adv[0].tolist() == pytest.approx([(g - mean) * inv for g in (g00, g01, g02)], abs=1e-5)
    assert adv[1, :2].tolist() == pytest.approx([(g - mean) * inv for g in (g10, g11)], abs=1e-5)


def test_reinforce_plus_plus_baseline_centres_per_group_without_std_minus_kl():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.ones(4, 2)
    kl = torch.tensor([[0.2, 0.4], [0.0, 0.2], [0.4, 0.0], [0.2, 0.2]])
    settings = LossSettings(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5, **RPP)
    adv = compute_advantages(settings, rewards, mask, group_sizes=[2, 2], kl_NT=kl)
    raw = [[0.5 - 0.1, 0.5 - 0.2], [-0.5, -0.5 - 0.1], [0.0 - 0.2, 0.0], [-0.1, -0.1]]
    mean, inv = _whiten_by_hand([v for row in raw for v in row])
    assert adv.flatten().tolist() == pytest.approx([(v - mean) * inv for row in raw for v in row], abs=1e-5)


def test_kl_shaping_needs_the_kl_and_whitening_needs_tokens():
    with pytest.raises(ValueError, match="pass kl_NT"):
        compute_advantages(LossSettings(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, **RPP),
                           torch.ones(1), torch.ones(1, 1), group_sizes=[1])
    with pytest.raises(ValueError, match="no response tokens"):
        masked_whiten(torch.ones(1, 2), torch.zeros(1, 2))
    # grpo ignores the reward-shaping KL (as Miles), so it needs none
    grpo = compute_advantages(LossSettings(kl_coef=0.1), torch.tensor([1.0, 0.0]), torch.ones(2, 1), group_sizes=[2])
    assert grpo.flatten().tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)])
    assert not LossSettings(kl_coef=0.1).needs_ref_logprobs
    assert LossSettings(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, **RPP).needs_ref_logprobs


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(advantage_estimator="ppo"), "not supported"),
    (dict(kl_loss_type="k4"), "kl-loss-type"),
    (dict(eps_clip_c=1.0), "must be > 1.0"),
    (dict(kl_coef=0.1, kl_loss_coef=0.1), "only one of --kl-coef"),
    (dict(advantage_estimator="reinforce_plus_plus"), "add --normalize-advantages"),
    (dict(use_rollout_logprobs=True, use_tis=True), "cannot be set at the same time"),
    (dict(tis_clip_low=3.0), "tis-clip-low"),
])
def test_settings_are_checked_as_miles_checks_its_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossSettings(**kwargs)


def test_settings_defaults_are_miles_defaults():
    s = LossSettings()
    clip = (s.advantage_estimator, s.kl_loss_type, s.eps_clip, s.clip_high, s.eps_clip_c)
    assert clip == ("grpo", "k1", 0.2, 0.2, None)
    rest = (s.tis_clip, s.tis_clip_low, s.gamma, s.entropy_coef, s.kl_loss_coef, s.kl_coef)
    assert rest == (2.0, 0.0, 1.0, 0.0, 0.0, 0.0)
    assert s.grpo_std_normalization and s.rewards_normalization and not s.normalize_advantages


# --- KL estimators ------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    d = math.log(2)
    assert approx_kl(logp, ref, "k1").item() == pytest.approx(d, abs=1e-6)
    assert approx_kl(logp, ref, "k2").item() == pytest.approx(d * d / 2, abs=1e-6)
    assert approx_kl(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + d, abs=1e-6)
    assert approx_kl(logp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + d, abs=1e-6)
    assert approx_kl(logp, ref, "k1", importance_ratio=torch.tensor([[3.0]])).item() == pytest.approx(3 * d, abs=1e-6)


def test_only_low_var_kl_is_clamped():
    logp, ref = torch.tensor([[0.0, -30.0]]), torch.tensor([[-30.0, 0.0]])
    # d = 30: k3 = e^-30 - 1 + 30; d = -30: k3 = e^30 - 1 - 30
    assert approx_kl(logp, ref, "k3").tolist()[0] == pytest.approx([29.0, math.exp(30) - 31], rel=1e-5)
    # low_var_kl clamps -d to [-20, 20] (19 and e^20 - 21) and then the value to [-10, 10]
    assert approx_kl(logp, ref, "low_var_kl").tolist() == [[10.0, 10.0]]
    assert approx_kl(logp, ref, "k1").tolist() == [[30.0, -30.0]]


def test_kl_per_sample_matches_each_estimator_and_keeps_gradients_finite():
    logp = torch.tensor([[-60.0, -1.0], [-60.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -2.0], [0.0, -2.0]])
    kl = approx_kl_per_sample(logp, ref, torch.tensor([0, 2]))  # k1 then k3 (which overflows)
    assert kl[0].tolist() == approx_kl(logp[:1], ref[:1], "k1")[0].tolist()
    assert kl[1].tolist() == approx_kl(logp[1:], ref[1:], "k3")[0].tolist()
    kl[0].sum().backward()
    assert logp.grad[0].tolist() == [1.0, 1.0] and logp.grad[1].tolist() == [0.0, 0.0]


# --- Miles' settings: the policy loss -----------------------------------------------


def terms(logp, old, adv, mask, settings, **kwargs):
    return policy_loss_terms(logp, old, adv, mask, LossParams.uniform(settings, logp.shape[0]), **kwargs)


def test_ppo_clip_asymmetric_bounds_match_the_hand_values():
    logp, old, adv = _clip_case()
    out = terms(logp, old, adv, torch.ones(4, 1), LossSettings(eps_clip=0.2, eps_clip_high=0.28))
    assert out.loss_B.tolist() == pytest.approx([-1.28, 0.8, -0.5, 1.5], abs=1e-6)
    assert out.pg_clipfrac_B.tolist() == [1.0, 1.0, 0.0, 0.0]
    out.loss_B.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.5, 1.5], abs=1e-6)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logp = torch.log(torch.tensor([[5.0], [5.0], [0.5]])).requires_grad_(True)
    adv = torch.tensor([-1.0, 1.0, -1.0])
    out = terms(logp, torch.zeros(3, 1), adv, torch.ones(3, 1), LossSettings(eps_clip_c=3.0))
    # (-1, r=5): max(5, 1.2) = 5, dual clip min(5, 3) = 3; (+1, r=5): max(-5, -1.2) = -1.2;
    # (-1, r=0.5): max(0.5, 0.8) = 0.8 < 3, untouched
    assert out.loss_B.tolist() == pytest.approx([3.0, -1.2, 0.8], abs=1e-6)
    out.loss_B.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)
    plain = terms(logp.detach(), torch.zeros(3, 1), adv, torch.ones(3, 1), LossSettings())
    assert plain.loss_B.tolist() == pytest.approx([5.0, -1.2, 0.8], abs=1e-6)


def test_gspo_uses_one_sequence_ratio_for_every_token():
    logp = torch.tensor([[math.log(2.0), 0.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    settings = LossSettings(advantage_estimator="gspo", eps_clip=0.5)
    out = terms(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, settings)
    # ratio exp(mean(ln 2, 0)) = sqrt(2) inside [0.5, 1.5]: loss -sqrt(2), d/dlogp_t = -sqrt(2) / 2
    assert out.loss_B.item() == pytest.approx(-math.sqrt(2), abs=1e-6)
    out.loss_B.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-math.sqrt(2) / 2, -math.sqrt(2) / 2, 0.0], abs=1e-6)
    token = terms(logp.detach(), torch.zeros(1, 3), torch.tensor([1.0]), mask, LossSettings(eps_clip=0.5))
    assert token.loss_B.item() == pytest.approx((-1.5 - 1.0) / 2, abs=1e-6)  # ratio 2 clipped to 1.5, and 1


def test_tis_clamps_the_weight_to_both_bounds():
    logp = torch.zeros(1, 3, requires_grad=True)
    rollout = -torch.log(torch.tensor([[3.0, 0.5, 0.1]]))  # raw weights exp(0 - rollout) = 3, 0.5, 0.1
    settings = LossSettings(use_tis=True, tis_clip=2.0, tis_clip_low=0.2)
    out = terms(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), settings, rollout_logprobs_BT=rollout)
    assert out.loss_B.item() == pytest.approx(-(2.0 + 0.5 + 0.2) / 3, abs=1e-6)
    assert out.tis_B.item() == pytest.approx((3 + 0.5 + 0.1) / 3, abs=1e-6)
    assert out.tis_clipfrac_B.item() == pytest.approx(2 / 3, abs=1e-6)
    out.loss_B.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-2 / 3, -0.5 / 3, -0.2 / 3], abs=1e-6)


def test_rollout_logprobs_replace_the_old_logprobs():
    logp = torch.zeros(1, 1)
    rollout = torch.log(torch.tensor([[0.5]]))  # ratio exp(0 - ln 0.5) = 2, clipped to 1.2
    out = terms(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1),
                LossSettings(use_rollout_logprobs=True), rollout_logprobs_BT=rollout)
    assert out.loss_B.item() == pytest.approx(-1.2, abs=1e-6)
    assert out.ppo_kl_B.item() == pytest.approx(math.log(0.5), abs=1e-6)
    with pytest.raises(ValueError, match="engine's logprobs"):
        terms(logp, logp, torch.ones(1), torch.ones(1, 1), LossSettings(use_rollout_logprobs=True))


def test_entropy_bonus_subtracts_the_token_mean_entropy():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]]))
    entropy = entropy_from_logits(logits)
    assert entropy.tolist()[0] == pytest.approx([1.5 * math.log(2), math.log(3)], abs=1e-6)
    out = terms(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([0.0]), torch.ones(1, 2),
                LossSettings(entropy_coef=0.1), entropy_BT=entropy)
    assert out.loss_B.item() == pytest.approx(-0.1 * (1.5 * math.log(2) + math.log(3)) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="entropy"):
        terms(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), LossSettings(entropy_coef=0.1))


@pytest.mark.parametrize(("kl_type", "unbiased", "expected"), [
    ("k1", False, math.log(2)),
    ("k1", True, 2 * math.log(2)),  # times the ratio exp(logp - old) = 2
    ("k2", False, math.log(2) ** 2 / 2),
    ("k3", False, 0.5 - 1 + math.log(2)),
])
def test_kl_loss_term_with_each_estimator(kl_type, unbiased, expected):
    logp, old, ref = (torch.log(torch.tensor([[p]])) for p in (0.5, 0.25, 0.25))
    settings = LossSettings(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kl_type, use_unbiased_kl=unbiased)
    out = terms(logp, old, torch.tensor([0.0]), torch.ones(1, 1), settings, ref_logprobs_BT=ref)
    assert out.kl_loss_B.item() == pytest.approx(expected, abs=1e-6)
    assert out.loss_B.item() == pytest.approx(0.1 * expected, abs=1e-6)
    with pytest.raises(ValueError, match="base model"):
        terms(logp, old, torch.zeros(1), torch.ones(1, 1), settings)


def test_a_mixed_batch_gives_each_sample_the_loss_of_its_adapter_alone():
    gen = torch.Generator().manual_seed(1)
    settings = [
        LossSettings(eps_clip=0.1, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k3"),
        LossSettings(advantage_estimator="gspo", eps_clip=0.3, eps_clip_c=2.0, entropy_coef=0.01,
                     use_tis=True, tis_clip_low=0.5, tis_clip=1.5),
        LossSettings(use_rollout_logprobs=True, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                     use_unbiased_kl=True),
    ]
    slots = [2, 0, 1, 1, 2, 0]
    logp = (-torch.rand(6, 5, generator=gen)).requires_grad_(True)
    old = logp.detach() + 0.4 * torch.randn(6, 5, generator=gen)
    rollout = old + 0.4 * torch.randn(6, 5, generator=gen)
    ref = old - torch.rand(6, 5, generator=gen)
    entropy = torch.rand(6, 5, generator=gen).requires_grad_(True)
    adv = torch.randn(6, generator=gen)
    mask = (torch.arange(5) < torch.tensor([5, 3, 4, 1, 2, 5]).unsqueeze(1)).int()
    extra = dict(rollout_logprobs_BT=rollout, ref_logprobs_BT=ref)
    mixed = policy_loss_terms(logp, old, adv, mask, LossParams.gather(settings, slots), entropy_BT=entropy, **extra)
    grads = torch.autograd.grad(mixed.loss_B.sum(), [logp, entropy])
    for i, slot in enumerate(slots):
        row = slice(i, i + 1)
        alone = terms(logp[row], old[row], adv[row], mask[row], settings[slot], entropy_BT=entropy[row],
                      rollout_logprobs_BT=rollout[row], ref_logprobs_BT=ref[row])
        alone_grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(
            torch.autograd.grad(alone.loss_B.sum(), [logp, entropy], allow_unused=True), [logp, entropy])]
        assert mixed.loss_B[i].item() == pytest.approx(alone.loss_B.item(), abs=1e-6)
        assert grads[0][i].tolist() == pytest.approx(alone_grads[0][i].tolist(), abs=1e-6)
        assert grads[1][i].tolist() == pytest.approx(alone_grads[1][i].tolist(), abs=1e-6)


def test_params_are_gathered_by_slot():
    settings = [LossSettings(eps_clip=0.1), LossSettings(eps_clip=0.3, eps_clip_high=0.4, eps_clip_c=3.0)]
    params = LossParams.gather(settings, torch.tensor([1, 0, 1]))
    assert params.eps_clip_B.tolist() == pytest.approx([0.3, 0.1, 0.3])
    assert params.eps_clip_high_B.tolist() == pytest.approx([0.4, 0.1, 0.4])
    assert params.eps_clip_c_B[0].item() == 3.0 and math.isnan(params.eps_clip_c_B[1].item())
    with pytest.raises(ValueError, match="out of range"):
        LossParams.gather(settings, [2])


@pytest.fixture
def tis_module(tmp_path, monkeypatch):
    (tmp_path / "my_tis.py").write_text(textwrap.dedent("""
        import torch

        def clip_or_pop(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
            ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
            keep = (ratio >= args.low) & (ratio <= args.high)
            masks = list(torch.split(keep.float(), [m.numel() for m in loss_masks]))
            return pg_loss * torch.where(keep, ratio, torch.zeros_like(ratio)), masks, {"tis": ratio}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_tis.clip_or_pop"
    sys.modules.pop("my_tis", None)


def test_custom_tis_function_reweights_and_rejects_tokens(tis_module):
    class Args:
        low, high = 0.2, 2.0

    logp = torch.zeros(2, 3, requires_grad=True)
    rollout = -torch.log(torch.tensor([[3.0, 0.5, 1.0], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    settings = LossSettings(use_tis=True, custom_tis_function_path=tis_module)
    out = terms(logp, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), mask, settings, rollout_logprobs_BT=rollout,
                tis_args=Args())
    # sample 0: ratio 3 is rejected (out of the numerator and the denominator); -0.5 and -1 remain
    assert out.loss_B.tolist() == pytest.approx([-0.75, -1.0], abs=1e-6)
    assert out.tis_B.tolist() == pytest.approx([(3 + 0.5 + 1) / 3, 1.0], abs=1e-6)  # before rejection
    out.loss_B.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.25, -0.5, -0.5, -0.5, 0.0], abs=1e-6)


def test_custom_tis_path_errors_are_clear():
    with pytest.raises(ValueError, match="cannot be imported"):
        terms(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
              LossSettings(use_tis=True, custom_tis_function_path="no_such_mod_xyz.fn"),
              rollout_logprobs_BT=torch.zeros(1, 1))
