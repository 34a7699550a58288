"""The fused LM head + token logprob (and entropy) equals logits -> log_softmax -> gather,
in value and in the hidden states' gradient, across chunk boundaries and padded rows; a
train rank with it trains as with the model's own head."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.torch.lm_head import fused_head_weight, lm_head_logprobs
from miles.utils.loss_settings import LossSettings
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, make_groups, new_actor, spec

VOCAB, HIDDEN = 50, 16


def plain(hidden_BTH, weight_VH, targets_BT):
    logp = torch.log_softmax(torch.nn.functional.linear(hidden_BTH, weight_VH).float(), dim=-1)
    return logp.gather(-1, targets_BT[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(5, 7, HIDDEN, generator=g) * 2).to(dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=g).to(dtype)
    targets = torch.randint(0, VOCAB, (5, 7), generator=g)
    targets[3, 4:] = 0  # a padded row: pad targets, masked out of the loss
    mask = torch.ones(5, 7)
    mask[3, 4:] = 0
    mask[1] = 0  # a row of no response token
    return hidden, weight, targets, mask, torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)


@pytest.mark.parametrize("rows_per_chunk", [1, 4, 35, 1000])  # 4 does not divide the 35 positions
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [False, True])
def test_fused_head_equals_the_plain_head(rows_per_chunk, dtype, entropy):
    hidden, weight, targets, mask, a, b = inputs(dtype)
    h_plain = hidden.clone().requires_grad_(True)
    logp_plain, ent_plain = plain(h_plain, weight, targets)
    loss = (mask * a * logp_plain).sum() + ((mask * b * ent_plain).sum() if entropy else 0)
    loss.backward()

    h_fused = hidden.clone().requires_grad_(True)
    out = lm_head_logprobs(h_fused, weight, targets, entropy=entropy, chunk_logits=rows_per_chunk * VOCAB)
    logp_fused, ent_fused = out if entropy else (out, None)
    loss = (mask * a * logp_fused).sum() + ((mask * b * ent_fused).sum() if entropy else 0)
    loss.backward()

    assert logp_fused.dtype == torch.float32 and logp_fused.shape == (5, 7)
    # bf16 too: the logits are the same bf16 GEMM, read in float32
    torch.testing.assert_close(logp_fused, logp_plain, atol=1e-5, rtol=0)
    if entropy:
        torch.testing.assert_close(ent_fused, ent_plain, atol=1e-5, rtol=0)
    assert h_fused.grad.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(h_fused.grad, h_plain.grad, atol=1e-5, rtol=0)
    else:  # each side rounds its GEMM operands and result to bf16: two bf16 units of the largest entry
        scale = h_plain.grad.float().abs().max().item()
        torch.testing.assert_close(h_fused.grad.float(), h_plain.grad.float(), atol=scale * 2**-7, rtol=0)
    assert torch.all(h_fused.grad[1] == 0) and torch.all(h_fused.grad[3, 4:] == 0)  # masked rows get nothing


def test_entropy_only_gradient_and_no_grad_forward():
    hidden, weight, targets, mask, _, b = inputs(torch.float32)
    h_plain = hidden.clone().requires_grad_(True)
    (mask * b * plain(h_plain, weight, targets)[1]).sum().backward()
    h_fused = hidden.clone().requires_grad_(True)
    (mask * b * lm_head_logprobs(h_fused, weight, targets, entropy=True, chunk_logits=3 * VOCAB)[1]).sum().backward()
    torch.testing.assert_close(h_fused.grad, h_plain.grad, atol=1e-5, rtol=0)
    with torch.no_grad():
        logp = lm_head_logprobs(hidden, weight, targets, chunk_logits=3 * VOCAB)
    torch.testing.assert_close(logp, plain(hidden, weight, targets)[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="frozen"):
        lm_head_logprobs(hidden, weight.requires_grad_(True), targets)


def _tiny_llama(**overrides) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, **overrides)
    return LlamaForCausalLM(config).requires_grad_(False)


def test_fused_head_weight_only_for_a_plain_frozen_linear_head():
    model = _tiny_llama()
    assert fused_head_weight(model) is model.lm_head.weight
    tied = _tiny_llama(tie_word_embeddings=True)
    assert fused_head_weight(tied) is tied.model.embed_tokens.weight
    capped = _tiny_llama()
    capped.config.final_logit_softcapping = 30.0
    assert fused_head_weight(capped) is None
    biased = _tiny_llama()
    biased.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    assert fused_head_weight(biased) is None
    trained = _tiny_llama()
    trained.lm_head.weight.requires_grad_(True)
    assert fused_head_weight(trained) is None


LOSSES = {  # the entropy bonus, and a KL whose reference is a forward without grad
    "entropy_kl": LossSettings(entropy_coef=0.05, use_kl_loss=True, kl_loss_coef=0.1),
    "plain": LossSettings(),
}


def _actor_run(model_dir, monkeypatch, *, fused: bool):
    from miles.backends.torch import train_model as model_module

    monkeypatch.setattr(model_module, "FUSED_HEAD_MIN_LOGITS", 0 if fused else float("inf"))
    monkeypatch.setattr(model_module, "WINDOW_MIN_SKIPPED_LOGITS", 0)  # the tiny vocabulary is below it
    actor = new_actor(model_dir, n_slots=2)
    assert fused_head_weight(actor.model.module) is not None
    for slot, name in enumerate(LOSSES):
        actor.load_adapter(spec(name, slot, loss=LOSSES[name], lr=0.05, global_batch_size=6))
    seen = []
    for step in range(2):  # the second step trains away from the base, so the KL is live
        groups = [g for slot, name in enumerate(LOSSES) for g in make_groups(name, slot, 2, 3, seed=7 + step + slot)]
        samples, adv = flatten_with_advantages(groups)
        stats = actor.train(samples, adv, counts(samples))
        grads = [g.clone() for slot in range(2) for g in actor.core.optimizer.slot_grads(slot)]
        actor.step_adapters(list(LOSSES))
        seen.append((stats, grads, actor.logprobs(samples)))
    return seen


def test_the_actor_with_the_fused_head_trains_as_with_the_models_head(tiny_model_dir, monkeypatch):
    """Loss sums, gradients and logprobs of a train rank are those of the model's own head
    (fp32, response window, entropy bonus, KL to the reference)."""
    fused = _actor_run(tiny_model_dir, monkeypatch, fused=True)
    plain_run = _actor_run(tiny_model_dir, monkeypatch, fused=False)
    for (stats_f, grads_f, logp_f), (stats_p, grads_p, logp_p) in zip(fused, plain_run):
        for name in LOSSES:
            for field in dataclasses.fields(stats_f[name]):
                assert getattr(stats_f[name], field.name) == pytest.approx(getattr(stats_p[name], field.name), abs=1e-6)
        assert max(float((f - p).abs().max()) for f, p in zip(grads_f, grads_p)) <= 1e-6
        assert max(float(g.abs().max()) for g in grads_f) > 1e-4  # a real gradient
        for f, p in zip(logp_f, logp_p):
            torch.testing.assert_close(torch.tensor(f), torch.tensor(p), atol=1e-6, rtol=1e-6)
