"""Activation recomputation: `--recompute-granularity full` gives the same gradients as
keeping every activation, the layers really run twice, and the replay sees the forward's
slots; `selective` gives the same bits while the norm outputs and gated activations hold
no memory between the forward and the backward."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.actor import TorchTrainActor
from miles.backends.torch.recompute import decoder_layers, recompute_decoder_layers, release_cheap_activations
from miles.lora import init_slot, inject_multi_lora, lora_modules, use_slots
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, make_groups, spec


def _actor(model_dir, **recompute) -> TorchTrainActor:
    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint=str(model_dir), n_slots=4, lora_rank=4, **recompute))
    for name, slot, rank in (("a", 0, 4), ("b", 1, 2), ("c", 3, 3)):
        actor.load_adapter(spec(name, slot, rank=rank))
    return actor


def _count_attention_calls(model) -> list[int]:
    calls = [0] * len(decoder_layers(model))
    for i, layer in enumerate(decoder_layers(model)):
        layer.self_attn.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _with_three_trainable_slots(model):
    """A frozen base in eval mode with LoRA on every linear: slots 0-2 of rank 4, B nonzero."""
    model.eval().requires_grad_(False)
    inject_multi_lora(model, n_slots=3, max_rank=4, target_modules="all-linear")
    gen = torch.Generator().manual_seed(3)
    for slot in range(3):
        init_slot(model, slot, rank=4, alpha=8.0, generator=gen)
        with torch.no_grad():
            for module in lora_modules(model).values():
                module.lora_B[slot].normal_(0, 0.1, generator=gen)
    for module in lora_modules(model).values():
        module.lora_A.requires_grad_(True)
        module.lora_B.requires_grad_(True)
    return model


@pytest.mark.parametrize("method, num_layers, recomputed", [("uniform", None, "all"), ("block", 1, "first")])
def test_recompute_gives_the_same_losses_and_steps_and_runs_the_layers_again(tiny_model_dir, method, num_layers,
                                                                              recomputed):
    keep = _actor(tiny_model_dir)
    again = _actor(tiny_model_dir, recompute_granularity="full", recompute_method=method,
                   recompute_num_layers=num_layers)
    calls = _count_attention_calls(again.model.module)
    for step in range(2):
        groups = [g for trio in zip(make_groups("a", 0, 2, 2, seed=step), make_groups("b", 1, 2, 2, seed=10 + step),
                                    make_groups("c", 3, 2, 2, seed=20 + step)) for g in trio]
        samples, adv = flatten_with_advantages(groups)
        want, got = keep.train(samples, adv, counts(samples)), again.train(samples, adv, counts(samples))
        for name in ("a", "b", "c"):
            assert got[name].loss_sum == pytest.approx(want[name].loss_sum, abs=1e-6)
        want_steps, got_steps = keep.step_adapters(["a", "b", "c"]), again.step_adapters(["a", "b", "c"])
        for name in ("a", "b", "c"):
            assert got_steps[name].grad_norm == pytest.approx(want_steps[name].grad_norm, rel=1e-5)
            assert want_steps[name].grad_norm > 0
    for name in ("a", "b", "c"):
        for key, tensor in keep.export_adapter(name).items():
            torch.testing.assert_close(again.export_adapter(name)[key], tensor, atol=1e-6, rtol=0)
    # Each train call: one forward, plus one replay per recomputed layer in the backward.
    expected = [4] * len(calls) if recomputed == "all" else [4] + [2] * (len(calls) - 1)
    assert calls == expected


def test_the_replay_routes_each_sample_through_its_forward_slot_from_another_thread(tiny_model_dir):
    """backward() outside the `use_slots` block, on a thread that never entered one: the
    recomputed layers still see the forward's slots (the autograd engine may replay on its
    own thread, where the caller's context is not visible)."""

    def model_with_slots(recompute: bool):
        model = _with_three_trainable_slots(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
        if recompute:
            assert recompute_decoder_layers(model) == len(decoder_layers(model))
        return model

    ids = torch.randint(3, 100, (4, 9), generator=torch.Generator().manual_seed(4))
    grads = []
    for recompute in (False, True):
        model = model_with_slots(recompute)
        with use_slots(model, [2, -1, 0, 2]):
            loss = model(input_ids=ids, use_cache=False).logits.square().mean()
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
        grads.append([m.lora_B.grad.clone() for m in lora_modules(model).values()])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert want[1].abs().max() == 0  # slot 1 is in no row: no gradient
        assert want[2].abs().max() > 0


def test_forward_without_gradients_does_not_recompute(tiny_model_dir):
    actor = _actor(tiny_model_dir, recompute_granularity="full")
    calls = _count_attention_calls(actor.model.module)
    samples, _ = flatten_with_advantages(make_groups("a", 0, 1, 2, seed=5))
    logprobs = actor.logprobs(samples)
    assert len(logprobs) == len(samples)
    assert calls == [1] * len(calls)


def _groups(step: int):
    groups = [g for trio in zip(make_groups("a", 0, 2, 2, seed=step), make_groups("b", 1, 2, 2, seed=10 + step),
                                make_groups("c", 3, 2, 2, seed=20 + step)) for g in trio]
    return flatten_with_advantages(groups)


@pytest.mark.parametrize("micro_batch_size, modules", [(None, None), (4, None), (None, ("layernorm", "mlp")),
                                                      (4, ("mlp",)), (None, ("core_attn",))])
def test_selective_gives_the_same_bits_as_keeping_every_activation(tiny_model_dir, micro_batch_size, modules):
    keep = _actor(tiny_model_dir, micro_batch_size=micro_batch_size)
    lean = _actor(tiny_model_dir, micro_batch_size=micro_batch_size, recompute_granularity="selective",
                  recompute_modules=modules)
    for step in range(2):
        samples, adv = _groups(step)
        want, got = keep.train(samples, adv, counts(samples)), lean.train(samples, adv, counts(samples))
        assert {n: s.loss_sum for n, s in got.items()} == {n: s.loss_sum for n, s in want.items()}
        want_steps, got_steps = keep.step_adapters(["a", "b", "c"]), lean.step_adapters(["a", "b", "c"])
        for name in ("a", "b", "c"):
            assert got_steps[name].grad_norm == want_steps[name].grad_norm > 0
    for name in ("a", "b", "c"):
        for key, tensor in keep.export_adapter(name).items():
            assert torch.equal(lean.export_adapter(name)[key], tensor), key
    assert lean.logprobs(samples) == keep.logprobs(samples)


def _lora_llama(hidden_act: str, *, lean: bool, tiny_model_dir=None, modules=("layernorm",)):
    """A 2-layer Llama (from the tiny base, or random with another activation) with 3 slots."""
    if tiny_model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, hidden_act=hidden_act))
    _with_three_trainable_slots(model)
    if lean:
        assert release_cheap_activations(model, modules=modules) == len(decoder_layers(model))
    return model


