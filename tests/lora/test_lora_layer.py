"""The slot page-table layer against PEFT and against itself (CPU, fp32, tiny models).

    .venv/bin/pytest -q tests/lora
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from miles.lora import (
    MultiLoRALinear,
    clear_slot,
    get_slot_weights,
    init_slot,
    inject_multi_lora,
    lora_modules,
    set_delta_mode,
    set_slot_weights,
    slot_parameters,
    use_slots,
)
from tests.helpers.kernel_or_skip import rowwise_kernel_or_skip

N_SLOTS = 4
MAX_RANK = 8
ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base_model(request, tiny_model_dir, tiny_qwen2_dir):
    path = tiny_model_dir if request.param == "llama" else tiny_qwen2_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


def peft_reference(base, *, rank: int, alpha: float, seed: int, targets="all-linear"):
    """A PEFT LoRA with random A and B (PEFT starts B at zero, which would test nothing)."""
    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    ).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return peft_model


def multi_lora_copy(base, target_modules="all-linear"):
    model = copy.deepcopy(base)
    inject_multi_lora(model, n_slots=N_SLOTS, max_rank=MAX_RANK, target_modules=target_modules)
    return model


def per_row_reference(layers: torch.nn.Sequential, weights: dict, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Each row through the layers on its own: base, plus its slot's (x A^T) B^T x scale
    (`weights[layer index, slot]` = (A, B, scale)) unless its slot is -1."""

    def one_row(row: torch.Tensor, slot: int) -> torch.Tensor:
        for index, layer in enumerate(layers):
            out = layer.base(row)
            if slot >= 0:
                a, b, scale = weights[index, slot]
                out = out + (row @ a.T) @ b.T * scale
            row = out
        return row

    return torch.stack([one_row(x[i], s) for i, s in enumerate(slots)])


def logits(model, input_ids, slots=None):
    with torch.no_grad():
        if slots is None:
            return model(input_ids).logits
        with use_slots(model, slots):
            return model(input_ids).logits


