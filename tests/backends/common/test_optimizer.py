"""Per-slot AdamW equals torch's AdamW on one row and leaves the other rows alone."""

from __future__ import annotations

import pytest
import torch

from miles.backends.common.lr_schedule import LRSchedule
from miles.backends.common.optimizer import SlotAdamW


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(3, 4, 5, generator=g))  # [slots, rank, in]
    b = torch.nn.Parameter(torch.randn(3, 6, 4, generator=g))  # [slots, out, rank]
    return a, b


def test_slot_step_matches_torch_adamw_and_touches_only_its_row():
    a, b = _params()
    # The adapter in slot 1 has rank 4 = full width, so the comparison covers every element.
    ref_a = torch.nn.Parameter(a.detach()[1].clone())
    ref_b = torch.nn.Parameter(b.detach()[1].clone())
    ref = torch.optim.AdamW([ref_a, ref_b], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False)
    opt = SlotAdamW([(a, 1), (b, 2)], n_slots=3, betas=(0.9, 0.99), eps=1e-8)
    opt.configure_slot(1, rank=4, lr=0.01, weight_decay=0.1)
    before = [a.detach().clone(), b.detach().clone()]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ga, gb = torch.randn(3, 4, 5, generator=g), torch.randn(3, 6, 4, generator=g)
        a.grad, b.grad = ga.clone(), gb.clone()
        ref_a.grad, ref_b.grad = ga[1].clone(), gb[1].clone()
        ref.step()
        opt.step_slot(1, lr=0.01)
        # Other slots' gradients survive a step of slot 1 (they accumulate until their own step).
        assert torch.equal(a.grad[0], ga[0]) and torch.equal(b.grad[2], gb[2])
    assert torch.allclose(a.detach()[1], ref_a.detach(), atol=1e-7, rtol=0)
    assert torch.allclose(b.detach()[1], ref_b.detach(), atol=1e-7, rtol=0)
    for now, was in zip([a, b], before):
        assert torch.equal(now.detach()[0], was[0]) and torch.equal(now.detach()[2], was[2])
    assert opt.steps == [0, 3, 0]


def test_padding_beyond_rank_stays_exactly_zero():
    a, b = _params()
    with torch.no_grad():
        a[2, 2:].zero_()
        b[2, :, 2:].zero_()
    opt = SlotAdamW([(a, 1), (b, 2)], n_slots=3)
    opt.configure_slot(2, rank=2, lr=0.1, weight_decay=0.5)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step_slot(2, lr=0.1)
    assert torch.count_nonzero(a.detach()[2, 2:]) == 0 and torch.count_nonzero(b.detach()[2, :, 2:]) == 0
    assert torch.count_nonzero(opt.exp_avg[0][2, 2:]) == 0 and torch.count_nonzero(opt.exp_avg_sq[1][2, :, 2:]) == 0
    assert torch.count_nonzero(a.detach()[2, :2] - _params()[0].detach()[2, :2]) == 10


def test_clip_uses_the_slot_norm_only():
    a, b = _params()
    opt = SlotAdamW([(a, 1), (b, 2)], n_slots=3)
    a.grad = torch.zeros_like(a)
    b.grad = torch.zeros_like(b)
    a.grad[0, 0, 0] = 3.0
    b.grad[0, 0, 0] = 4.0
    b.grad[1] = 100.0  # another slot's huge gradient must not shrink slot 0's
    assert opt.clip_slot_grad(0, max_norm=1.0) == pytest.approx(5.0)
    assert a.grad[0, 0, 0].item() == pytest.approx(3.0 / (5.0 + 1e-6))
    assert b.grad[0, 0, 0].item() == pytest.approx(4.0 / (5.0 + 1e-6))
    assert torch.all(b.grad[1] == 100.0)
    assert opt.clip_slot_grad(2, max_norm=1.0) == 0.0


