"""Activation recomputation (`--recompute-granularity full`): the same gradients as keeping
every activation, the layers really run twice, and the replay sees the forward's slots."""

from __future__ import annotations

import threading

import pytest
import torch
from torch_backend_data import counts, flatten_with_advantages, make_groups, spec
from transformers import AutoModelForCausalLM

from miles.backends.lora import init_slot, inject_multi_lora, lora_modules, use_slots
from miles.backends.torch.actor import TorchTrainActor, TrainActorConfig
from miles.backends.torch.recompute import decoder_layers, recompute_decoder_layers


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


@pytest.mark.parametrize("method, num_layers, recomputed", [("uniform", None, "all"), ("block", 1, "first")])
def test_recompute_gives_the_same_losses_and_steps_and_runs_the_layers_again(tiny_model_dir, method, num_layers,
                                                                              recomputed):
    keep = _actor(tiny_model_dir)
    again = _actor(tiny_model_dir, recompute_granularity="full", recompute_method=method,
                   recompute_num_layers=num_layers)
    calls = _count_attention_calls(again.model)
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
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        model.requires_grad_(False)
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
    calls = _count_attention_calls(actor.model)
    samples, _ = flatten_with_advantages(make_groups("a", 0, 1, 2, seed=5))
    logprobs = actor.logprobs(samples)
    assert len(logprobs) == len(samples)
    assert calls == [1] * len(calls)