def input_batch(batch: int, seq: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 90, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rank", [3, MAX_RANK])
def test_slot_matches_peft(base_model, rank):
    peft_model = peft_reference(base_model, rank=rank, alpha=2.0 * rank + 1, seed=rank)
    model = multi_lora_copy(base_model)
    set_slot_weights(model, 2, get_peft_model_state_dict(peft_model), rank=rank, alpha=2.0 * rank + 1)
    ids = input_batch(3)
    expected = logits(peft_model, ids)
    assert (expected - logits(base_model, ids)).abs().max() > 1e-2  # the adapter matters
    for mode in ("segment", "gather"):
        set_delta_mode(model, mode)
        torch.testing.assert_close(logits(model, ids, [2, 2, 2]), expected, atol=ATOL, rtol=0)
    # Components past the adapter's rank stay exactly zero.
    for module in lora_modules(model).values():
        assert module.lora_A[2, rank:].abs().sum() == 0 and module.lora_B[2, :, rank:].abs().sum() == 0


def test_mixed_batch_equals_single_adapter_forwards(base_model):
    model = multi_lora_copy(base_model)
    references = {}
    for slot, rank in zip(range(N_SLOTS), (2, 8, 5, 1)):
        peft_model = peft_reference(base_model, rank=rank, alpha=2.0 * rank, seed=10 + slot)
        set_slot_weights(model, slot, get_peft_model_state_dict(peft_model), rank=rank, alpha=2.0 * rank)
        references[slot] = peft_model
    slots = [3, 0, -1, 2, 1, 0, -1, 3]
    ids = input_batch(len(slots), seed=1)
    alone = torch.cat([logits(model, ids[row : row + 1], [slot]) for row, slot in enumerate(slots)])
    by_peft = torch.cat(
        [logits(base_model if slot < 0 else references[slot], ids[row : row + 1]) for row, slot in enumerate(slots)]
    )
    torch.testing.assert_close(alone, by_peft, atol=ATOL, rtol=0)
    order = sorted(range(len(slots)), key=lambda row: slots[row])
    for mode in ("segment", "gather", "auto"):
        set_delta_mode(model, mode)
        torch.testing.assert_close(logits(model, ids, slots), alone, atol=ATOL, rtol=0)
        # Sorted by slot (as the trainer batches) takes the contiguous-segment path.
        sorted_logits = logits(model, ids[order], [slots[row] for row in order])
        torch.testing.assert_close(sorted_logits, alone[order], atol=ATOL, rtol=0)
    # Outside use_slots the model is the base model, bit for bit.
    assert torch.equal(logits(model, ids), logits(base_model, ids))


def test_gradients_reach_only_present_slots(base_model):
    model = multi_lora_copy(base_model)
    for slot in range(N_SLOTS):
        init_slot(model, slot, rank=4, alpha=8.0, generator=torch.Generator().manual_seed(slot))
        for module in lora_modules(model).values():
            with torch.no_grad():
                module.lora_B[slot, :, :4].normal_(0, 0.1)
    ids = input_batch(4, seed=2)
    grads = {}
    for mode in ("segment", "gather"):
        set_delta_mode(model, mode)
        model.zero_grad(set_to_none=True)
        with use_slots(model, [1, -1, 3, 1]):
            model(ids).logits.pow(2).mean().backward()
        grads[mode] = [p.grad.clone() for p in slot_parameters(model)]
        for p in slot_parameters(model):
            assert p.grad[[0, 2]].abs().sum() == 0  # slots not in the batch
            assert p.grad[[1, 3], :, :].abs().sum() > 0
            if p.shape[1] == MAX_RANK:  # lora_A: rows past the rank get no gradient
                assert p.grad[:, 4:].abs().sum() == 0
            else:
                assert p.grad[:, :, 4:].abs().sum() == 0
    for g_seg, g_gat in zip(grads["segment"], grads["gather"]):
        torch.testing.assert_close(g_seg, g_gat, atol=1e-6, rtol=1e-5)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_slot_weights_round_trip_and_clear(base_model):
    model = multi_lora_copy(base_model)
    init_slot(model, 1, rank=5, alpha=10.0, generator=torch.Generator().manual_seed(0))
    weights = get_slot_weights(model, 1)
    assert len(weights) == 2 * len(lora_modules(model))
    a_name = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    assert a_name.startswith("base_model.model.model.layers.0.") and weights[a_name].shape[0] == 5
    assert all(w.abs().sum() == 0 for k, w in weights.items() if "lora_B" in k)
    set_slot_weights(model, 3, weights, rank=5, alpha=10.0)
    for key, value in get_slot_weights(model, 3).items():
        assert torch.equal(value, weights[key])
    weights[a_name].add_(1.0)  # copies: editing them leaves the slot alone
    assert not torch.equal(get_slot_weights(model, 1)[a_name], weights[a_name])
    clear_slot(model, 1)
    for module in lora_modules(model).values():
        assert module.lora_A[1].abs().sum() == 0 and module.scaling[1] == 0 and module.ranks[1] == 0
    with pytest.raises(ValueError, match="empty"):
        get_slot_weights(model, 1)


@pytest.mark.parametrize("slots", [[3, -1, 1, 3, 3], [0, 1, 0, 1], [2, -1, -1, 0, 1, 1], [1, 1, -1],
                                   [0, 0, 2, 2, 3, 3]])
@pytest.mark.parametrize("tokens", [None, 5])
def test_grouped_delta_equals_per_row_reference(slots, tokens):
    """The grouped path (rows gathered per present slot, unequal groups, base-only rows,
    slots that are not 0..P-1, one layer with its own alpha; or a sorted batch of equal
    counts, grouped by a reshape) equals row-by-row math."""
    from miles.lora import MultiLoRALinear

    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)  # the base linears' initial weights
    layers = torch.nn.Sequential(
        MultiLoRALinear(torch.nn.Linear(6, 7), n_slots=4, max_rank=3),
        MultiLoRALinear(torch.nn.Linear(7, 5), n_slots=4, max_rank=3),
    )
    weights = {}
    for index, layer in enumerate(layers):
        for slot, rank in zip(range(4), (1, 3, 2, 3)):
            a = torch.randn(rank, layer.in_features, generator=gen)
            b = torch.randn(layer.out_features, rank, generator=gen)
            alpha = 2.0 * rank + index  # the second layer scales differently: no shared batch scale
            layer.set_slot(slot, a, b, alpha=alpha)
            weights[index, slot] = (a, b, alpha / rank)
    x = torch.randn(len(slots), *(() if tokens is None else (tokens,)), 6, generator=gen)

    expected = per_row_reference(layers, weights, x, slots)
    for mode in ("gather", "segment", "stacked", "auto"):
        for layer in layers:
            layer.delta_mode = mode
        with torch.no_grad(), use_slots(layers, slots):
            torch.testing.assert_close(layers(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [[0, 0, 1, 1], [0, 0, 2, 2, 3, 3]])
def test_grouped_batch_is_one_autograd_node_with_the_segment_paths_gradients(slots):
    """A slot-sorted batch of equal counts runs each layer as one `GroupedLoRALinear` node
    (base and delta); its output and the gradients of the input, A and B equal the segment
    path's, recorded op by op (slots 0..P-1 sliced, or not: copied; a bias on one layer)."""
    from miles.lora import MultiLoRALinear

    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    layers = torch.nn.Sequential(
        MultiLoRALinear(torch.nn.Linear(6, 7), n_slots=4, max_rank=3),
        MultiLoRALinear(torch.nn.Linear(7, 5, bias=False), n_slots=4, max_rank=3),
    )
    for index, layer in enumerate(layers):
        for slot, rank in zip(range(4), (1, 3, 2, 3)):
            layer.set_slot(slot, torch.randn(rank, layer.in_features, generator=gen),
                           torch.randn(layer.out_features, rank, generator=gen), alpha=2.0 * rank + index)
    x = torch.randn(len(slots), 5, 6, generator=gen)
    weight_of_out = torch.randn(len(slots), 5, 5, generator=gen)

    results = {}
    for mode in ("auto", "segment"):
        set_delta_mode(layers, mode)
        layers.zero_grad()
        x_leaf = x.clone().requires_grad_()
        with use_slots(layers, slots):
            out = layers(x_leaf)
        if mode == "auto":
            assert type(out.grad_fn).__name__ == "ViewBackward0"
            assert type(out.grad_fn.next_functions[0][0]).__name__ == "GroupedLoRALinearBackward"
        (out * weight_of_out).sum().backward()
        results[mode] = [out.detach(), x_leaf.grad] + [p.grad for layer in layers for p in (layer.lora_A, layer.lora_B)]
    for grouped, segment in zip(results["auto"], results["segment"]):
        torch.testing.assert_close(grouped, segment, atol=1e-5, rtol=1e-5)
    unused = [s for s in range(4) if s not in slots]
    assert all(torch.count_nonzero(layer.lora_A.grad[unused]) == 0 for layer in layers)


def test_stacked_path_sees_every_write_to_b(base_model):
    """The stacked path keeps B's transpose between decode steps; a slot load and an
    optimizer step must both show in the next forward."""
    from miles.backends.common.optimizer import SlotAdamW

    model = multi_lora_copy(base_model)
    for slot in range(N_SLOTS):
        init_slot(model, slot, rank=4, alpha=8.0, generator=torch.Generator().manual_seed(slot))
    ids = input_batch(4, seq=1, seed=3)
    slots = [2, 0, 2, -1]

    def both_paths() -> tuple[torch.Tensor, torch.Tensor]:
        set_delta_mode(model, "stacked")
        stacked = logits(model, ids, slots)
        set_delta_mode(model, "segment")
        return stacked, logits(model, ids, slots)

    stacked, segment = both_paths()
    torch.testing.assert_close(stacked, segment, atol=ATOL, rtol=0)
    weights = get_slot_weights(model, 2)
    for name in weights:
        if name.endswith("lora_B.weight"):
            weights[name] = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(9)) * 0.1
    set_slot_weights(model, 2, weights, rank=4, alpha=8.0)
    stacked_after_load, segment_after_load = both_paths()
    assert (segment_after_load - segment).abs().max() > 1e-3
    torch.testing.assert_close(stacked_after_load, segment_after_load, atol=ATOL, rtol=0)
    params = [(p, 1 if p.shape[1] == MAX_RANK else 2) for p in slot_parameters(model)]
    opt = SlotAdamW(params, n_slots=N_SLOTS)
    opt.configure_slot(0, rank=4, lr=0.05, weight_decay=0.0)
    for p, _ in params:
        p.grad = torch.ones_like(p)
    opt.step_slot(0, lr=0.05)
    stacked_after_step, segment_after_step = both_paths()
    assert (segment_after_step - segment_after_load).abs().max() > 1e-3
    torch.testing.assert_close(stacked_after_step, segment_after_step, atol=ATOL, rtol=0)


