"""A slot LoRA on the unembedding (`--lora-unembed`): the fused head with it equals plain
PyTorch in values and in every gradient; an adapter with it trains in a mixed batch as alone;
PEFT and the builtin engine load what the trainer exports and give the trainer's logprobs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.actor import TorchTrainActor
from miles.backends.torch.lm_head import fused_head_weight, head_lora_layer, lm_head_logprobs, slot_head_lora
from miles.lora import MultiLoRALinear, use_slots, write_peft_dir
from miles.utils.types.client import AdamStep
from miles.utils.types.client_commands import LoraGroup
from tests.helpers.torch_backend_data import (
    client_datums,
    client_work,
    counts,
    flatten_with_advantages,
    make_groups,
    max_abs_diff,
    spec,
)

VOCAB, HIDDEN, RANK = 50, 16, 4
HEAD_TARGETS = "all-linear,lm_head"
ADAM = AdamStep(learning_rate=0.02, beta1=0.8, beta2=0.9, eps=1e-4, weight_decay=0.1, grad_clip_norm=0.5)


def head_layer(seed: int = 0) -> MultiLoRALinear:
    """A head of 3 slots with trained-looking adapters (B nonzero) of ranks 4, 2 and 3."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
    layer = MultiLoRALinear(base, n_slots=3, max_rank=RANK)
    for slot, (rank, alpha) in enumerate([(4, 8.0), (2, 3.0), (3, 12.0)]):
        layer.set_slot(slot, torch.randn(rank, HIDDEN, generator=g) * 0.3, torch.randn(VOCAB, rank, generator=g) * 0.3,
                       alpha=alpha)
    return layer


