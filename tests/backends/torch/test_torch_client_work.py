"""Client-driven adapters (the Tinker protocol) on one train rank, in-process.

Every equality is between two ways of training the same client adapter on the same
datums: mixed into a train call with another client adapter and a server-driven RL batch,
or alone; in two calls or one; through the slot optimizer or `torch.optim.AdamW`.
"""

from __future__ import annotations

import pytest
import torch

from miles.backends.rank.config import TrainActorConfig
from miles.utils.types.client import AdamStep, ClientDatum
from tests.helpers.fault_injection import FaultInjectingTrainActor, InjectedTrainFault
from tests.helpers.numerics import AdamBound, reduction_terms, sum_tolerance, within
from tests.helpers.torch_backend_data import (
    VOCAB,
    client_datums,
    client_work,
    counts,
    flatten_with_advantages,
    make_groups,
    max_abs_diff,
    new_actor,
    spec,
)


def slot_grads(actor, slot: int) -> list[torch.Tensor]:
    return [g.clone() for g in actor.core.optimizer.slot_grads(slot)]


ADAM = AdamStep(learning_rate=0.02, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)


def test_a_client_adapter_in_a_mixed_call_equals_the_adapter_trained_alone(tiny_model_dir):
    mixed = new_actor(tiny_model_dir, micro_batch_size=5)
    alone = new_actor(tiny_model_dir, micro_batch_size=2)
    mixed.load_adapter(spec("rl", 0, global_batch_size=4))
    mixed.load_adapter(spec("ppo-client", 1))
    mixed.load_adapter(spec("sft-client", 2, rank=3))
    alone.load_adapter(spec("ppo-client", 3))  # another slot: the slot index must not matter
    initial = alone.export_adapter("ppo-client")
    rows = alone.core.optimizer
    width = max(p.shape[-1] for p, _ in rows.params)
    adam = AdamBound(lr=ADAM.learning_rate, beta2=ADAM.beta2, adam_eps=ADAM.eps)
    for step in range(2):
        ppo_data, sft_data = client_datums("ppo", 3, seed=10 + step), client_datums("cross_entropy", 4, seed=20 + step)
        samples, adv = flatten_with_advantages(make_groups("rl", 0, 2, 2, seed=30 + step))
        config = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.4}
        result = mixed.train_batch(samples, adv, counts(samples), client=[
            client_work("ppo-client", 1, ppo_data, "ppo", config=config),
            client_work("sft-client", 2, sft_data, "cross_entropy")])
        result_alone = alone.train_batch([], [], {},
                                         client=[client_work("ppo-client", 3, ppo_data, "ppo", config=config)])
        assert "rl" in result.stats and "ppo-client" not in result.stats
        assert [len(outputs) for outputs in result.client] == [3, 4]
        # The mixed call's sums run over every row of the call: they agree to the rounding of sums that size.
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) + sum(
            len(d.tokens) for d in [*ppo_data, *sft_data])
        terms = reduction_terms(tokens, width)
        for got, want in zip(result.client[0], result_alone.client[0]):
            assert got.loss == pytest.approx(want.loss, abs=sum_tolerance(want.loss, terms))
            assert got.outputs["logprobs"] == pytest.approx(
                want.outputs["logprobs"], abs=sum_tolerance(max(map(abs, want.outputs["logprobs"])), terms))
        stats = mixed.step_adapters(["rl", "ppo-client", "sft-client"], adam={"ppo-client": ADAM, "sft-client": ADAM})
        stats_alone = alone.step_adapters(["ppo-client"], adam={"ppo-client": ADAM})
        adam.observe([v[3] for v in rows.exp_avg_sq], terms)
        assert stats["ppo-client"].grad_norm == pytest.approx(
            stats_alone["ppo-client"].grad_norm, abs=sum_tolerance(stats_alone["ppo-client"].grad_norm, terms))
        assert stats["ppo-client"].lr == ADAM.learning_rate
    # Each weight moves as far apart as AdamW's division by its own RMS lets the gradients' rounding take it.
    assert within([p[1] for p, _ in mixed.core.optimizer.params], [p[3] for p, _ in rows.params], adam.bound) <= 1
    assert adam.median() < ADAM.learning_rate / 10  # a bound tight enough to see a wrong update
    assert max_abs_diff(mixed.export_adapter("ppo-client"), initial) > 1e-3  # it did learn something