@pytest.mark.parametrize("decode_mode", ["auto", "stacked", "jagged", "rowwise"])
@pytest.mark.parametrize("slots", [[3, -1, 1, 3, 0, 2], [0, 0, 1, 1], [2, -1, -1, 2]])
def test_repeated_decode_steps_equal_the_segment_path(base_model, slots, decode_mode):
    """Decode steps (one token per row, no grad) reuse the stacked, jagged or row-wise
    path's operands from the previous step; they equal the per-slot segment path for mixed
    slots, base-only rows and present slots that are not 0..P-1, and a write to A (slot
    load) or to B between two steps shows in the next one."""
    if decode_mode == "rowwise":
        rowwise_kernel_or_skip()
    model = multi_lora_copy(base_model)
    gen = torch.Generator().manual_seed(5)
    for slot, rank in zip(range(N_SLOTS), (2, 8, 5, 1)):
        init_slot(model, slot, rank=rank, alpha=2.0 * rank + slot, generator=gen)
        with torch.no_grad():
            for module in lora_modules(model).values():
                module.lora_B[slot, :, :rank].copy_(torch.randn(module.out_features, rank, generator=gen) * 0.1)
    layers = list(lora_modules(model).values())
    steps = [input_batch(len(slots), seq=1, seed=seed) for seed in (4, 5)]

    def decode_and_segment(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        set_delta_mode(model, decode_mode)
        decoded = logits(model, ids, slots)
        set_delta_mode(model, "segment")
        return decoded, logits(model, ids, slots)

    first, segment = decode_and_segment(steps[0])
    torch.testing.assert_close(first, segment, atol=ATOL, rtol=0)
    assert (segment - logits(model, steps[0], [-1] * len(slots))).abs().max() > 1e-3  # the adapters matter
    plans = [layer.decode_plan for layer in layers]
    assert all(plan is not None for plan in plans)
    second, segment = decode_and_segment(steps[1])
    torch.testing.assert_close(second, segment, atol=ATOL, rtol=0)
    assert all(layer.decode_plan is plan for layer, plan in zip(layers, plans))  # reused, not rebuilt
    present = max(slots)
    weights = get_slot_weights(model, present)
    for name in weights:
        if name.endswith("lora_A.weight"):
            weights[name] = torch.randn(weights[name].shape, generator=gen) * 0.3
    rank, alpha = lora_modules(model)[next(iter(lora_modules(model)))].ranks[present], 2.0 * 5
    set_slot_weights(model, present, weights, rank=rank, alpha=alpha)  # new A and a new scale
    after_load, segment_after_load = decode_and_segment(steps[1])
    assert (segment_after_load - segment).abs().max() > 1e-3
    torch.testing.assert_close(after_load, segment_after_load, atol=ATOL, rtol=0)
    with torch.no_grad():
        for layer in layers:
            layer.lora_B[present].mul_(-2.0)  # in place, like an optimizer step
    after_step, segment_after_step = decode_and_segment(steps[1])
    assert (segment_after_step - segment_after_load).abs().max() > 1e-3
    torch.testing.assert_close(after_step, segment_after_step, atol=ATOL, rtol=0)


def test_decode_steps_of_many_rows_take_the_jagged_path():
    """Past JAGGED_MIN_SAVED_MACS of work on other slots' columns, auto runs a no-grad
    one-token step through grouped GEMMs over each slot's rows: the stacked path's numbers."""
    from miles.lora.delta.jagged import HAS_GROUPED_MM, jagged_step
    from miles.lora.delta.stacked import stacked_step

    if not HAS_GROUPED_MM:  # the pinned torch (pyproject.toml) has it: `make test` runs this
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm, which hides this test of the jagged "
                    "decode path; run it with the torch pyproject.toml pins (make install)")
    gen = torch.Generator().manual_seed(11)
    layer = MultiLoRALinear(torch.nn.Linear(256, 512, bias=False), n_slots=4, max_rank=16)
    layer.rowwise_decode = False  # the torch paths' choice
    for slot, rank in enumerate((16, 4, 9, 16)):
        layer.set_slot(slot, torch.randn(rank, 256, generator=gen), torch.randn(512, rank, generator=gen),
                       alpha=2.0 * rank + slot)
    slots = torch.randint(-1, 4, (64,), generator=gen).tolist()
    x = torch.randn(64, 1, 256, generator=gen)
    with torch.no_grad(), use_slots(layer, slots):
        jagged = layer(x)
        assert layer.decode_plan.step.func is jagged_step
        assert torch.equal(layer(x), jagged)  # the kept plan
        layer.delta_mode = "stacked"
        stacked = layer(x)
        assert layer.decode_plan.step.func is stacked_step
    torch.testing.assert_close(jagged, stacked, atol=1e-3, rtol=1e-5)
    # A bf16 base under fp32 LoRA weights (as train ranks hold them): computed in fp32, added in bf16.
    layer.base.to(torch.bfloat16)
    with torch.no_grad(), use_slots(layer, slots):
        layer.delta_mode = "jagged"
        jagged_bf16 = layer(x.bfloat16())
        layer.delta_mode = "stacked"
        stacked_bf16 = layer(x.bfloat16())
    assert jagged_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(jagged_bf16.float(), stacked_bf16.float(), atol=0.5, rtol=1e-2)
    layer.base.float()
    layer.delta_mode = "jagged"
    with use_slots(layer, slots), pytest.raises(ValueError, match="decode steps only"):
        layer(x.requires_grad_())


