"""The Megatron backend at TP = 1 and TP = 2 (gloo, spawned ranks) against the torch backend.

Same tiny model, same adapters, same samples, fp32: logits and logprobs of mixed-slot
batches (slot -1 included) within 1e-5, one step of two adapters within 1e-5 with the
co-tenant untouched bit for bit, and checkpoints that cross between the backends (a
Megatron checkpoint written at TP = 2 loads in PEFT with the torch backend's logprobs
and resumes in the torch backend; a torch checkpoint resumes in Megatron; the gradient of
an unfinished window is saved whole and resumes into the TP shards).
"""

from __future__ import annotations

import copy

import pytest
import torch

from miles.backends.common.checkpoint import read_checkpoint
from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.actor import TorchTrainActor
from tests.helpers.megatron_scenario import (
    RANK,
    logit_input_ids,
    logprob_samples,
    run_megatron,
    run_megatron_dp,
    run_torch,
    step2_groups,
)
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, max_abs_diff, spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def torch_run(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("megatron_vs_torch")
    return work, run_torch(tiny_model_dir, work)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def runs(request, tiny_model_dir, torch_run):
    work, torch_seen = torch_run
    tp_work = work / f"tp{request.param}"
    tp_work.mkdir()
    (tp_work / "torch_ckpt").symlink_to(work / "torch_ckpt")
    return request.param, tp_work, run_megatron(tiny_model_dir, request.param, tp_work), torch_seen


def _max_list_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_fresh_adapter_equals_torch_init(runs):
    _, _, meg, ref = runs
    assert meg["fresh"].keys() == ref["fresh"].keys()
    assert max_abs_diff(meg["fresh"], ref["fresh"]) == 0.0
    # What a registration is pushed with before any rank loads it is what the load gives.
    for seen in (meg, ref):
        tensors, description = seen["fresh_export"]
        assert max_abs_diff(tensors, seen["fresh"]) == 0.0
        assert description.names == list(tensors) and description.shapes == [list(t.shape) for t in tensors.values()]
        assert description.peft_config["r"] == 4 and description.nbytes == sum(t.numel() * 4 for t in tensors.values())


def test_logits_and_logprobs_of_mixed_slots_equal_torch(runs):
    _, _, meg, ref = runs
    assert meg["logits"].shape == ref["logits"].shape == (*logit_input_ids().shape, 100)
    # fp32 on both sides, the two only sum in another order: measured 2.7e-7 (logits) and
    # 4.8e-7 (TP 2) to 9.5e-7 (TP 1) (logprobs), the tolerance README states is 1e-5; a wrong
    # slot, scale or shard moves them by 1e-2 and more (the slots' spread, checked below).
    assert float((meg["logits"] - ref["logits"]).abs().max()) <= 1e-5
    assert len(meg["logprobs"]) == len(logprob_samples())
    assert _max_list_diff(meg["logprobs"], ref["logprobs"]) <= 1e-5
    # The slots differ from each other and from the base: the comparison is not vacuous.
    assert float((ref["logits"][0] - ref["logits"][2]).abs().max()) > 1e-2


def test_one_step_of_two_adapters_equals_torch_and_spares_the_co_tenant(runs):
    _, _, meg, ref = runs
    for name in ("a", "b"):
        assert max_abs_diff(meg["step1"][name], ref["step1"][name]) <= 1e-5
        assert max_abs_diff(meg["step1"][name], meg["c_before"]) > 1e-3  # they moved
        assert meg["step1_stats"][name].grad_norm == pytest.approx(ref["step1_stats"][name].grad_norm, rel=1e-5)
    assert all(torch.equal(meg["step1"]["c"][k], meg["c_before"][k]) for k in meg["c_before"])
    assert {n: s.samples for n, s in meg["train1"].items()} == {n: s.samples for n, s in ref["train1"].items()}
    for name, stats in meg["train1"].items():
        assert stats.loss_sum == pytest.approx(ref["train1"][name].loss_sum, abs=1e-5)


def test_torch_checkpoint_resumes_in_megatron(runs):
    _, _, meg, ref = runs
    for name in ("a", "a2"):
        assert max_abs_diff(meg["step2"][name], ref["step2"][name]) <= 1e-5


def test_megatron_checkpoint_loads_in_peft_and_resumes_in_torch(runs, tiny_model_dir, torch_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tp, _, meg, ref = runs
    work, _ = torch_run
    ckpt = read_checkpoint(meg["ckpt_a"])
    torch_ckpt = read_checkpoint(work / "torch_ckpt")
    assert ckpt.trainer_state.step == 1 and ckpt.optimizer.step == torch_ckpt.optimizer.step == 1
    assert max_abs_diff(ckpt.optimizer.exp_avg, torch_ckpt.optimizer.exp_avg) <= 1e-6
    assert max_abs_diff(ckpt.optimizer.exp_avg_sq, torch_ckpt.optimizer.exp_avg_sq) <= 1e-8

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), meg["ckpt_a"]).eval()
    ids = logit_input_ids()
    with torch.no_grad():
        peft_logprobs = torch.log_softmax(peft_model(input_ids=ids).logits, -1)
    torch_actor = TorchTrainActor(TrainActorConfig(hf_checkpoint=str(tiny_model_dir), n_slots=4, lora_rank=RANK))
    torch_actor.load_adapter(spec("a", 0, rank=RANK, global_batch_size=6), meg["ckpt_a"])
    from miles.lora import use_slots

    with torch.no_grad(), use_slots(torch_actor.model.module, [0] * len(ids)):
        ours = torch.log_softmax(torch_actor.model.module(input_ids=ids).logits, -1)
    assert float((peft_logprobs - ours).abs().max()) <= 1e-4

    # Resumed in the torch backend, one more step equals the torch run's own continuation.
    torch_actor.load_adapter(spec("a2", 3, rank=RANK, global_batch_size=4), str(work / "torch_ckpt"))
    samples, adv = flatten_with_advantages(step2_groups())
    torch_actor.train(samples, adv, counts(samples))
    torch_actor.step_adapters(["a", "a2"])
    assert max_abs_diff(torch_actor.export_adapter("a"), ref["step2"]["a"]) <= 1e-5


