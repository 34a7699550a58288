"""Tinker's built-in losses: each equals its formula written out per datum in plain PyTorch.

The batched `client_loss_terms` runs rows of different losses and lengths in one padded
block; the references below take one datum at a time, as Tinker's docs write them.
"""

from __future__ import annotations

import random

import pytest
import torch

from miles.backends.common.client_loss import (
    ClientInputs,
    client_loss_terms,
    client_rows,
    datum_outputs,
)
from miles.utils.types.client import ClientDatum, ClientLoss, ClientWork


def ref_loss(name: str, lp, q, adv, w, config, ratio_mask):
    """Per-position loss of one datum: the formulas of Tinker's loss docs."""
    lo = config.get("clip_low_threshold", 0.8)
    hi = config.get("clip_high_threshold", 1.2)
    if name == "cross_entropy":
        return -lp * w
    if name == "importance_sampling":
        return -(torch.exp(lp - q) * adv)
    if name == "ppo":
        ratio = torch.exp(lp - q)
        return -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    if name == "cispo":
        ratio = torch.exp(lp - q)
        return -(torch.clamp(ratio, lo, hi).detach() * lp * adv)
    if name == "dro":
        beta = config.get("beta", 0.05)
        return -(lp * adv - 0.5 * beta * (lp - q) ** 2)
    if name == "gspo":
        in_ratio = ratio_mask != 0
        log_ratio = (lp.detach() - q)[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        return -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    raise AssertionError(name)


def make_work(name: str, n_datums: int, seed: int, config=None, slot: int = 0) -> ClientWork:
    rng = random.Random(seed)
    datums = []
    for _ in range(n_datums):
        n = rng.randint(2, 7)
        inputs = {
            "target_tokens": [rng.randrange(100) for _ in range(n)],
            "weights": [float(rng.randint(0, 1)) for _ in range(n)],
            "logprobs": [-rng.uniform(0.5, 3.0) for _ in range(n)],
            "advantages": [0.0] + [rng.uniform(-1.5, 1.5) for _ in range(n - 1)],
        }
        if name != "cross_entropy":
            del inputs["weights"]
        else:
            del inputs["logprobs"], inputs["advantages"]
        datums.append(ClientDatum(tokens=[rng.randrange(100) for _ in range(n)], inputs=inputs))
    return ClientWork(adapter=f"{name}-client", slot=slot, datums=datums, loss=ClientLoss(name, config or {}))


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
    ("dro", {}),
    ("dro", {"beta": 0.3}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}),
]


def test_every_loss_equals_its_formula_in_one_mixed_block():
    works = [make_work(name, 3, seed=i, config=config) for i, (name, config) in enumerate(CASES)]
    rows = client_rows(works, vocab_size=100)
    length = max(r.length for r in rows) + 2  # extra padding must change nothing
    inputs = ClientInputs.collate(rows, length)
    gen = torch.Generator().manual_seed(0)
    # The trainer's logprobs: near the sampler's, so every clip branch is taken somewhere.
    base = inputs.sampling_logprobs_CL + 0.4 * torch.randn(inputs.mask_CL.shape, generator=gen)
    base = torch.where(inputs.mask_CL.bool(), base, -7.0 * torch.ones_like(base))
    lp_CL = base.clone().requires_grad_(True)
    out = client_loss_terms(lp_CL, inputs)
    out.loss_C.sum().backward()
    outputs = datum_outputs(rows, lp_CL, out)
    for c, row in enumerate(rows):
        work = works[row.work]
        name, config = work.loss.name, work.loss.config
        datum = work.datums[row.datum]
        lp = base[c, : row.length].clone().requires_grad_(True)
        q = torch.tensor(datum.inputs.get("logprobs", [0.0] * row.length))
        adv = torch.tensor(datum.inputs.get("advantages", [0.0] * row.length))
        w = torch.tensor(datum.inputs.get("weights", [1.0] * row.length))
        want = ref_loss(name, lp, q, adv, w, config, adv)
        want.sum().backward()
        assert out.loss_C[c].item() == pytest.approx(want.sum().item(), abs=1e-5), (name, config)
        assert torch.allclose(out.elementwise_CL[c, : row.length], want.detach(), atol=1e-5)
        assert torch.allclose(lp_CL.grad[c, : row.length], lp.grad, atol=1e-5), (name, config)
        assert torch.all(lp_CL.grad[c, row.length :] == 0)
        assert outputs[c].loss == pytest.approx(want.sum().item(), abs=1e-5)
        assert outputs[c].outputs["logprobs"] == pytest.approx(base[c, : row.length].tolist())
        if name == "cross_entropy":
            assert outputs[c].outputs["elementwise_loss"] == pytest.approx(want.tolist(), abs=1e-6)
        else:
            assert "elementwise_loss" not in outputs[c].outputs


