"""A train rank's updates: isolation between slots, accumulation, resume, slot reuse.

One rank in-process (no Ray): every equality here is between two ways of training the
same adapter on the same samples.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from miles.backends.base import LoadResult
from miles.backends.common.checkpoint import latest_checkpoint, latest_miles_checkpoint
from miles.backends.torch.actor import TorchTrainActor
from miles.utils.loss_settings import LossSettings
from miles.utils.types import DataPosition
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, make_groups, max_abs_diff, new_actor, spec

LOSS = LossSettings(eps_clip=0.2, eps_clip_high=0.28, use_tis=True, tis_clip=2.0, use_kl_loss=True,
                    kl_loss_coef=0.05, kl_loss_type="k3")


def _train_step(actor, groups, step_names):
    samples, adv = flatten_with_advantages(groups)
    stats = actor.train(samples, adv, counts(samples))
    return stats, actor.step_adapters(step_names)


def test_co_trained_adapter_equals_adapter_trained_alone(tiny_model_dir):
    mixed = new_actor(tiny_model_dir, micro_batch_size=5, loss=LOSS)
    alone = new_actor(tiny_model_dir, micro_batch_size=3, loss=LOSS)
    mixed.load_adapter(spec("a", 0, global_batch_size=4))
    mixed.load_adapter(spec("b", 1, rank=2, global_batch_size=4))
    mixed.load_adapter(spec("c", 2, rank=3, global_batch_size=6))
    alone.load_adapter(spec("a", 3, global_batch_size=4))  # another slot: the slot index must not matter
    initial = alone.export_adapter("a")
    for step in range(3):
        a = make_groups("a", 0, 2, 2, seed=10 + step)
        b = make_groups("b", 1, 2, 2, seed=20 + step)
        c = make_groups("c", 2, 2, 3, seed=30 + step)
        # Interleave the adapters' groups so micro-batches hold several slots.
        batch = [g for trio in zip(b, a, c) for g in trio]
        stats, stepped = _train_step(mixed, batch, ["a", "b", "c"] if step < 2 else ["a"])
        a_alone = [[dataclasses.replace(s, slot=3) for s in g] for g in a]
        stats_alone, stepped_alone = _train_step(alone, a_alone, ["a"])
        assert abs(stats["a"].loss_sum - stats_alone["a"].loss_sum) < 1e-5
        assert abs(stepped["a"].grad_norm - stepped_alone["a"].grad_norm) < 1e-5
        assert stepped["a"].lr == stepped_alone["a"].lr
    trained = mixed.export_adapter("a")
    assert max_abs_diff(trained, alone.export_adapter("a")) <= 1e-5
    assert max_abs_diff(trained, initial) > 1e-3  # it did learn something
    for got, want in zip(mixed.optimizer_state("a").exp_avg.values(), alone.optimizer_state("a").exp_avg.values()):
        assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_step_of_one_adapter_leaves_the_others_bit_identical(tiny_model_dir):
    actor = new_actor(tiny_model_dir, micro_batch_size=4, loss=LOSS)
    actor.load_adapter(spec("a", 0))
    actor.load_adapter(spec("b", 2, rank=3))
    warmup = make_groups("a", 0, 1, 2, seed=1) + make_groups("b", 2, 1, 2, seed=2)
    _train_step(actor, warmup, ["a", "b"])  # b has moments and nonzero B weights now
    probe = [s for g in make_groups("b", 2, 2, 2, seed=3) for s in g]
    b_weights, b_logprobs = actor.export_adapter("b"), actor.logprobs(probe)
    b_state = actor.optimizer_state("b")
    a_before = actor.export_adapter("a")
    batch = make_groups("a", 0, 2, 2, seed=4) + make_groups("b", 2, 1, 2, seed=5)
    _train_step(actor, batch, ["a"])
    assert max_abs_diff(actor.export_adapter("a"), a_before) > 1e-4
    after = actor.export_adapter("b")
    assert all(torch.equal(after[k], b_weights[k]) for k in b_weights)
    assert actor.logprobs(probe) == b_logprobs
    state = actor.optimizer_state("b")
    assert state.step == b_state.step == 1
    assert all(torch.equal(state.exp_avg[k], b_state.exp_avg[k]) for k in state.exp_avg)
    # b's gradient from this batch is retained for its own step, not dropped.
    assert any(torch.count_nonzero(g) > 0 for g in actor.core.optimizer.slot_grads(2))


def test_accumulating_over_two_calls_equals_one_call(tiny_model_dir):
    split = new_actor(tiny_model_dir, micro_batch_size=4)
    whole = new_actor(tiny_model_dir, micro_batch_size=4)
    for actor in (split, whole):
        actor.load_adapter(spec("a", 1, global_batch_size=8, lr_decay_style="linear", num_step=4, lr_warmup_steps=2))
    lrs = []
    for step_groups in (make_groups("a", 1, 4, 2, seed=7), make_groups("a", 1, 4, 2, seed=8)):
        first, second = flatten_with_advantages(step_groups[:1]), flatten_with_advantages(step_groups[1:])
        split.train(first[0], first[1], counts(first[0]))
        split.train(second[0], second[1], counts(second[0]))
        split_stats = split.step_adapters(["a"])
        _, whole_stats = _train_step(whole, step_groups, ["a"])
        assert split_stats["a"].lr == whole_stats["a"].lr
        lrs.append(split_stats["a"].lr)
    assert lrs == [0.0, 0.01]  # two warmup steps from 0; the clock counts samples, not train calls
    assert max_abs_diff(split.export_adapter("a"), whole.export_adapter("a")) <= 1e-5
    assert split.schedule_state("a") == whole.schedule_state("a")


def _peft_logprobs(model_dir, adapter_dir, samples):
    """Response logprobs of `samples` under the checkpoint loaded by PEFT itself."""
    import peft
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            picked = logprobs.gather(1, ids[0, 1:, None])[:, 0]
            out.append(picked[len(s.prompt_ids) - 1 :].tolist())
    return out


def test_resume_equals_uninterrupted_training(tiny_model_dir, tmp_path):
    batches = [make_groups("a", 0, 2, 2, seed=40 + i) + make_groups("b", 1, 1, 2, seed=50 + i) for i in range(3)]
    straight = new_actor(tiny_model_dir, micro_batch_size=3)
    straight.load_adapter(spec("a", 0, save_dir=tmp_path / "a", lr_decay_style="cosine", num_step=5))
    straight.load_adapter(spec("b", 1, rank=2))
    for i, batch in enumerate(batches):
        _train_step(straight, batch, ["a", "b"])
        if i == 1:
            straight.save_adapter("a", step=2, data_position=DataPosition(epoch=1, index=5))
            probe = [s for g in make_groups("a", 0, 2, 2, seed=99) for s in g]
            saved_logprobs = straight.logprobs(probe)
    checkpoint = latest_checkpoint(tmp_path / "a")
    assert checkpoint is not None and checkpoint.name == "step_2"
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(_peft_logprobs(tiny_model_dir, checkpoint, probe)) == pytest.approx(flat(saved_logprobs), abs=1e-5)
    base = flat(straight.logprobs([dataclasses.replace(s, slot=-1) for s in probe]))
    assert max(abs(x - y) for x, y in zip(base, flat(saved_logprobs))) > 1e-4  # the adapter matters

    resumed = new_actor(tiny_model_dir, micro_batch_size=3)
    loaded = resumed.load_adapter(spec("a", 0, save_dir=tmp_path / "a", lr_decay_style="cosine", num_step=3),
                                  str(checkpoint))
    assert loaded == LoadResult(checkpoint=checkpoint, step=2, data_position=DataPosition(epoch=1, index=5))
    resumed.load_adapter(spec("b", 1, rank=2))
    a_groups = [g for g in batches[2] if g[0].adapter == "a"]
    _train_step(resumed, a_groups, ["a"])
    assert max_abs_diff(resumed.export_adapter("a"), straight.export_adapter("a")) <= 1e-6
    got, want = resumed.optimizer_state("a"), straight.optimizer_state("a")
    assert got.step == want.step == 3
    assert max_abs_diff(got.exp_avg, want.exp_avg) <= 1e-7
    assert max_abs_diff(got.exp_avg_sq, want.exp_avg_sq) <= 1e-9
    assert resumed.schedule_state("a") == straight.schedule_state("a")


def test_a_miles_checkpoint_starts_an_adapter_from_its_weights_with_a_fresh_optimizer(tiny_model_dir, tmp_path):
    """A `step_N` directory as Miles' trainer writes it (its PEFT files beside Megatron shards,
    none of our trainer state) is no checkpoint of ours to resume, but an adapter with none of
    ours starts from its LoRA weights, at its step, with a fresh optimizer and LR clock."""
    trained = new_actor(tiny_model_dir, micro_batch_size=4)
    trained.load_adapter(spec("a", 0, save_dir=tmp_path / "a"))
    for i in range(2):
        _train_step(trained, make_groups("a", 0, 2, 2, seed=30 + i), ["a"])
    ours = trained.save_adapter("a", step=7)
    for name in ("trainer_state.json", "optimizer.safetensors", "optimizer.json", "scheduler.json"):
        (Path(ours) / name).unlink()  # what Miles does not write
    torch.save({}, Path(ours) / "adapter_megatron_tp0_pp0.pt")
    assert latest_checkpoint(tmp_path / "a") is None
    miles = latest_miles_checkpoint(tmp_path / "a")
    assert miles == Path(ours)

    started = new_actor(tiny_model_dir, micro_batch_size=4)
    loaded = started.load_adapter(spec("a", 0, save_dir=tmp_path / "a"), None, str(miles))
    assert loaded == LoadResult(checkpoint=miles, step=7, miles_checkpoint=True)
    probe = [s for g in make_groups("a", 0, 2, 2, seed=99) for s in g]
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(started.logprobs(probe)) == pytest.approx(flat(trained.logprobs(probe)), abs=1e-6)
    base = flat(started.logprobs([dataclasses.replace(s, slot=-1) for s in probe]))
    assert max(abs(x - y) for x, y in zip(base, flat(trained.logprobs(probe)))) > 1e-4  # the weights matter
    fresh = started.optimizer_state("a")
    assert fresh.step == 0 and all(float(t.abs().max()) == 0 for t in fresh.exp_avg.values())
    assert started.schedule_state("a")["samples_seen"] == 0
    with pytest.raises(ValueError, match="holds a rank-4 alpha-8.0 adapter but adapter 'b' is configured with rank 2"):
        new_actor(tiny_model_dir).load_adapter(spec("b", 1, rank=2), None, str(miles))
    # A directory of ours that a crash left without its trainer state is neither.
    (Path(ours) / "adapter_megatron_tp0_pp0.pt").unlink()
    assert latest_miles_checkpoint(tmp_path / "a") is None


def test_reused_slot_starts_fresh_and_cotenants_are_untouched(tiny_model_dir):
    actor = new_actor(tiny_model_dir, micro_batch_size=4)
    actor.load_adapter(spec("old", 0))
    actor.load_adapter(spec("b", 1, rank=2))
    for i in range(2):
        groups = make_groups("old", 0, 1, 2, seed=60 + i) + make_groups("b", 1, 1, 2, seed=70 + i)
        _train_step(actor, groups, ["old", "b"])
    leftover, adv = flatten_with_advantages(make_groups("old", 0, 1, 2, seed=80))
    actor.train(leftover, adv, counts(leftover))  # retained gradient that must not leak into the next tenant
    b_weights, b_state = actor.export_adapter("b"), actor.optimizer_state("b")

    actor.cleanup_adapter("old")
    assert actor.core.optimizer.steps[0] == 0
    assert all(torch.count_nonzero(m[0]) == 0 for m in actor.core.optimizer.exp_avg + actor.core.optimizer.exp_avg_sq)
    assert all(torch.count_nonzero(g) == 0 for g in actor.core.optimizer.slot_grads(0))
    actor.load_adapter(spec("new", 0))
    assert actor.schedule_state("new")["samples_seen"] == 0

    fresh = new_actor(tiny_model_dir, micro_batch_size=4)
    fresh.load_adapter(spec("new", 2))
    groups = make_groups("new", 0, 2, 2, seed=90)
    _train_step(actor, groups, ["new"])
    _train_step(fresh, [[dataclasses.replace(s, slot=2) for s in g] for g in groups], ["new"])
    assert max_abs_diff(actor.export_adapter("new"), fresh.export_adapter("new")) <= 1e-6
    assert actor.optimizer_state("new").step == 1
    after = actor.export_adapter("b")
    assert all(torch.equal(after[k], b_weights[k]) for k in after)
    assert all(torch.equal(actor.optimizer_state("b").exp_avg[k], b_state.exp_avg[k]) for k in b_state.exp_avg)


def test_bf16_base_keeps_fp32_lora_weights_and_moments(tiny_model_dir):
    from miles.backends.rank.config import TrainActorConfig

    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint=str(tiny_model_dir), n_slots=2, lora_rank=4,
                                             dtype="bfloat16"))
    actor.load_adapter(spec("a", 1, rank=2, lr=1e-5, weight_decay=0.0))
    before = actor.export_adapter("a")
    for seed in (3, 4):  # A gets its first gradient at step 2, once B is nonzero
        _train_step(actor, make_groups("a", 1, 2, 2, seed=seed), ["a"])
    after = actor.export_adapter("a")
    assert next(actor.model.module.parameters()).dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in after.values())
    assert all(m.dtype == torch.float32 for m in actor.core.optimizer.exp_avg + actor.core.optimizer.exp_avg_sq)
    # An AdamW update of ~1e-5 on A entries of magnitude ~0.1 would round away in bf16
    # (spacing ~5e-4 there); in fp32 it lands: 1e-5 * 0.526 / 0.707 at the first nonzero gradient.
    delta_a = max(float((after[k] - before[k]).abs().max()) for k in after if "lora_A" in k)
    assert delta_a == pytest.approx(1e-5 * (0.1 / 0.19) / (0.001 / 0.001999) ** 0.5, rel=0.01)


def test_fresh_export_for_push_is_what_the_load_gives(tiny_model_dir):
    """A registration is pushed to the engines before the rank loads it: with these weights."""
    actor = new_actor(tiny_model_dir)
    actor.load_adapter(spec("other", 0))
    before = actor.export_adapter("other")
    tensors, described = actor.fresh_export_for_push(spec("new", 2, rank=3))
    assert all(torch.equal(actor.export_adapter("other")[k], before[k]) for k in before)  # nothing written
    actor.load_adapter(spec("new", 2, rank=3))
    loaded, loaded_described = actor.export_for_push("new")
    assert list(tensors) == list(loaded) and all(torch.equal(tensors[k], loaded[k]) for k in loaded)
    assert described == loaded_described
    with pytest.raises(ValueError, match="rank 9"):
        actor.fresh_export_for_push(spec("wide", 1, rank=9))


def test_token_budget_micro_batches_give_the_gradient_of_one_batch(tiny_model_dir):
    whole = new_actor(tiny_model_dir, loss=LOSS)
    packed = new_actor(tiny_model_dir, max_tokens=40, loss=LOSS)
    for actor in (whole, packed):
        actor.load_adapter(spec("a", 0, global_batch_size=6))
        actor.load_adapter(spec("b", 1, rank=2, global_batch_size=6))
    batch = make_groups("a", 0, 3, 2, seed=40) + make_groups("b", 1, 3, 2, seed=41)
    samples, adv = flatten_with_advantages(batch)
    assert len(packed.core.micro_batches(samples, adv)) > 2  # the budget really splits this batch
    stats_whole = whole.train(samples, adv, counts(samples))
    stats_packed = packed.train(samples, adv, counts(samples))
    for name in ("a", "b"):
        assert abs(stats_whole[name].loss_sum - stats_packed[name].loss_sum) < 1e-5
        assert stats_whole[name].tokens == stats_packed[name].tokens
    for slot in (0, 1):
        for got, want in zip(packed.core.optimizer.slot_grads(slot), whole.core.optimizer.slot_grads(slot)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    stepped_whole, stepped_packed = whole.step_adapters(["a", "b"]), packed.step_adapters(["a", "b"])
    assert abs(stepped_whole["a"].grad_norm - stepped_packed["a"].grad_norm) < 1e-5
    assert max_abs_diff(whole.export_adapter("b"), packed.export_adapter("b")) <= 1e-6


def test_an_activation_budget_splits_training_where_no_micro_batch_size_is_given(tiny_model_dir, caplog, monkeypatch):
    """A CPU rank given no micro-batch size trains in micro-batches whose estimated activations fit
    --activation-budget-mb: the same gradients as one batch; a given size, or 0, turns it off."""
    batch = make_groups("a", 0, 3, 2, seed=42) + make_groups("b", 1, 3, 2, seed=43)
    samples, adv = flatten_with_advantages(batch)
    whole = new_actor(tiny_model_dir, loss=LOSS, activation_budget_mb=0)
    probe = new_actor(tiny_model_dir, loss=LOSS)
    budget_mb = 12 * probe.core.activation_budget.bytes_per_token / 2**20  # about 12 tokens' worth
    budgeted = new_actor(tiny_model_dir, loss=LOSS, activation_budget_mb=budget_mb)
    calls = []
    original = type(budgeted.core.training).train_micro_batch

    def counted(self, batch, stats):
        calls.append((id(self), batch.input_ids_BL.numel()))
        return original(self, batch, stats)

    monkeypatch.setattr(type(budgeted.core.training), "train_micro_batch", counted)
    for actor in (whole, budgeted):
        actor.load_adapter(spec("a", 0, global_batch_size=6))
        actor.load_adapter(spec("b", 1, rank=2, global_batch_size=6))
    with caplog.at_level(logging.INFO, logger="miles.backends.rank.train"):
        stats_budgeted = budgeted.train(samples, adv, counts(samples))
        budgeted.discard_batch()
        budgeted.train(samples, adv, counts(samples))
    stats_whole = whole.train(samples, adv, counts(samples))
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    split = [n for who, n in calls if who == id(budgeted.core.training)]
    assert len(split) >= 4 and all(n <= max(12, longest) for n in split)  # two calls, two or more each
    assert [n for who, n in calls if who == id(whole.core.training)] == [len(samples) * longest]
    assert sum("Training in micro-batches of up to" in r.getMessage() for r in caplog.records) == 1
    for name in ("a", "b"):
        assert abs(stats_whole[name].loss_sum - stats_budgeted[name].loss_sum) < 1e-5
    for slot in (0, 1):
        for got, want in zip(budgeted.core.optimizer.slot_grads(slot), whole.core.optimizer.slot_grads(slot)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # the default budget on CPU is far above this batch, and a micro-batch size wins over it
    assert probe.core.activation_budget.budget_bytes == 1024 * 2**20 and probe.core.budget_tokens(samples) is None
    sized = new_actor(tiny_model_dir, micro_batch_size=4, activation_budget_mb=budget_mb)
    assert sized.core.budget_tokens(samples) is None and len(sized.core.micro_batches(samples, adv)) == 3


def test_a_cpu_rank_runs_the_threads_of_its_reserved_cpus(tiny_model_dir):
    """--actor-num-cpus-per-worker N: Ray reserves N CPUs per rank and the rank runs N torch threads."""
    from miles.backends.common.train_group import TrainGroupConfig
    from miles.utils.arguments import parse_args

    cfg = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--actor-num-cpus-per-worker", "2"])
    group = TrainGroupConfig.from_config(cfg)
    assert group.num_cpus_per_worker == 2.0 and group.actor.num_threads == 2
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        TorchTrainActor(dataclasses.replace(group.actor, n_slots=1, lora_rank=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert TrainGroupConfig.from_config(parse_args(["--hf-checkpoint", "/m"])).num_cpus_per_worker == 1.0


def test_a_rank_class_given_by_dotted_path_is_the_one_the_group_starts(tiny_model_dir):
    """`--train-actor-path`: a subclass of the backend's rank, checked when the group is built."""
    from miles.backends.common.train_group import TrainGroup, TrainGroupConfig
    from miles.backends.torch.train_group import torch_train_group
    from miles.utils.arguments import parse_args
    from miles.utils.plugins import PluginError

    def group(*flags: str) -> TrainGroup:
        cfg = parse_args(["--hf-checkpoint", str(tiny_model_dir), *flags])
        return torch_train_group(TrainGroupConfig.from_config(cfg))

    assert group().rank_class is TorchTrainActor
    assert group("--train-actor-path", f"{__name__}.CountingTrainActor").rank_class is CountingTrainActor
    with pytest.raises(PluginError, match="must be a subclass of miles.backends.torch.actor.TorchTrainActor"):
        group("--train-actor-path", "miles.backends.megatron.actor.MegatronTrainActor")


class CountingTrainActor(TorchTrainActor):
    """A rank that counts its train calls (an extension through `--train-actor-path`)."""

    calls = 0

    def train(self, *args, **kwargs):
        self.calls += 1
        return super().train(*args, **kwargs)