def test_the_logprobs_score_each_positions_own_target(tiny_model_dir):
    """A datum's logprobs are those of its targets, not of the next input token."""
    from transformers import AutoModelForCausalLM

    actor = new_actor(tiny_model_dir)
    actor.load_adapter(spec("c", 0))
    data = client_datums("cross_entropy", 2, seed=1)
    result = actor.train_batch([], [], {}, client=[client_work("c", 0, data, "cross_entropy", backward=False)])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # a fresh adapter (B = 0) is the base
    for datum, output in zip(data, result.client[0]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([datum.tokens])).logits[0].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(datum.inputs["target_tokens"])[:, None])[:, 0]
        assert output.outputs["logprobs"] == pytest.approx(want.tolist(), abs=1e-5)
        weights = torch.tensor(datum.inputs["weights"])
        assert output.loss == pytest.approx(float(-(want * weights).sum()), abs=1e-5)


def test_forward_gives_the_logprobs_of_forward_backward_and_leaves_the_slot_alone(tiny_model_dir):
    actor = new_actor(tiny_model_dir)
    actor.load_adapter(spec("c", 1))
    warm = client_datums("importance_sampling", 3, seed=2)
    actor.train_batch([], [], {}, client=[client_work("c", 1, warm, "importance_sampling")])
    actor.step_adapters(["c"], adam={"c": ADAM})  # B != 0: the adapter changes the logprobs
    actor.train_batch([], [], {}, client=[client_work("c", 1, warm, "importance_sampling")])  # a gradient waits
    weights, grads = actor.export_adapter("c"), slot_grads(actor, 1)
    probe = client_datums("ppo", 3, seed=3)
    forward = actor.train_batch([], [], {}, client=[client_work("c", 1, probe, "ppo", backward=False)])
    assert all(torch.equal(a, b) for a, b in zip(slot_grads(actor, 1), grads))
    assert all(torch.equal(actor.export_adapter("c")[k], weights[k]) for k in weights)
    fb = actor.train_batch([], [], {}, client=[client_work("c", 1, probe, "ppo")])
    for got, want in zip(forward.client[0], fb.client[0]):
        assert got.outputs["logprobs"] == pytest.approx(want.outputs["logprobs"], abs=1e-6)
        assert got.loss == pytest.approx(want.loss, abs=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(slot_grads(actor, 1), grads))


def test_gradients_accumulate_over_calls_until_the_step(tiny_model_dir):
    split, whole = new_actor(tiny_model_dir), new_actor(tiny_model_dir)
    for actor in (split, whole):
        actor.load_adapter(spec("c", 0))
    first, second = client_datums("cispo", 3, seed=4), client_datums("cispo", 2, seed=5)
    split.train_batch([], [], {}, client=[client_work("c", 0, first, "cispo")])
    split.train_batch([], [], {}, client=[client_work("c", 0, second, "cispo")])
    whole.train_batch([], [], {}, client=[client_work("c", 0, first, "cispo"), client_work("c", 0, second, "cispo")])
    for a, b in zip(slot_grads(split, 0), slot_grads(whole, 0)):
        assert torch.allclose(a, b, atol=1e-6)
    split.step_adapters(["c"], adam={"c": ADAM})
    whole.step_adapters(["c"], adam={"c": ADAM})
    assert max_abs_diff(split.export_adapter("c"), whole.export_adapter("c")) <= 1e-5
    assert all(torch.count_nonzero(g) == 0 for g in slot_grads(split, 0))  # the step zeroed them