def test_clip_thresholds_per_position_and_a_sequence_ratio_mask_win_over_the_defaults():
    lp = torch.tensor([-1.0, -0.2, -2.5, -0.7])
    q = torch.tensor([-1.3, -0.9, -2.0, -0.6])
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0])
    lo, hi, mask = [0.5, 0.9, 0.95, 0.8], [1.5, 1.1, 1.05, 1.2], [1.0, 1.0, 0.0, 1.0]
    datum = ClientDatum(tokens=[1, 2, 3, 4], inputs={
        "target_tokens": [2, 3, 4, 5], "logprobs": q.tolist(), "advantages": adv.tolist(),
        "clip_low_threshold": lo, "clip_high_threshold": hi, "sequence_ratio_mask": mask})
    for name in ("ppo", "gspo"):
        rows = client_rows([ClientWork("a", 0, [datum], ClientLoss(name))])  # ppo ignores the ratio mask
        got = client_loss_terms(lp[None], ClientInputs.collate(rows, 4)).elementwise_CL[0]
        ratio = torch.exp(lp - q)
        if name == "gspo":
            ratio = torch.exp((lp - q)[torch.tensor(mask) != 0].mean()).expand(4)
        want = -torch.min(ratio * adv, torch.clamp(ratio, torch.tensor(lo), torch.tensor(hi)) * adv)
        assert torch.allclose(got, want, atol=1e-6), name


def test_a_forward_without_a_loss_gives_logprobs_only():
    work = make_work("ppo", 2, seed=3)
    work = ClientWork(work.adapter, work.slot, work.datums, loss=None, backward=False)
    rows = client_rows([work], vocab_size=100)
    lp = torch.randn(2, 8)
    out = datum_outputs(rows, lp, client_loss_terms(lp, ClientInputs.collate(rows, 8)))
    assert [o.loss for o in out] == [0.0, 0.0]
    assert out[0].outputs.keys() == {"logprobs"}


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: ClientDatum(d.tokens, {k: v for k, v in d.inputs.items() if k != "target_tokens"}), "target_tokens"),
    (lambda d: ClientDatum(d.tokens, {**d.inputs, "advantages": d.inputs["advantages"][:-1]}), "'advantages' has"),
    (lambda d: ClientDatum(d.tokens, {k: v for k, v in d.inputs.items() if k != "logprobs"}), "'logprobs'"),
    (lambda d: ClientDatum(d.tokens, {**d.inputs, "target_tokens": [100] * len(d.tokens)}), "target_tokens holds"),
    (lambda d: ClientDatum([-1] + d.tokens[1:], d.inputs), "tokens holds"),
    (lambda d: ClientDatum([], {}), "tokens is empty"),
    (lambda d: ClientDatum(d.tokens, {**d.inputs, "advantage": [1.0] * len(d.tokens)}), r"\['advantage'\]"),
])
def test_bad_datums_are_value_errors_that_name_the_field(change, message):
    work = make_work("ppo", 1, seed=5)
    bad = ClientWork(work.adapter, work.slot, [change(work.datums[0])], work.loss)
    with pytest.raises(ValueError, match=message):
        client_rows([bad], vocab_size=100)


def test_unknown_losses_and_config_keys_are_value_errors():
    work = make_work("ppo", 1, seed=6)
    with pytest.raises(ValueError, match="unknown loss 'reinforce'"):
        client_rows([ClientWork("a", 0, work.datums, ClientLoss("reinforce"))])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\['clip_low'\]"):
        client_rows([ClientWork("a", 0, work.datums, ClientLoss("ppo", {"clip_low": 0.5}))])
    with pytest.raises(ValueError, match="backward without a loss"):
        client_rows([ClientWork("a", 0, work.datums, None)])


def test_inputs_of_another_loss_are_ignored():
    """An RL datum scored with cross_entropy (weights default to 1): its logprobs and advantages are not read."""
    rl = make_work("ppo", 1, seed=7).datums[0]
    rows = client_rows([ClientWork("a", 0, [rl], ClientLoss("cross_entropy"))], vocab_size=100)
    lp = torch.randn(1, rows[0].length)
    out = client_loss_terms(lp, ClientInputs.collate(rows, rows[0].length))
    assert out.loss_C.item() == pytest.approx(float(-lp.sum()), abs=1e-5)