def _rowwise_layers(gen: torch.Generator) -> tuple[torch.nn.Sequential, dict]:
    """Two layers of odd widths (the kernel's tail loop), a bias, unequal ranks and alphas."""
    layers = torch.nn.Sequential(
        MultiLoRALinear(torch.nn.Linear(37, 21), n_slots=5, max_rank=6),
        MultiLoRALinear(torch.nn.Linear(21, 40, bias=False), n_slots=5, max_rank=6),
    )
    weights = {}
    for index, layer in enumerate(layers):
        for slot, rank in zip(range(5), (6, 1, 3, 6, 4)):
            a = torch.randn(rank, layer.in_features, generator=gen)
            b = torch.randn(layer.out_features, rank, generator=gen)
            layer.set_slot(slot, a, b, alpha=2.0 * rank + index)
            weights[index, slot] = (a, b, (2.0 * rank + index) / rank)
    return layers, weights


@pytest.mark.parametrize("slots", [[4, -1, 0, 4, 2, 2, -1, 1, 3], [2, 0], [3, -1, 3], [-1, 2]])
def test_rowwise_kernel_equals_per_row_reference(slots):
    """The C kernel's decode step: each row through its own slot (rows out of slot order,
    base-only rows, slots that are not 0..P-1), the base output kept for slot -1. (A batch of
    one adapter and no base-only rows takes the segment path: one GEMM pair at its rank.)"""
    rowwise_kernel_or_skip()
    gen = torch.Generator().manual_seed(21)
    torch.manual_seed(21)  # the base linears' initial weights
    layers, weights = _rowwise_layers(gen)
    x = torch.randn(len(slots), 1, 37, generator=gen)

    expected = per_row_reference(layers, weights, x, slots)
    with torch.no_grad(), use_slots(layers, slots):
        first = layers(x)
        assert all(layer.decode_plan.step.func.__name__ == "rowwise_step" for layer in layers)
        second = layers(x)  # the kept plan
    torch.testing.assert_close(first, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(first, second)