@pytest.mark.parametrize("adam", [
    ADAM,
    AdamStep(learning_rate=0.05, beta1=0.5, beta2=0.99, eps=1e-3, weight_decay=0.0, grad_clip_norm=0.0),
    AdamStep(learning_rate=0.01),  # Tinker's defaults: betas (0.9, 0.95), eps 1e-12, no decay, no clip
])
def test_adam_step_settings_are_those_of_torch_adamw(tiny_model_dir, adam):
    actor = new_actor(tiny_model_dir, lora_rank=4, clip_grad=1.0)
    actor.load_adapter(spec("c", 2, rank=4, lr=0.5, weight_decay=0.3))  # the spec's lr and decay must not count
    params = [(p, p.detach()[2].clone()) for p, _ in actor.core.optimizer.params]
    reference = [start.clone().requires_grad_(True) for _, start in params]
    optimizer = torch.optim.AdamW(reference, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                  weight_decay=adam.weight_decay)
    for step in range(3):
        actor.train_batch([], [], {}, client=[client_work("c", 2, client_datums("dro", 3, seed=40 + step), "dro")])
        for ref, grad in zip(reference, slot_grads(actor, 2)):
            ref.grad = grad
        norm = torch.nn.utils.clip_grad_norm_(reference, adam.grad_clip_norm or float("inf"))
        optimizer.step()
        stats = actor.step_adapters(["c"], adam={"c": adam})
        assert stats["c"].grad_norm == pytest.approx(float(norm), rel=1e-5)
        for (param, _), ref in zip(params, reference):
            assert torch.allclose(param.detach()[2], ref.detach(), atol=1e-6, rtol=1e-5)


def test_a_failed_call_leaves_no_client_gradient(tiny_model_dir):
    config = TrainActorConfig(hf_checkpoint=str(tiny_model_dir), n_slots=4, lora_rank=4, micro_batch_size=2)
    actor = FaultInjectingTrainActor.failing({(-1, 2), (-1, 3)})(config)
    actor.load_adapter(spec("c", 0))
    actor.load_adapter(spec("rl", 1))
    actor.train_batch([], [], {}, client=[client_work("c", 0, client_datums("gspo", 2, seed=6), "gspo")])  # kept
    kept = slot_grads(actor, 0)
    assert any(torch.count_nonzero(g) for g in kept)
    samples, adv = flatten_with_advantages(make_groups("rl", 1, 2, 2, seed=7))
    for _ in range(2):  # calls 2 and 3 fail after their first micro-batch's backward
        with pytest.raises(InjectedTrainFault):
            actor.train_batch(samples, adv, counts(samples), client=[
                client_work("c", 0, client_datums("gspo", 5, seed=8), "gspo")])
        assert all(torch.equal(a, b) for a, b in zip(slot_grads(actor, 0), kept))
        assert all(torch.count_nonzero(g) == 0 for g in slot_grads(actor, 1))


def test_an_invalid_datum_fails_the_call_before_any_gradient(tiny_model_dir):
    actor = new_actor(tiny_model_dir)
    actor.load_adapter(spec("c", 0))
    good = client_datums("ppo", 2, seed=9)
    bad = ClientDatum(tokens=[5, 6, 7], inputs={"target_tokens": [5, 6, VOCAB], "logprobs": [-1.0] * 3,
                                                "advantages": [1.0] * 3})
    with pytest.raises(ValueError, match="datum 2: target_tokens holds"):
        actor.train_batch([], [], {}, client=[client_work("c", 0, good + [bad], "ppo")])
    with pytest.raises(ValueError, match="names slot 1"):
        actor.train_batch([], [], {}, client=[client_work("c", 1, good, "ppo")])
    assert all(torch.count_nonzero(g) == 0 for g in slot_grads(actor, 0))


def test_save_state_then_load_state_continues_as_if_never_stopped(tiny_model_dir, tmp_path):
    straight, resumed = new_actor(tiny_model_dir), new_actor(tiny_model_dir)
    straight.load_adapter(spec("c", 0))
    straight.train_batch([], [], {}, client=[client_work("c", 0, client_datums("ppo", 3, seed=50), "ppo")])
    straight.step_adapters(["c"], adam={"c": ADAM})
    straight.train_batch([], [], {}, client=[client_work("c", 0, client_datums("ppo", 2, seed=51), "ppo")])
    path = straight.save_client_state("c", str(tmp_path / "state" / "step-1"))  # the pending gradient is not saved
    assert path == str(tmp_path / "state" / "step-1")
    resumed.load_adapter(spec("other-name", 2))
    resumed.train_batch([], [], {}, client=[client_work("other-name", 2, client_datums("dro", 2, seed=52), "dro")])
    resumed.load_client_state("other-name", path)  # weights, moments and step; its own gradient dropped
    assert all(torch.count_nonzero(g) == 0 for g in slot_grads(resumed, 2))
    assert max_abs_diff(resumed.export_adapter("other-name"), straight.export_adapter("c")) == 0.0
    assert resumed.optimizer_state("other-name").step == 1
    assert straight.optimizer_state("c").hyper == {"lr": 0.02, "weight_decay": 0.1, "betas": [0.8, 0.9], "eps": 1e-6,
                                                   "grad_clip_norm": 0.5}  # the latest AdamStep's
    straight.core.optimizer.zero_slot_grad(0)
    data = client_datums("cispo", 3, seed=53)
    for actor, name, slot in ((straight, "c", 0), (resumed, "other-name", 2)):
        actor.train_batch([], [], {}, client=[client_work(name, slot, data, "cispo")])
        actor.step_adapters([name], adam={name: ADAM})
    assert max_abs_diff(resumed.export_adapter("other-name"), straight.export_adapter("c")) <= 1e-6

    weights_only = new_actor(tiny_model_dir)
    weights_only.load_adapter(spec("w", 1))
    weights_only.load_client_state("w", path, optimizer=False)
    state = weights_only.optimizer_state("w")
    assert state.step == 0 and all(torch.count_nonzero(m) == 0 for m in state.exp_avg.values())
    wrong_rank = new_actor(tiny_model_dir)
    wrong_rank.load_adapter(spec("r", 0, rank=2))
    with pytest.raises(ValueError, match="rank-4 alpha-8.0 adapter but model 'r' has rank 2"):
        wrong_rank.load_client_state("r", path)


