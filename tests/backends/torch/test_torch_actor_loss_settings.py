"""Per-adapter loss settings on a train rank: an adapter's update in a mixed batch, next
to adapters with other estimators and settings, equals its update trained alone.

One rank in-process (no Ray); advantages come from `adapter_token_advantages` (what
the train group computes, with the rank's `reward_kl` for the reinforce++ `--kl-coef`),
so each adapter's advantages depend on its own groups only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles.backends.common.loss import adapter_token_advantages, approx_kl, compute_advantages, needs_reward_kl
from miles.utils.loss_settings import LossSettings
from tests.helpers.numerics import AdamBound, reduction_terms, sum_tolerance, within
from tests.helpers.torch_backend_data import counts, make_groups, max_abs_diff, new_actor, spec

SETTINGS_A = {
    "grpo_k3_kl": LossSettings(eps_clip_high=0.28, use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.05),
    "gspo": LossSettings(advantage_estimator="gspo", eps_clip=3e-3, eps_clip_high=4e-3),
    "dr_grpo_whitened": LossSettings(grpo_std_normalization=False, normalize_advantages=True),
    "entropy_k1_unbiased": LossSettings(entropy_coef=0.05, use_kl_loss=True, kl_loss_coef=0.1, use_unbiased_kl=True),
    "dual_clip_tis_low": LossSettings(eps_clip_c=3.0, use_tis=True, tis_clip=1.5, tis_clip_low=0.5),
    "rollout_logprobs_low_var_kl": LossSettings(use_rollout_logprobs=True, use_kl_loss=True,
                                                kl_loss_type="low_var_kl", kl_loss_coef=0.1),
    "raw_rewards": LossSettings(rewards_normalization=False),
    "reinforce_pp_kl_gamma": LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True,
                                          kl_coef=0.3, gamma=0.9, kl_loss_type="k3"),
    "reinforce_pp_baseline_kl": LossSettings(advantage_estimator="reinforce_plus_plus_baseline",
                                             normalize_advantages=True, kl_coef=0.2),
}
OTHERS = {
    "b": LossSettings(advantage_estimator="gspo", entropy_coef=0.02, use_kl_loss=True, kl_loss_coef=0.2),
    "c": LossSettings(use_tis=True, eps_clip_c=2.0),
    "d": LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.5),
}


def advantages(groups, settings, actor=None):
    """The train group's advantages; `actor` forwards the KL to the base where `--kl-coef` needs it."""
    samples = [s for g in groups for s in g]
    kl = None
    if actor is not None and any(needs_reward_kl(settings[s.adapter]) for s in samples):
        kl = actor.reward_kl(samples)
    adv = adapter_token_advantages(
        torch.tensor([s.reward for s in samples]), [len(g) for g in groups], [g[0].adapter for g in groups],
        [[1] * len(s.response_ids) for s in samples], settings, kl)
    return samples, adv


@pytest.mark.parametrize("name", sorted(SETTINGS_A))
def test_an_adapter_in_a_mixed_batch_updates_as_it_would_alone(tiny_model_dir, name):
    settings = {"a": SETTINGS_A[name], **OTHERS}
    mixed = new_actor(tiny_model_dir, micro_batch_size=5)
    alone = new_actor(tiny_model_dir, micro_batch_size=3)
    for adapter, slot in (("a", 0), ("b", 1), ("c", 2), ("d", 3)):
        mixed.load_adapter(spec(adapter, slot, loss=settings[adapter]))
    alone.load_adapter(spec("a", 3, loss=settings["a"]))
    initial = alone.export_adapter("a")
    rows = alone.core.optimizer
    width = max(p.shape[-1] for p, _ in rows.params)
    adam = AdamBound(lr=spec("a", 3).lr, beta2=rows.betas[1], adam_eps=rows.eps)
    for step in range(2):
        a = make_groups("a", 0, 2, 2, seed=10 + step)
        b = make_groups("b", 1, 2, 2, seed=20 + step)
        c = make_groups("c", 2, 1, 2, seed=30 + step)
        d = make_groups("d", 3, 1, 3, seed=40 + step)
        samples, adv = advantages([b[0], a[0], d[0], c[0], a[1], b[1]], settings, mixed)
        stats = mixed.train(samples, adv, counts(samples))
        stepped = mixed.step_adapters(["a", "b", "c", "d"])
        a_alone = [[dataclasses.replace(s, slot=3) for s in g] for g in a]
        samples_alone, adv_alone = advantages(a_alone, settings, alone)
        stats_alone = alone.train(samples_alone, adv_alone, counts(samples_alone))
        stepped_alone = alone.step_adapters(["a"])
        # Every sum of the mixed batch runs over more samples (other adapters' rows, another
        # micro-batch split), so a's numbers agree to the rounding of sums that size.
        terms = reduction_terms(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples), width)
        adam.observe([v[3] for v in rows.exp_avg_sq], terms)
        assert abs(stats["a"].loss_sum - stats_alone["a"].loss_sum) <= sum_tolerance(stats_alone["a"].loss_sum, terms)
        assert abs(stepped["a"].grad_norm - stepped_alone["a"].grad_norm) <= sum_tolerance(
            stepped_alone["a"].grad_norm, terms)
    # Each weight moves as far apart as AdamW's division by its own RMS lets the gradients' rounding take it.
    assert within([p[0] for p, _ in mixed.core.optimizer.params], [p[3] for p, _ in rows.params], adam.bound) <= 1
    assert adam.median() < spec("a", 3).lr / 10  # a bound tight enough to see a wrong update
    assert max_abs_diff(mixed.export_adapter("a"), initial) > 1e-4  # it learned something