def test_reset_slot_zeroes_moments_steps_and_retained_grads():
    a, b = _params()
    opt = SlotAdamW([(a, 1), (b, 2)], n_slots=3)
    for slot in (0, 1):
        opt.configure_slot(slot, rank=4, lr=0.01, weight_decay=0.0)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step_slot(0, lr=0.01)
    opt.step_slot(1, lr=0.01)
    moments_1 = opt.slot_state(1)
    opt.reset_slot(0)
    assert opt.steps == [0, 1, 0]
    assert all(torch.count_nonzero(m[0]) == 0 for m in opt.exp_avg + opt.exp_avg_sq)
    assert torch.count_nonzero(a.grad[0]) == 0 and torch.count_nonzero(b.grad[0]) == 0
    assert all(torch.equal(x, y) for x, y in zip(moments_1[0], opt.slot_state(1)[0]))
    with pytest.raises(KeyError, match="configure_slot"):
        opt.step_slot(0, lr=0.01)


def test_schedules_follow_the_adapter_sample_clock():
    def lrs(schedule, steps):
        out = []
        for _ in range(steps):
            schedule.add_samples(8)
            out.append(schedule.begin_step())
        return out

    constant = LRSchedule(lr=1.0, samples_per_step=8, warmup_steps=2)
    assert lrs(constant, 4) == [0.0, 0.5, 1.0, 1.0]  # Miles' --lr-warmup-iters 2: 0, LR/2, LR
    linear = LRSchedule(lr=1.0, samples_per_step=8, style="linear", total_steps=4, min_lr=0.2)
    assert lrs(linear, 4) == pytest.approx([1.0, 0.8, 0.6, 0.4])
    cosine = LRSchedule(lr=1.0, samples_per_step=8, style="cosine", warmup_steps=1, total_steps=3)
    # the warmup step, then fractions 0 and 1/2 of the two decay steps
    assert lrs(cosine, 3) == pytest.approx([0.0, 1.0, 0.5])
    from_init = LRSchedule(lr=1.0, samples_per_step=8, warmup_steps=4, warmup_init=0.2)
    assert lrs(from_init, 5) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    with pytest.raises(ValueError, match="lr_warmup_init must be in 0..lr"):
        LRSchedule(lr=1.0, samples_per_step=8, warmup_steps=2, warmup_init=1.5)
    # Samples of a batch still accumulating do not move the lr of the current step.
    half = LRSchedule(lr=1.0, samples_per_step=8, style="linear", total_steps=2)
    half.add_samples(4)
    half.add_samples(4)
    assert half.begin_step() == 1.0
    half.add_samples(8)
    assert half.begin_step() == pytest.approx(0.5)
    restored = LRSchedule.from_state_dict(half.state_dict())
    assert restored == half
    with pytest.raises(ValueError, match="lr_decay_style"):
        LRSchedule(lr=1.0, samples_per_step=8, style="step")