def _saved_bytes_at_forward_end(model, ids, slots) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd holds for the backward once the forward is
    done, and the loss."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with use_slots(model, slots):
            loss = model(input_ids=ids, use_cache=False).logits.square().mean()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in saved if t.untyped_storage().nbytes()}
    return sum(storages.values()), loss


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("slots", [[0, 0, 2, 2], [2, -1, 0, 2]], ids=["grouped", "gathered"])
def test_selective_frees_the_norm_outputs_and_gated_activations_until_the_backward(tiny_model_dir, hidden_act, slots):
    """Between the forward and the backward the selective model holds, per token and layer,
    two norm outputs (2 x hidden) and, for a SiLU-gated MLP, silu(gate) and its product with
    up (2 x intermediate) fewer floats where the LoRA layers keep their inputs as they are (a
    batch sorted by slot with equal counts); the backward forms them again, same
    gradients either way."""
    ids = torch.randint(3, 100, (4, 9), generator=torch.Generator().manual_seed(4))
    source = tiny_model_dir if hidden_act == "silu" else None
    held, grads = [], []
    for lean in (False, True):
        model = _lora_llama(hidden_act, lean=lean, tiny_model_dir=source)
        nbytes, loss = _saved_bytes_at_forward_end(model, ids, slots)
        loss.backward()
        held.append(nbytes)
        grads.append([(m.lora_A.grad, m.lora_B.grad) for m in lora_modules(model).values()])
    config, silu = model.config, hidden_act == "silu"
    if slots == [0, 0, 2, 2]:
        per_token_layer = 2 * config.hidden_size + (2 * config.intermediate_size if silu else 0)
    else:  # the LoRA layers keep gathered copies of their inputs: only silu(gate) is spared
        per_token_layer = config.intermediate_size if silu else 0
    assert held[0] - held[1] == ids.numel() * config.num_hidden_layers * per_token_layer * 4
    for (want_a, want_b), (got_a, got_b) in zip(*grads):
        assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b)
        assert want_b.abs().max() > 0