def test_the_adapter_settings_are_the_ones_applied(tiny_model_dir):
    """Two adapters on the same samples with different settings end up apart; the same
    settings given per adapter or as the trainer's default end up equal."""
    groups = make_groups("a", 0, 2, 2, seed=5)
    results = []
    for per_adapter, default in [(LossSettings(entropy_coef=0.5), LossSettings()),
                                 (None, LossSettings(entropy_coef=0.5)),
                                 (None, LossSettings())]:
        actor = new_actor(tiny_model_dir, loss=default)
        actor.load_adapter(spec("a", 0, loss=per_adapter))
        samples, adv = advantages(groups, {"a": per_adapter or default})
        actor.train(samples, adv, counts(samples))
        actor.step_adapters(["a"])
        results.append(actor.export_adapter("a"))
    assert max_abs_diff(results[0], results[1]) <= 1e-6
    assert max_abs_diff(results[0], results[2]) > 1e-5


def test_reward_kl_is_the_policy_to_base_kl_of_each_response_token(tiny_model_dir):
    """After one step the policy has left the base: `reward_kl` is approx_kl(policy, base)
    on the response tokens, with each adapter's estimator, and the reinforce++ advantages
    are `compute_advantages` of those KLs."""
    settings = {"a": LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.5,
                                  kl_loss_type="k2", gamma=0.8)}
    actor = new_actor(tiny_model_dir)
    actor.load_adapter(spec("a", 0, loss=settings["a"], lr=0.2))
    groups = make_groups("a", 0, 2, 3, seed=7)
    samples, adv = advantages(groups, settings, actor)
    assert all(v == 0.0 for kl in actor.reward_kl(samples) for v in kl)  # a fresh adapter is the base
    actor.train(samples, adv, counts(samples))
    actor.step_adapters(["a"])
    policy = actor.logprobs(samples)
    base = actor.logprobs([dataclasses.replace(s, slot=-1) for s in samples])  # slot -1: the base model
    kl = actor.reward_kl(samples)
    for sample, p, b, k in zip(samples, policy, base, kl):
        assert len(k) == len(sample.response_ids)
        expected = approx_kl(torch.tensor(p), torch.tensor(b), "k2")
        assert torch.allclose(torch.tensor(k), expected, atol=1e-6)
    assert max(abs(v) for k in kl for v in k) > 1e-6
    _, adv = advantages(groups, settings, actor)
    width = max(len(s.response_ids) for s in samples)
    mask = torch.zeros(len(samples), width)
    kl_NT = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        mask[i, : len(s.response_ids)] = 1
        kl_NT[i, : len(s.response_ids)] = torch.tensor(kl[i])
    expected = compute_advantages(settings["a"], torch.tensor([s.reward for s in samples]), mask,
                                  group_sizes=[3, 3], kl_NT=kl_NT)
    for i, s in enumerate(samples):
        assert torch.allclose(torch.tensor(adv[i]), expected[i, : len(s.response_ids)], atol=1e-6)


def test_reinforce_plus_plus_with_kl_coef_needs_the_kl():
    with pytest.raises(ValueError, match="adapter 'a': --kl-coef 0.1 shapes the reinforce_plus_plus reward"):
        adapter_token_advantages(torch.tensor([1.0, 0.0]), [2], ["a"], [[1], [1]],
                                 {"a": LossSettings(advantage_estimator="reinforce_plus_plus",
                                                    normalize_advantages=True, kl_coef=0.1)})