@pytest.mark.parametrize(("style", "warmup", "init", "min_lr", "total"), [
    ("constant", 2, 0.0, 0.0, 10), ("constant", 3, 0.1, 0.0, 10), ("linear", 2, 0.0, 0.05, 8),
    ("cosine", 3, 0.0, 0.0, 12), ("cosine", 4, 0.2, 0.1, 9), ("linear", 0, 0.0, 0.1, 6),
])
def test_schedules_equal_megatrons_scheduler_step_for_step(style, warmup, init, min_lr, total):
    """Megatron's `OptimizerParamScheduler`, as Miles drives it (constructed with
    `init_lr=--lr-warmup-init`, `lr_decay_steps` = the run's steps, then one `step` per
    optimizer step, each reading the lr the scheduler set), gives the lrs ours gives."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    param = torch.nn.Parameter(torch.zeros(1))
    reference = OptimizerParamScheduler(
        torch.optim.SGD([param], lr=0.0), init_lr=init, max_lr=1.0, min_lr=min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=total, lr_decay_style=style, start_wd=0.0, end_wd=0.0, wd_incr_steps=total,
        wd_incr_style="constant")
    expected = []
    for _ in range(total + 2):  # past the end of the decay too
        expected.append(reference.optimizer.param_groups[0]["lr"])
        reference.step(1)
    ours = LRSchedule(lr=1.0, samples_per_step=8, style=style, warmup_steps=warmup, warmup_init=init,
                      min_lr=min_lr, total_steps=total)
    got = []
    for _ in range(total + 2):
        ours.add_samples(8)
        got.append(ours.begin_step())
    assert got == pytest.approx(expected, abs=1e-12)


def test_fused_step_of_several_slots_equals_the_per_slot_sequence():
    from miles.backends.common.optimizer import SlotStep

    fused_params, loop_params = _params(3), _params(3)
    settings = {0: (2, 0.02, 0.1, 0.5), 2: (4, 0.005, 0.0, 1.0 / 64)}  # slot: rank, lr, weight decay, grad scale
    fused = SlotAdamW([(fused_params[0], 1), (fused_params[1], 2)], n_slots=3, betas=(0.9, 0.99))
    loop = SlotAdamW([(loop_params[0], 1), (loop_params[1], 2)], n_slots=3, betas=(0.9, 0.99))
    for opt in (fused, loop):
        for slot, (rank, lr, wd, _) in settings.items():
            opt.configure_slot(slot, rank=rank, lr=lr, weight_decay=wd)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        grads = [torch.randn(3, 4, 5, generator=g) * (step + 1), torch.randn(3, 6, 4, generator=g)]
        for (a, b) in (fused_params, loop_params):
            a.grad, b.grad = grads[0].clone(), grads[1].clone()
        slot_steps = [SlotStep(slot=s, lr=lr, grad_scale=scale) for s, (_, lr, _, scale) in settings.items()]
        norms = fused.step_slots(slot_steps, max_norm=1.0)
        expected = {}
        for slot, (_, lr, _, scale) in settings.items():
            loop.mask_slot_grad(slot)
            loop.scale_slot_grad(slot, scale)
            expected[slot] = loop.clip_slot_grad(slot, 1.0)
            loop.step_slot(slot, lr)
            loop.zero_slot_grad(slot)
        assert norms == pytest.approx(expected, rel=1e-6)
        assert norms[0] > 1.0 > norms[2]  # one slot is clipped, the other is not
        for fused_p, loop_p in zip(fused_params, loop_params):
            torch.testing.assert_close(fused_p.detach(), loop_p.detach(), atol=1e-7, rtol=0)
            torch.testing.assert_close(fused_p.grad, loop_p.grad, atol=0, rtol=0)
        # Slot 1 did not step: its gradient accumulates, its row never moves.
        assert torch.equal(fused_params[0].grad[1], grads[0][1])
    assert fused.steps == loop.steps == [3, 0, 3]
    for m_f, m_l in zip(fused.exp_avg + fused.exp_avg_sq, loop.exp_avg + loop.exp_avg_sq):
        torch.testing.assert_close(m_f, m_l, atol=1e-7, rtol=0)
    assert torch.count_nonzero(fused.exp_avg[0][0, 2:]) == 0 and torch.count_nonzero(fused.exp_avg_sq[1][0, :, 2:]) == 0
    with pytest.raises(ValueError, match="twice"):
        fused.step_slots([SlotStep(slot=0, lr=0.1), SlotStep(slot=0, lr=0.1)], max_norm=1.0)


def test_fused_step_over_a_run_of_slots_equals_the_per_slot_sequence():
    """Consecutive slots with equal lr, weight decay and step count are updated as one
    slice; a slot that stepped alone in between splits the run. Same numbers either way."""
    from miles.backends.common.optimizer import SlotStep

    fused_params, loop_params = _params(5), _params(5)
    fused = SlotAdamW([(fused_params[0], 1), (fused_params[1], 2)], n_slots=3)
    loop = SlotAdamW([(loop_params[0], 1), (loop_params[1], 2)], n_slots=3)
    for opt in (fused, loop):
        for slot in range(3):
            opt.configure_slot(slot, rank=4, lr=0.01, weight_decay=0.05)
    g = torch.Generator().manual_seed(6)
    for stepping in ([0, 1, 2], [1], [0, 1, 2], [2, 0]):
        grads = [torch.randn(3, 4, 5, generator=g), torch.randn(3, 6, 4, generator=g)]
        for (a, b) in (fused_params, loop_params):
            a.grad, b.grad = grads[0].clone(), grads[1].clone()
        norms = fused.step_slots([SlotStep(slot=s, lr=0.01, grad_scale=0.25) for s in stepping], max_norm=0.5)
        expected = {}
        for slot in stepping:
            loop.scale_slot_grad(slot, 0.25)
            expected[slot] = loop.clip_slot_grad(slot, 0.5)
            loop.step_slot(slot, 0.01)
            loop.zero_slot_grad(slot)
        assert norms == pytest.approx(expected, rel=1e-6)
        for fused_p, loop_p in zip(fused_params, loop_params):
            torch.testing.assert_close(fused_p.detach(), loop_p.detach(), atol=1e-7, rtol=0)
            torch.testing.assert_close(fused_p.grad, loop_p.grad, atol=1e-7, rtol=0)
    assert fused.steps == loop.steps == [3, 3, 3]


def test_a_step_with_a_sharded_norm_is_the_per_slot_sequence_clipped_by_that_norm():
    """`slot_norm` (a slot's gradient sharded over ranks): each slot in turn is masked, scaled,
    clipped by the norm it gives and stepped, bit for bit the per-slot calls."""
    from miles.backends.common.optimizer import SlotStep

    def doubled(grads):  # as if another shard held the same gradient again
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, dtype=torch.float32))) * 2 ** 0.5

    stepped_params, loop_params = _params(7), _params(7)
    stepped = SlotAdamW([(stepped_params[0], 1), (stepped_params[1], 2)], n_slots=3)
    loop = SlotAdamW([(loop_params[0], 1), (loop_params[1], 2)], n_slots=3)
    for opt in (stepped, loop):
        opt.configure_slot(2, rank=2, lr=0.01, weight_decay=0.1)
        opt.configure_slot(0, rank=4, lr=0.02, weight_decay=0.0)
    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(3, 4, 5, generator=g), torch.randn(3, 6, 4, generator=g)]
    for (a, b) in (stepped_params, loop_params):
        a.grad, b.grad = grads[0].clone(), grads[1].clone()
    norms = stepped.step_slots([SlotStep(slot=2, lr=0.01, grad_scale=0.5), SlotStep(slot=0, lr=0.02, grad_scale=0.25)],
                               max_norm=1.0, slot_norm=doubled)
    expected = {}
    for slot, lr, scale in ((2, 0.01, 0.5), (0, 0.02, 0.25)):
        loop.mask_slot_grad(slot)
        loop.scale_slot_grad(slot, scale)
        grads_S = loop.slot_grads(slot)
        norm = doubled(grads_S)
        torch._foreach_mul_(grads_S, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        expected[slot] = float(norm)
        loop.step_slot(slot, lr)
        loop.zero_slot_grad(slot)
    assert norms == expected and list(norms) == [2, 0]
    for stepped_p, loop_p in zip(stepped_params, loop_params):
        assert torch.equal(stepped_p.detach(), loop_p.detach()) and torch.equal(stepped_p.grad, loop_p.grad)
    assert stepped.steps == loop.steps == [1, 0, 1]


def test_steps_bump_the_version_counters_that_cached_layouts_check():
    """The layers keep layouts derived from A and B while the weights' version counters are
    unchanged; every kind of step must move them (the fused AdamW kernel alone does not)."""
    from miles.backends.common.optimizer import SlotStep

    params = _params(3)
    opt = SlotAdamW([(params[0], 1), (params[1], 2)], n_slots=3)
    opt.configure_slot(1, rank=4, lr=0.01, weight_decay=0.0)
    for step in (lambda: opt.step_slot(1, 0.01), lambda: opt.step_slots([SlotStep(slot=1, lr=0.01)], max_norm=1.0)):
        for p in params:
            p.grad = torch.ones_like(p)
        versions = [p._version for p in params]
        step()
        assert all(p._version > v for p, v in zip(params, versions))