def reference(layer: MultiLoRALinear, hidden_BTH, slots, targets_BT):
    """Plain PyTorch: each row's logits h W^T + alpha / r (h A^T) B^T of its slot."""
    rows = []
    for b, slot in enumerate(slots):
        logits = hidden_BTH[b] @ layer.base.weight.t()
        if slot >= 0:
            r = layer.ranks[slot]
            a, b_ = layer.lora_A[slot, :r], layer.lora_B[slot, :, :r]
            logits = logits + (hidden_BTH[b] @ a.t()) @ b_.t() * (layer.alphas[slot] / r)
        rows.append(logits)
    logp = torch.log_softmax(torch.stack(rows).float(), dim=-1)
    return logp.gather(-1, targets_BT[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("rows_per_chunk", [1, 4, 1000])
@pytest.mark.parametrize("entropy", [False, True])
def test_the_fused_head_with_slot_lora_equals_plain_pytorch(rows_per_chunk, entropy):
    g = torch.Generator().manual_seed(1)
    slots = [0, -1, 2, 0, 1]
    hidden = torch.randn(5, 7, HIDDEN, generator=g)
    targets = torch.randint(0, VOCAB, (5, 7), generator=g)
    coef_a, coef_b = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)

    def run(fused: bool):
        layer = head_layer()
        h = hidden.clone().requires_grad_(True)
        if fused:
            out = lm_head_logprobs(h, layer.base.weight, targets, entropy=True, chunk_logits=rows_per_chunk * VOCAB,
                                   lora=slot_head_lora(layer, h, slots))
        else:
            out = reference(layer, h, slots, targets)
        loss = (coef_a * out[0]).sum() + ((coef_b * out[1]).sum() if entropy else 0)
        loss.backward()
        return out, h.grad, layer.lora_A.grad, layer.lora_B.grad

    (logp, ent), *grads = run(fused=True)
    (logp_ref, ent_ref), *grads_ref = run(fused=False)
    torch.testing.assert_close(logp, logp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    for got, want in zip(grads, grads_ref):  # hidden states, every slot's A and B
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert grads[2][2].abs().max() > 1e-3 and torch.count_nonzero(grads[2][2][:, 3:]) == 0  # rank 3 of 4: no padding


def test_no_slot_rows_are_the_plain_fused_head():
    layer = head_layer()
    hidden = torch.randn(2, 3, HIDDEN)
    assert slot_head_lora(layer, hidden, [-1, -1]) is None
    with pytest.raises(ValueError, match="3 slots for 2 rows"):
        slot_head_lora(layer, hidden, [0, 1, 2])


def head_actor(model_dir, *, micro_batch_size: int | None = None) -> TorchTrainActor:
    return TorchTrainActor(TrainActorConfig(hf_checkpoint=str(model_dir), n_slots=4, lora_rank=4,
                                            target_modules=HEAD_TARGETS, micro_batch_size=micro_batch_size))


@pytest.mark.parametrize("fused", [True, False])
def test_a_head_lora_adapter_in_a_mixed_batch_equals_it_trained_alone(tiny_model_dir, monkeypatch, fused):
    from miles.backends.torch import train_model as model_module

    monkeypatch.setattr(model_module, "FUSED_HEAD_MIN_LOGITS", 0 if fused else float("inf"))
    mixed, alone = head_actor(tiny_model_dir, micro_batch_size=5), head_actor(tiny_model_dir)
    layer = head_lora_layer(mixed.core.model.module)
    assert layer is not None and fused_head_weight(mixed.core.model.module) is layer.base.weight
    mixed.load_adapter(spec("rl", 0, global_batch_size=4))  # a server-driven adapter trains lm_head LoRA too
    mixed.load_adapter(spec("no-head", 1, seed=4, frozen=frozenset({LoraGroup.UNEMBED})))
    mixed.load_adapter(spec("head", 2, seed=3))
    alone.load_adapter(spec("head", 0, seed=3))
    for step in range(2):
        head_data, other = client_datums("cross_entropy", 4, seed=step), client_datums("ppo", 3, seed=10 + step)
        samples, adv = flatten_with_advantages(make_groups("rl", 0, 2, 2, seed=30 + step))
        result = mixed.train_batch(samples, adv, counts(samples), client=[
            client_work("no-head", 1, other, "ppo"), client_work("head", 2, head_data, "cross_entropy")])
        result_alone = alone.train_batch([], [], {}, client=[client_work("head", 0, head_data, "cross_entropy")])
        for got, want in zip(result.client[1], result_alone.client[0]):
            assert got.outputs["logprobs"] == pytest.approx(want.outputs["logprobs"], abs=1e-5)
            assert got.loss == pytest.approx(want.loss, abs=1e-5)
        stats = mixed.step_adapters(["rl", "no-head", "head"], adam={"no-head": ADAM, "head": ADAM})
        stats_alone = alone.step_adapters(["head"], adam={"head": ADAM})
        assert stats["head"].grad_norm == pytest.approx(stats_alone["head"].grad_norm, abs=1e-5)
    trained = mixed.export_adapter("head")
    assert max_abs_diff(trained, alone.export_adapter("head")) <= 1e-5
    assert trained["base_model.model.lm_head.lora_B.weight"].abs().max() > 1e-3  # the head's LoRA learned
    assert mixed.export_adapter("rl")["base_model.model.lm_head.lora_B.weight"].abs().max() > 1e-3
    assert torch.count_nonzero(layer.lora_B[1]) == 0  # train_unembed=False: the base head, exactly
    assert not any("lm_head" in k for k in mixed.export_adapter("no-head"))


def trained_head_actor(model_dir):
    actor = head_actor(model_dir)
    actor.load_adapter(spec("head", 1, seed=5))
    for step in range(3):
        actor.train_batch([], [], {}, client=[client_work("head", 1, client_datums("cross_entropy", 4, seed=step),
                                                          "cross_entropy")])
        actor.step_adapters(["head"], adam={"head": AdamStep(learning_rate=0.05)})
    return actor


def test_peft_loads_the_head_lora_export_and_gives_the_trainers_logprobs(tiny_model_dir, tmp_path):
    actor = trained_head_actor(tiny_model_dir)
    spec_ = actor.core.loaded("head").spec
    config = actor.core.peft_config(spec_)
    assert "lm_head" in config["target_modules"]
    out = write_peft_dir(tmp_path / "adapter", actor.export_adapter("head"), config)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), out).eval()
    ids = torch.randint(4, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    model = actor.core.model.module
    with torch.no_grad(), use_slots(model, [1, 1]):
        ours = model(ids).logits
    with torch.no_grad():
        theirs, plain = peft_model(ids).logits, base(ids).logits
    assert (theirs - plain).abs().max() > 1e-2
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # the trainer's own logprobs (through the fused head) of a response, and PEFT's
    samples, _ = flatten_with_advantages(make_groups("head", 1, 2, 2, seed=6))
    for sample, trainer in zip(samples, actor.logprobs(samples)):
        tokens = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(peft_model(tokens).logits[0].float(), -1)
        n = len(sample.response_ids)
        want = logp[-n - 1 : -1].gather(-1, tokens[0, -n:, None]).squeeze(-1)
        assert trainer == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_builtin_engine_decodes_with_the_head_lora_as_the_trainer_scores(tiny_model_dir, tmp_path):
    from miles.rollout.engines.builtin_engine import BuiltinEngine, EngineOptions
    from miles.utils.types.engine_api import GenerateRequest, LoadLoraRequest, SamplingParams

    actor = trained_head_actor(tiny_model_dir)
    adapter = write_peft_dir(tmp_path / "head", actor.export_adapter("head"),
                             actor.core.peft_config(actor.core.loaded("head").spec))
    engine = BuiltinEngine(EngineOptions(model_path=str(tiny_model_dir), max_loras_per_batch=2, max_lora_rank=4,
                                         lora_target_modules=HEAD_TARGETS, dtype="float32", device="cpu"))
    await engine.start()
    try:
        await engine.load_lora(LoadLoraRequest(lora_name="head", lora_path=str(adapter)))
        prompts = [[5, 9, 13, 2, 30], [7, 7, 40]]
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        outs = await engine.generate(GenerateRequest(input_ids=prompts, sampling_params=greedy,
                                                     lora_path=["head", None], return_logprob=True))
        base = await engine.generate(GenerateRequest(input_ids=prompts[0], sampling_params=greedy,
                                                     return_logprob=True))
    finally:
        engine.stop()
    assert isinstance(outs, list) and not isinstance(base, list)
    assert outs[0].output_ids != base.output_ids  # the adapter's head changes what is decoded
    (template,), _ = flatten_with_advantages(make_groups("head", 1, 1, 1, seed=0))
    scored = [dataclasses.replace(template, prompt_ids=prompt, response_ids=out.output_ids, slot=slot,
                                  adapter="head", rollout_logprobs=[0.0] * len(out.output_ids))
              for prompt, out, slot in zip(prompts, outs, [1, -1])]
    model = actor.core.model.module
    for sample, out, logprobs in zip(scored, outs, actor.logprobs(scored)):
        engine_logprobs = [lp for lp, _, _ in out.meta_info.output_token_logprobs]
        assert engine_logprobs == pytest.approx(logprobs, abs=1e-5)
        tokens = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad(), use_slots(model, [sample.slot]):
            logits = model(tokens).logits[0]
        n = len(sample.response_ids)  # greedy: every token is the trainer's most likely one
        assert logits[-n - 1 : -1].argmax(-1).tolist() == sample.response_ids