WINDOW_SETTINGS = {
    "a": LossSettings(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.05, use_tis=True, tis_clip=1.5,
                      tis_clip_low=0.5),
    "b": LossSettings(use_rollout_logprobs=True, use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.2),
    "c": LossSettings(advantage_estimator="gspo", entropy_coef=0.02, eps_clip_c=3.0, use_kl_loss=True,
                      use_unbiased_kl=True, kl_loss_coef=0.1),
}


def _window_run(model_dir):
    """Two train steps of three adapters on one mixed micro-batch (prompts of 8-12 tokens, a
    loss mask with holes); returns what a caller can see: loss sums, gradients before each
    step, grad norms, logprobs, reward KLs and the trained weights."""
    actor = new_actor(model_dir, n_slots=3)
    for slot, name in enumerate(WINDOW_SETTINGS):
        actor.load_adapter(spec(name, slot, loss=WINDOW_SETTINGS[name], lr=0.05))
    seen = []
    for step in range(2):
        groups = [make_groups(name, slot, 1, 3, seed=50 + 10 * step + slot)[0]
                  for slot, name in enumerate(WINDOW_SETTINGS)]
        samples = [
            dataclasses.replace(s, prompt_ids=[7] * (6 + (s.index + s.slot) % 5) + s.prompt_ids[:2],
                                loss_mask=[int(t % 3 != 0) for t in range(len(s.response_ids))])
            for g in groups for s in g
        ]
        samples, adv = advantages([samples[i : i + 3] for i in range(0, len(samples), 3)], WINDOW_SETTINGS)
        stats = actor.train(samples, adv, counts(samples))
        grads = [g.clone() for slot in range(3) for g in actor.core.optimizer.slot_grads(slot)]
        norms = actor.step_adapters(list(WINDOW_SETTINGS))
        seen.append((stats, grads, norms, actor.logprobs(samples), actor.reward_kl(samples)))
    return seen, {name: actor.export_adapter(name) for name in WINDOW_SETTINGS}, actor, samples


def test_the_response_window_gives_the_numbers_of_the_full_forward(tiny_model_dir, monkeypatch):
    """The LM head on the response window only (`logits_to_keep`) changes no logprob,
    entropy, loss term or gradient (fp32; KL to the reference, TIS, rollout logprobs,
    entropy bonus, GSPO and a loss mask, three adapters in one micro-batch)."""
    from miles.backends.common.batching import logits_to_keep, make_micro_batches
    from miles.backends.common.loss import entropy_from_logits
    from miles.backends.torch import train_model as model_module

    monkeypatch.setattr(model_module, "WINDOW_MIN_SKIPPED_LOGITS", 0)  # the tiny vocabulary is below it
    windowed, windowed_weights, actor, samples = _window_run(tiny_model_dir)
    (batch,) = make_micro_batches(samples, [0.0] * len(samples), None)
    length, keep = batch.input_ids_BL.shape[1], logits_to_keep(batch)
    assert keep <= length - 7  # the window leaves out at least 7 prompt positions
    with torch.no_grad():
        logprobs_BT, entropy_BT = actor.model.forward_logprobs(batch, batch.slots, entropy=True)
        from miles.lora import use_slots

        with use_slots(actor.model.module, batch.slots):
            full_BLV = actor.model.module(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL).logits
    assert torch.all(logprobs_BT[:, : length - keep] == 0) and torch.all(entropy_BT[:, : length - keep] == 0)
    window = slice(length - keep, None)
    torch.testing.assert_close(entropy_BT[:, window], entropy_from_logits(full_BLV[:, :-1])[:, window],
                               atol=1e-6, rtol=0)

    monkeypatch.setattr(model_module, "logits_to_keep", lambda batch: batch.input_ids_BL.shape[1])
    full, full_weights, _, _ = _window_run(tiny_model_dir)
    for (stats_w, grads_w, norms_w, logp_w, kl_w), (stats_f, grads_f, norms_f, logp_f, kl_f) in zip(windowed, full):
        for name in WINDOW_SETTINGS:
            for field in dataclasses.fields(stats_w[name]):
                assert getattr(stats_w[name], field.name) == pytest.approx(getattr(stats_f[name], field.name), abs=1e-6)
            assert norms_w[name].grad_norm == pytest.approx(norms_f[name].grad_norm, abs=1e-6)
        assert max(float((w - f).abs().max()) for w, f in zip(grads_w, grads_f)) <= 1e-6
        assert max(float(w.abs().max()) for w in grads_w) > 1e-4  # a real gradient
        for w, f in zip(logp_w + kl_w, logp_f + kl_f):
            torch.testing.assert_close(torch.tensor(w), torch.tensor(f), atol=1e-6, rtol=0)
    for name in WINDOW_SETTINGS:
        assert max_abs_diff(windowed_weights[name], full_weights[name]) <= 1e-6
