"""Every estimator and loss setting learns a toy task with the pure loss math.

The policy is a table of logits, one categorical per response position (no model): a
response is 3 tokens over a vocabulary of 4 and scores the fraction of them that match
the target. Each step samples groups of 8 responses for 2 prompts, computes the
adapter's advantages and its loss, and takes one Adam step, on-policy. Starting from a
uniform policy (the target has probability 1/64), each setting must make the target the
greedy response and give it probability above 0.5 in 60 steps (seeded).
"""

from __future__ import annotations

import pytest
import torch

from miles.backends.common.loss import LossParams, LossSettings, approx_kl, compute_advantages, policy_loss_terms

VOCAB, LENGTH, GROUPS, GROUP_SIZE, STEPS = 4, 3, 2, 8, 60
TARGET = torch.tensor([2, 0, 3])

SETTINGS = {
    "grpo": LossSettings(eps_clip_high=0.28),
    "dr_grpo": LossSettings(grpo_std_normalization=False),
    "gspo": LossSettings(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4),
    "reinforce_plus_plus": LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True,
                                        kl_coef=0.01, gamma=0.99),
    "reinforce_plus_plus_baseline": LossSettings(advantage_estimator="reinforce_plus_plus_baseline",
                                                 normalize_advantages=True, kl_coef=0.01),
    "kl_loss_entropy_dual_clip": LossSettings(use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type="low_var_kl",
                                              entropy_coef=0.001, eps_clip_c=3.0),
    "tis": LossSettings(use_tis=True, tis_clip=2.0, tis_clip_low=0.5),
}


def train(settings: LossSettings, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(LENGTH, VOCAB, requires_grad=True)
    ref_logits = torch.zeros(LENGTH, VOCAB)
    opt = torch.optim.Adam([logits], lr=0.1)
    n = GROUPS * GROUP_SIZE
    mask = torch.ones(n, LENGTH)
    params = LossParams.uniform(settings, n)
    for _ in range(STEPS):
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            tokens = torch.stack([torch.multinomial(probs[t], n, replacement=True, generator=gen)
                                  for t in range(LENGTH)], dim=1)
            # the engine samples with slightly different numerics than the trainer
            rollout = torch.log_softmax(logits, -1).gather(1, tokens.T).T + 0.05 * torch.randn(n, LENGTH, generator=gen)
        rewards = (tokens == TARGET).float().mean(dim=1)  # partial credit per correct token
        logp = torch.log_softmax(logits, -1).gather(1, tokens.T).T
        ref = torch.log_softmax(ref_logits, -1).gather(1, tokens.T).T
        old = logp.detach()
        kl = approx_kl(old, ref, settings.kl_loss_type)
        adv = compute_advantages(settings, rewards, mask, group_sizes=[GROUP_SIZE] * GROUPS, kl_NT=kl)
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).expand(n, LENGTH)
        out = policy_loss_terms(logp, old, adv, mask, params, rollout_logprobs_BT=rollout, ref_logprobs_BT=ref,
                                entropy_BT=entropy)
        opt.zero_grad()
        (out.loss_B.sum() / n).backward()
        opt.step()
    return logits.detach()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_setting_learns_the_target(name):
    logits = train(SETTINGS[name], seed=0)
    assert logits.argmax(dim=-1).tolist() == TARGET.tolist()
    p_target = torch.softmax(logits, -1).gather(1, TARGET.unsqueeze(1)).prod().item()
    assert p_target > 0.5, f"{name}: target probability {p_target:.3f}"
