"""The row-wise decode kernel's build, cache and fallback (`miles/lora/rowwise.py`).

    .venv/bin/pytest -q tests/lora/test_lora_rowwise.py

Its numbers inside the layer are tested with the other delta paths (test_lora_layer.py).
"""

from __future__ import annotations

import pytest
import torch

from miles.lora import MultiLoRALinear, rowwise, set_delta_mode, use_slots
from miles.lora.delta import rowwise as rowwise_delta
from tests.helpers.kernel_or_skip import rowwise_kernel_or_skip


def test_decode_steps_take_the_torch_paths_without_the_kernel(monkeypatch, caplog, tmp_path):
    """Switched off (MILES_CPU_LORA_KERNEL=0) or without a working C compiler, the kernel is
    None with the reason logged, "auto" decodes through the stacked path with the same
    numbers, and forcing "rowwise" says what it needs."""
    gen = torch.Generator().manual_seed(22)
    torch.manual_seed(22)  # the base linear's initial weights
    layers = torch.nn.Sequential(MultiLoRALinear(torch.nn.Linear(37, 21), n_slots=5, max_rank=4))
    for slot in range(5):
        layers[0].set_slot(slot, torch.randn(4, 37, generator=gen), torch.randn(21, 4, generator=gen), alpha=3.0 + slot)
    x = torch.randn(4, 1, 37, generator=gen)
    slots = [1, -1, 4, 1]
    with torch.no_grad(), use_slots(layers, slots):
        expected = layers(x)
    monkeypatch.setattr(rowwise, "rowwise_kernel", rowwise.rowwise_kernel.__wrapped__)
    monkeypatch.setattr(rowwise_delta, "rowwise_kernel", rowwise.rowwise_kernel)
    monkeypatch.setenv("MILES_CPU_LORA_KERNEL", "0")
    assert rowwise.rowwise_kernel() is None
    monkeypatch.setenv("MILES_CPU_LORA_KERNEL", "1")
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level("WARNING", logger="miles.lora.rowwise"):
        assert rowwise.rowwise_kernel() is None
    assert "could not build rowwise.c" in caplog.text and "torch paths" in caplog.text
    for layer in layers:
        layer.decode_plan = None
    with torch.no_grad(), use_slots(layers, slots):
        torch.testing.assert_close(layers(x), expected, atol=1e-5, rtol=1e-5)
        assert all(layer.decode_plan.step.func.__name__ == "stacked_step" for layer in layers)
        set_delta_mode(layers, "rowwise")
        with pytest.raises(ValueError, match="kernel built"):
            layers(x)


def test_the_kernel_is_built_once_per_cache(tmp_path, monkeypatch):
    """A second build finds the first one's file (same source, flags, compiler and CPU)."""
    rowwise_kernel_or_skip()
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path))
    first = rowwise._build()
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path and first.suffix == ".so"
    assert rowwise._build() == first and first.stat().st_mtime_ns == stamp
    kernel = rowwise.RowwiseKernel(first)
    out = torch.zeros(2, 3)
    kernel(out, torch.ones(2, 4), torch.ones(1, 4, 2), torch.ones(1, 2, 3), torch.zeros(2, dtype=torch.long),
           torch.tensor([0.5, 2.0]), torch.tensor([1]))
    assert out.tolist() == [[0.0, 0.0, 0.0], [16.0, 16.0, 16.0]]  # row 1 only: 2 x (4 x 1) x 2 = 16


@pytest.mark.parametrize("rank", [8, 16, 32, 64, 12])
def test_each_compiled_rank_equals_torch(rank):
    """Ranks 8, 16, 32 and 64 run copies of the row loop compiled for that rank; any other
    rank (12) the general one. Odd widths take the tail loops; rows out of slot order."""
    kernel = rowwise_kernel_or_skip()
    gen = torch.Generator().manual_seed(rank)
    n_slots, in_f, out_f = 3, 45, 38
    a_SIR = torch.randn(n_slots, in_f, rank, generator=gen)
    b_SRO = torch.randn(n_slots, rank, out_f, generator=gen)
    x_NI = torch.randn(5, in_f, generator=gen)
    slots_N = torch.tensor([2, 0, 2, 1, 0])
    scale_N = torch.tensor([0.5, 2.0, 1.5, 0.25, 1.0])
    out_NO = torch.randn(5, out_f, generator=gen)
    expected = out_NO + scale_N[:, None] * torch.einsum("ni,nir,nro->no", x_NI, a_SIR[slots_N], b_SRO[slots_N])
    kernel(out_NO, x_NI, a_SIR, b_SRO, slots_N, scale_N, torch.argsort(slots_N, stable=True))
    torch.testing.assert_close(out_NO, expected, atol=1e-4, rtol=1e-5)
