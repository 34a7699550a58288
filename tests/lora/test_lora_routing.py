"""Slot routing: KV-cache decode, activation checkpointing, nesting, threads, bad input.

    .venv/bin/pytest -q tests/lora/test_lora_routing.py
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.lora import (
    MultiLoRALinear,
    init_slot,
    inject_multi_lora,
    lora_modules,
    set_slot_weights,
    slot_parameters,
    use_slots,
)


@pytest.fixture(scope="module")
def base_model(tiny_qwen2_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()


def random_slots(base, slots=(0, 1, 2), *, n_slots=3, max_rank=4, seed=0):
    """A multi-LoRA copy of `base` with nonzero random adapters in `slots`."""
    model = copy.deepcopy(base)
    inject_multi_lora(model, n_slots=n_slots, max_rank=max_rank, target_modules="all-linear")
    gen = torch.Generator().manual_seed(seed)
    for slot in slots:
        rank = max_rank - slot % max_rank
        init_slot(model, slot, rank=rank, alpha=2.0 * rank, generator=gen)
        with torch.no_grad():
            for module in lora_modules(model).values():
                module.lora_B[slot, :, :rank].copy_(torch.randn(module.out_features, rank, generator=gen) * 0.1)
    return model


def test_kv_cache_decode_matches_full_forward(base_model):
    model = random_slots(base_model)
    slots = [2, -1, 0, 1]
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, 90, (4, 6), generator=gen)
    steps = torch.randint(4, 90, (4, 3), generator=gen)
    with torch.no_grad(), use_slots(model, slots):
        out = model(prompt, use_cache=True)
        past, decoded = out.past_key_values, []
        for t in range(steps.shape[1]):
            out = model(steps[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            decoded.append(out.logits[:, -1])
        full = model(torch.cat([prompt, steps], dim=1)).logits
    for t, logits_step in enumerate(decoded):
        torch.testing.assert_close(logits_step, full[:, prompt.shape[1] + t], atol=1e-5, rtol=0)
    with torch.no_grad():
        base_full = base_model(torch.cat([prompt, steps], dim=1)).logits
    torch.testing.assert_close(full[1], base_full[1], atol=1e-5, rtol=0)


def slot_grads(model, ids, slots, *, backward_inside: bool = True):
    model.zero_grad(set_to_none=True)
    with use_slots(model, slots):
        loss = model(ids).logits.float().logsumexp(-1).mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return [p.grad.clone() for p in slot_parameters(model)]


def test_activation_checkpointing_gives_the_same_gradients(base_model):
    model = random_slots(base_model)
    model.train()
    ids = torch.randint(4, 90, (3, 8), generator=torch.Generator().manual_seed(4))
    plain = slot_grads(model, ids, [0, 2, 0])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = slot_grads(model, ids, [0, 2, 0])
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_nested_blocks_restore_and_models_do_not_share_slots(base_model):
    model = random_slots(base_model)
    other = random_slots(base_model, seed=9)
    ids = torch.randint(4, 90, (2, 5), generator=torch.Generator().manual_seed(5))

    def run(m):
        with torch.no_grad():
            return m(ids).logits

    with use_slots(model, [0, 0]):
        expected_0 = run(model)
    with use_slots(model, torch.tensor([1, 1])):
        expected_1 = run(model)
    with use_slots(model, [0, 0]):
        with use_slots(other, [2, 2]):
            with use_slots(model, [1, 1]):
                assert torch.equal(run(model), expected_1)
            assert torch.equal(run(model), expected_0)  # restored after the inner block
            assert not torch.equal(run(other), run(base_model))
        assert torch.equal(run(other), run(base_model))  # other's block is closed
        twin = copy.deepcopy(model)  # a copy is routed by its own blocks only
        assert torch.equal(run(twin), run(base_model))
        with use_slots(twin, [1, 1]):
            assert torch.equal(run(twin), expected_1) and torch.equal(run(model), expected_0)
    assert torch.equal(run(model), run(base_model))


def test_threads_see_their_own_slots(base_model):
    model = random_slots(base_model)
    ids = torch.randint(4, 90, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = {}
        for slot in (-1, 0, 1, 2):
            with use_slots(model, [slot]):
                expected[slot] = model(ids).logits
    barrier = threading.Barrier(4)
    results: dict[int, list[bool]] = {}

    def worker(slot: int) -> None:
        with torch.no_grad(), use_slots(model, [slot]):
            barrier.wait()  # all four blocks are open at once
            results[slot] = [torch.equal(model(ids).logits, expected[slot]) for _ in range(3)]

    threads = [threading.Thread(target=worker, args=(slot,)) for slot in (-1, 0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {slot: [True, True, True] for slot in (-1, 0, 1, 2)}


def test_bad_input_raises_clear_errors(base_model):
    model = copy.deepcopy(base_model)
    with pytest.raises(ValueError, match="inject_multi_lora"):
        with use_slots(model, [0]):
            pass
    with pytest.raises(ValueError, match="match no nn.Linear"):
        inject_multi_lora(copy.deepcopy(base_model), n_slots=2, max_rank=4, target_modules="q_proj,qq_proj")
    names = inject_multi_lora(model, n_slots=2, max_rank=4, target_modules="q_proj, v_proj")
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert all(isinstance(m, MultiLoRALinear) for m in lora_modules(model).values())
    with pytest.raises(ValueError, match="called once"):
        inject_multi_lora(model, n_slots=2, max_rank=4, target_modules="all-linear")
    with pytest.raises(ValueError, match="2 slots"):
        with use_slots(model, [2]):
            pass
    with pytest.raises(ValueError, match=">= -1"):
        with use_slots(model, [-2]):
            pass
    with pytest.raises(ValueError, match="max_rank=4"):
        init_slot(model, 0, rank=5, alpha=1.0)
    with pytest.raises(ValueError, match="one slot id per sample"):
        with torch.no_grad(), use_slots(model, [0, 1, 0]):
            model(torch.zeros(2, 3, dtype=torch.long))
    bad_shape = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(3, 7),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 3),
    }
    with pytest.raises(ValueError, match="expected lora_A"):
        set_slot_weights(model, 0, bad_shape, rank=3, alpha=1.0)
    unwrapped = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(3, 64)}
    with pytest.raises(ValueError, match="match no multi-LoRA layer"):
        set_slot_weights(model, 0, unwrapped, rank=3, alpha=1.0)


def test_lora_follows_the_base_dtype(base_model):
    model = copy.deepcopy(base_model).to(torch.bfloat16)
    inject_multi_lora(model, n_slots=2, max_rank=4, target_modules="all-linear")
    init_slot(model, 1, rank=3, alpha=4.0, generator=torch.Generator().manual_seed(0))
    assert {p.dtype for p in slot_parameters(model)} == {torch.bfloat16}
    for module in lora_modules(model).values():  # alpha / rank is not rounded to bf16
        assert module.scaling.dtype == torch.float32 and abs(module.scaling[1].item() - 4.0 / 3.0) < 1e-7
    assert all(p.requires_grad for p in slot_parameters(model))
    ids = torch.randint(4, 90, (2, 4), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), use_slots(model, [1, -1]):
        assert model(ids).logits.dtype == torch.bfloat16
