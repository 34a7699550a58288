"""Token logprobs computed in chunks (and on the kept positions only) equal the full
log-softmax, in value and in gradient."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.common.batching import (
    activation_bytes_per_token,
    activation_token_budget,
    logits_to_keep,
    make_micro_batches,
    next_token_logprobs,
)
from miles.utils.types import Sample


def full_logprobs(logits_BLV: torch.Tensor, ids_BL: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(logits_BLV[:, :-1].float(), dim=-1)
    return torch.gather(logprobs, 2, ids_BL[:, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 50, 7 * 50, 10**6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_full_log_softmax(chunk_tokens, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 9, 50, generator=g) * 4).to(dtype).requires_grad_(True)
    ids = torch.randint(0, 50, (5, 9), generator=g)
    weights = torch.randn(5, 8, generator=g)
    expected = full_logprobs(logits, ids)
    (expected * weights).sum().backward()
    expected_grad, logits.grad = logits.grad.clone(), None
    got = next_token_logprobs(logits, ids, chunk_elements=chunk_tokens)
    (got * weights).sum().backward()
    assert got.dtype == torch.float32 and got.shape == (5, 8)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the bf16 gradient rounds once to bf16
    torch.testing.assert_close(logits.grad.float(), expected_grad.float(), atol=tol, rtol=0)
    assert torch.all(logits.grad[:, -1] == 0)  # the last position predicts nothing


def _sample(prompt: list[int], response: list[int], slot: int = 0) -> Sample:
    return Sample(adapter="a", slot=slot, group_index=0, index=0, prompt="", label=None, metadata={},
                  prompt_ids=prompt, response_ids=response)


def test_logits_of_the_response_window_only_give_the_same_logprobs(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    samples = [_sample([5, 6, 7, 8, 9], [10, 11]), _sample([5, 6, 7], [12, 13, 14, 15]), _sample([4, 4, 4, 4], [9])]
    (batch,) = make_micro_batches(samples, [1.0, -1.0, 0.5], None)
    keep = logits_to_keep(batch)
    assert keep == batch.input_ids_BL.shape[1] - 2  # the 3-token prompt's last position starts the window
    with torch.no_grad():
        full = full_logprobs(model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL).logits,
                             batch.input_ids_BL)
        kept_logits = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                            logits_to_keep=keep).logits
    assert kept_logits.shape[1] == keep
    window = next_token_logprobs(kept_logits, batch.input_ids_BL)
    mask = batch.response_mask_BT.bool()
    torch.testing.assert_close(window[mask], full[mask], atol=1e-6, rtol=0)
    assert torch.all(window[:, : batch.input_ids_BL.shape[1] - keep] == 0)
    with pytest.raises(ValueError, match="positions"):
        next_token_logprobs(kept_logits, batch.input_ids_BL[:, :2])


def test_a_token_budget_packs_micro_batches_by_padded_size():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 20, (30,), generator=gen).tolist()
    samples = [_sample([1] * (n // 2), [2] * (n - n // 2), slot=i % 3) for i, n in enumerate(lengths)]
    budget = 48
    batches = make_micro_batches(samples, [0.0] * len(samples), micro_batch_size=2, max_tokens=budget)
    # every sample once, slots in order, each batch within the budget once padded
    assert sorted(i for b in batches for i in b.indices) == list(range(len(samples)))
    assert [s for b in batches for s in b.slots] == sorted(s.slot for s in samples)
    assert all(b.input_ids_BL.numel() <= budget for b in batches)
    assert max(len(b.indices) for b in batches) > 2  # the budget, not micro_batch_size, sizes them
    # greedy: a batch ends only where taking the next sample would pass the budget
    for this, after in zip(batches, batches[1:]):
        longest = max(this.input_ids_BL.shape[1], lengths[after.indices[0]])
        assert (len(this.indices) + 1) * longest > budget


def test_a_sample_longer_than_the_budget_is_a_micro_batch_of_its_own():
    samples = [_sample([1] * 3, [2] * 2), _sample([1] * 30, [2] * 10), _sample([1] * 2, [2] * 2)]
    batches = make_micro_batches(samples, [0.0] * 3, None, max_tokens=16)
    assert [b.indices for b in batches] == [[2, 0], [1]]
    assert batches[1].input_ids_BL.shape == (1, 40)
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        make_micro_batches(samples, [0.0] * 3, None, max_tokens=0)


def test_the_activation_estimate_follows_the_model_shape_and_the_recompute_setting():
    smollm2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
    assert activation_bytes_per_token(smollm2, 4, None) == 30 * (6 * 576 + 4 * 1536) * 4
    assert activation_bytes_per_token(smollm2, 2, "selective") == 30 * (4 * 576 + 2 * 1536) * 2
    assert activation_bytes_per_token(smollm2, 4, "full") == (30 * 576 + 6 * 576 + 4 * 1536) * 4
    no_intermediate = SimpleNamespace(hidden_size=64, num_hidden_layers=2)
    assert activation_bytes_per_token(no_intermediate, 4, None) == 2 * (6 * 64 + 4 * 256) * 4


def test_an_activation_budget_evens_out_the_micro_batches_it_needs():
    samples = [_sample([1] * 16, [2] * 48, slot=i % 8) for i in range(32)]
    per_token = 1_152_000  # SmolLM2-135M in float32
    # 466 tokens fit 512 MiB: five micro-batches, of 7 rows (448 tokens) rather than 6 + ... + 2
    tokens = activation_token_budget(samples, 512 * 2**20, per_token)
    assert tokens == 448
    batches = make_micro_batches(samples, [0.0] * 32, None, max_tokens=tokens)
    assert [len(b.indices) for b in batches] == [7, 7, 7, 7, 4]
    assert activation_token_budget(samples, 32 * 64 * per_token, per_token) is None  # the whole batch fits
    assert activation_token_budget([], 1, per_token) is None
    assert activation_token_budget(samples, 1, per_token) == 1  # under one token: a row at a time