def test_a_client_seed_fixes_the_fresh_adapter_whatever_its_name(tiny_model_dir):
    actor = new_actor(tiny_model_dir)
    actor.load_adapter(spec("s1", 0, seed=7))
    actor.load_adapter(spec("s2", 1, seed=7))
    actor.load_adapter(spec("s3", 2, seed=8))
    assert max_abs_diff(actor.export_adapter("s1"), actor.export_adapter("s2")) == 0.0
    assert max_abs_diff(actor.export_adapter("s1"), actor.export_adapter("s3")) > 1e-3


def test_a_paged_out_model_comes_back_bit_for_bit_and_trains_on_as_if_never_paged(tiny_model_dir, tmp_path):
    """A page-out (`--multi-lora-idle-evict-s`) writes weights, moments, the gradient of the calls
    not yet stepped and the clock; loaded into another slot it is the same model exactly."""
    kept, paged = new_actor(tiny_model_dir), new_actor(tiny_model_dir)
    for actor in (kept, paged):
        actor.load_adapter(spec("c", 0, seed=5))
        actor.train_batch([], [], {}, client=[client_work("c", 0, client_datums("ppo", 3, seed=60), "ppo")])
        actor.step_adapters(["c"], adam={"c": ADAM})
        actor.train_batch([], [], {}, client=[client_work("c", 0, client_datums("ppo", 2, seed=61), "ppo")])
    before = (paged.export_adapter("c"), paged.optimizer_state("c"), slot_grads(paged, 0), paged.schedule_state("c"))
    assert any(torch.count_nonzero(g) for g in before[2])  # a gradient is pending
    path = paged.save_client_state("c", str(tmp_path / "paged"), paged.accumulated_grad("c").tensors)
    paged.cleanup_adapter("c")
    paged.load_adapter(spec("other", 0))  # its slot goes to another model meanwhile
    paged.load_adapter(spec("c", 2, seed=5))
    paged.load_client_state("c", path)

    weights, moments, grads, clock = (paged.export_adapter("c"), paged.optimizer_state("c"), slot_grads(paged, 2),
                                      paged.schedule_state("c"))
    assert all(torch.equal(weights[k], before[0][k]) for k in weights) and weights.keys() == before[0].keys()
    assert moments.step == before[1].step == 1
    for got, want in ((moments.exp_avg, before[1].exp_avg), (moments.exp_avg_sq, before[1].exp_avg_sq)):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert all(torch.equal(a, b) for a, b in zip(grads, before[2], strict=True))
    assert clock == before[3]

    data = client_datums("cispo", 3, seed=62)
    outputs = []
    for actor, slot in ((kept, 0), (paged, 2)):
        outputs.append(actor.train_batch([], [], {}, client=[client_work("c", slot, data, "cispo")]).client[0])
        actor.step_adapters(["c"], adam={"c": ADAM})
    for got, want in zip(outputs[1], outputs[0], strict=True):
        assert got.loss == want.loss and got.outputs["logprobs"] == want.outputs["logprobs"]
    assert max_abs_diff(paged.export_adapter("c"), kept.export_adapter("c")) == 0.0
