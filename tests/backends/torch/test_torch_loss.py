"""Loss math against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from miles.backends.torch.loss import LossConfig, grpo_advantages, k3_kl, policy_loss


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
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28)
    out = policy_loss(logp, old, adv, torch.ones(4, 1), config=cfg)
    # (+1, 1.5): max(-1.5, -1.28) = -1.28 clipped; (-1, 0.5): max(0.5, 0.8) = 0.8 clipped;
    # (+1, 0.5): max(-0.5, -0.8) = -0.5; (-1, 1.5): max(1.5, 1.2) = 1.5.
    assert out.loss_B.tolist() == pytest.approx([-1.28, 0.8, -0.5, 1.5], abs=1e-6)
    assert out.clipped_tokens_B.tolist() == [1.0, 1.0, 0.0, 0.0]
    out.loss_B.sum().backward()
    # d(-A r)/d logp = -A r where unclipped; zero where the clipped term is active.
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.5, 1.5], abs=1e-6)


def test_token_mean_per_sample_ignores_masked_tokens():
    logp = torch.log(torch.tensor([[1.0, 1.1, 7.0], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = policy_loss(logp, torch.zeros(2, 3), torch.tensor([2.0, -1.0]), mask, config=LossConfig(eps_clip=0.5))
    # sample 0: tokens -2*1.0 and -2*1.1 (inside the clip range), mean -2.1; token 3 is padding.
    assert out.loss_B.tolist() == pytest.approx([-2.1, 1.0], abs=1e-6)
    assert out.tokens_B.tolist() == [2.0, 1.0]


def test_tis_weight_is_capped_and_detached():
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[-math.log(3.0), math.log(2.0)]])  # weights exp(0 - rollout): 3 -> cap 2, 0.5
    cfg = LossConfig(use_tis=True, tis_clip=2.0)
    out = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), config=cfg, rollout_logprobs_BT=rollout)
    # per token -A * r * w with r = 1: -2 and -0.5, token mean -1.25
    assert out.loss_B.item() == pytest.approx(-1.25, abs=1e-6)
    assert out.tis_B.item() == pytest.approx(1.25, abs=1e-6)
    out.loss_B.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-1.0, -0.25], abs=1e-6)


def test_tis_without_rollout_logprobs_is_an_error():
    with pytest.raises(ValueError, match="rollout logprobs"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), config=LossConfig(use_tis=True))


def test_k3_kl_value_and_penalty():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    # d = ln(0.5): e^d - d - 1 = 0.5 + ln 2 - 1
    expected_kl = 0.5 + math.log(2) - 1
    assert k3_kl(logp, ref).item() == pytest.approx(expected_kl, abs=1e-7)
    cfg = LossConfig(kl_coef=0.1)
    out = policy_loss(logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 1), config=cfg, ref_logprobs_BT=ref)
    assert out.kl_B.item() == pytest.approx(expected_kl, abs=1e-7)
    assert out.loss_B.item() == pytest.approx(0.1 * expected_kl, abs=1e-7)
    assert k3_kl(ref, ref).item() == 0.0