def test_recomputed_mlp_holds_no_gate_or_up_and_runs_again_in_the_backward(tiny_model_dir):
    """--recompute-modules layernorm mlp: the MLP with its norm keeps only the residual, so
    gate and up (2 x intermediate floats a token and layer) are not held; the MLP runs twice
    with gradients, once without; same gradients bit for bit."""
    ids = torch.randint(3, 100, (4, 9), generator=torch.Generator().manual_seed(4))
    held, grads, calls = [], [], []
    for modules in (("layernorm",), ("layernorm", "mlp")):
        model = _lora_llama("silu", lean=True, tiny_model_dir=tiny_model_dir, modules=modules)
        counted = [0]
        for layer in decoder_layers(model):
            # A pre-hook: the replay stops once down_proj has saved its inputs, before forward hooks.
            layer.mlp.down_proj.register_forward_pre_hook(lambda *_: counted.__setitem__(0, counted[0] + 1))
        nbytes, loss = _saved_bytes_at_forward_end(model, ids, [0, 0, 2, 2])
        loss.backward()
        with torch.no_grad(), use_slots(model, [0, 0, 2, 2]):
            model(input_ids=ids, use_cache=False)
        held.append(nbytes)
        calls.append(counted[0])
        grads.append([(m.lora_A.grad, m.lora_B.grad) for m in lora_modules(model).values()])
    config, layers = model.config, model.config.num_hidden_layers
    assert held[0] - held[1] >= ids.numel() * layers * 2 * config.intermediate_size * 4
    assert calls == [2 * layers, 3 * layers]  # with grad and without; with mlp the backward runs it again
    for (want_a, want_b), (got_a, got_b) in zip(*grads):
        assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b)
        assert want_b.abs().max() > 0


def test_selective_forward_without_gradients_keeps_nothing_pending(tiny_model_dir):
    keep = _lora_llama("silu", lean=False, tiny_model_dir=tiny_model_dir)
    lean = _lora_llama("silu", lean=True, tiny_model_dir=tiny_model_dir)
    ids = torch.randint(3, 100, (3, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with use_slots(keep, [0, 1, 2]):
            want = keep(input_ids=ids, use_cache=False).logits
        with use_slots(lean, [0, 1, 2]):
            got = lean(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want)
    nbytes, loss = _saved_bytes_at_forward_end(lean, ids, [0, 1, 2])
    assert nbytes > 0 and loss.requires_grad


def test_selective_changes_the_sequential_pre_norm_layers_only():
    """Qwen2's layers are Llama's shape (same bits); Gemma's read other norms around the
    blocks, so its layers run as before."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=8))
    assert release_cheap_activations(gemma) == 0
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(6))
    grads = []
    for lean in (False, True):
        torch.manual_seed(0)
        qwen = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
        qwen.model.embed_tokens.weight.requires_grad_(False)
        if lean:
            assert release_cheap_activations(qwen) == 2
        qwen(input_ids=ids, use_cache=False).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in qwen.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name