def test_two_data_parallel_replicas_step_like_one_torch_rank(tiny_model_dir, torch_run):
    """Groups split over two DP replicas, gradients summed over DP at the step: each
    replica ends with the torch backend's single-rank update; c is untouched."""
    work, ref = torch_run
    dp_work = work / "dp2"
    dp_work.mkdir()
    replicas = run_megatron_dp(tiny_model_dir, dp_work)
    for seen in replicas:
        for name in ("a", "b"):
            assert max_abs_diff(seen[name], ref["step1"][name]) <= 1e-5
        assert all(torch.equal(seen["c"][k], ref["c_before"][k]) for k in seen["c"])


def test_a_mid_window_gradient_is_saved_whole_and_resumes_into_the_shards(runs):
    """a's gradient of one group of a window, gathered over TP into the checkpoint, equals the
    torch backend's; put back into the shards, the resumed copy a3 finishes the window as a does."""
    _, _, meg, ref = runs
    saved, torch_saved = read_checkpoint(meg["ckpt_a_mid"]), read_checkpoint(ref["ckpt_a_mid"])
    assert saved.trainer_state.accumulated_groups == 1 and saved.accumulated_grad is not None
    grad, torch_grad = saved.accumulated_grad.tensors, torch_saved.accumulated_grad.tensors
    assert {k: v.shape for k, v in grad.items()} == {k: v.shape for k, v in torch_grad.items()}
    assert max_abs_diff(grad, torch_grad) <= 1e-5 * max(float(v.abs().max()) for v in torch_grad.values())
    assert max_abs_diff(meg["step3"]["a3"], meg["step3"]["a"]) <= 1e-6
    assert max_abs_diff(meg["step3"]["a"], ref["step3"]["a"]) <= 1e-5
