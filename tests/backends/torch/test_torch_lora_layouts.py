"""Tinker LoRA layouts on one train rank: a model that freezes some of its LoRA layers
(`train_attn=False`, `train_mlp=False`) is the base model on them, exactly, and its rows of
those layers (A, B and moments) never change, however it is batched with other slots.
"""

from __future__ import annotations

import json

import pytest
import torch

from miles.backends.torch.lm_head import fused_head_weight
from miles.lora import read_peft_dir
from miles.utils.types.client import AdamStep
from miles.utils.types.client_commands import LoraGroup
from tests.helpers.torch_backend_data import (
    client_datums,
    client_work,
    counts,
    flatten_with_advantages,
    make_groups,
    max_abs_diff,
    new_actor,
    spec,
)

ADAM = AdamStep(learning_rate=0.02, beta1=0.8, beta2=0.9, eps=1e-4, weight_decay=0.1, grad_clip_norm=0.5)
"""Weight decay on: a frozen row must not even decay. An eps well above the rounding of a
co-batched gradient (~1e-8): Adam's first steps turn a gradient element near 0 into a step
of +-lr times g / (|g| + eps), which would magnify that rounding into the weights."""


def slot_rows(actor, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(weight, exp_avg, exp_avg_sq) rows of `slot` per LoRA parameter name (copies)."""
    core = actor.core
    return {name: (param[slot].detach().clone(), m[slot].clone(), v[slot].clone())
            for name, (param, _), m, v in zip(core.model.param_names, core.model.lora_params,
                                              core.optimizer.exp_avg, core.optimizer.exp_avg_sq)}


def group(param_name: str) -> LoraGroup:
    return LoraGroup.of(param_name.rsplit(".", 1)[0])


def test_a_frozen_layer_is_the_base_and_never_changes_in_a_mixed_batch(tiny_model_dir):
    mixed, alone = new_actor(tiny_model_dir, micro_batch_size=5), new_actor(tiny_model_dir)
    mixed.load_adapter(spec("rl", 0, global_batch_size=4))
    mixed.load_adapter(spec("full", 1, seed=3))
    mixed.load_adapter(spec("no-attn", 2, seed=3, frozen=frozenset({LoraGroup.ATTN})))
    alone.load_adapter(spec("no-attn", 0, seed=3, frozen=frozenset({LoraGroup.ATTN})))
    before = slot_rows(mixed, 2)
    assert all(torch.count_nonzero(w) == 0 for name, (w, _, _) in before.items() if name.endswith(".lora_B"))
    for step in range(2):
        full_data, frozen_data = client_datums("ppo", 3, seed=10 + step), client_datums("cross_entropy", 4, seed=step)
        samples, adv = flatten_with_advantages(make_groups("rl", 0, 2, 2, seed=30 + step))
        result = mixed.train_batch(samples, adv, counts(samples), client=[
            client_work("full", 1, full_data, "ppo"), client_work("no-attn", 2, frozen_data, "cross_entropy")])
        result_alone = alone.train_batch([], [], {}, client=[client_work("no-attn", 0, frozen_data, "cross_entropy")])
        for got, want in zip(result.client[1], result_alone.client[0]):
            assert got.outputs["logprobs"] == pytest.approx(want.outputs["logprobs"], abs=1e-5)
        stats = mixed.step_adapters(["rl", "full", "no-attn"], adam={"full": ADAM, "no-attn": ADAM})
        stats_alone = alone.step_adapters(["no-attn"], adam={"no-attn": ADAM})
        # the norm is that of the layers it trains only
        assert stats["no-attn"].grad_norm == pytest.approx(stats_alone["no-attn"].grad_norm, abs=1e-5)
    after, full = slot_rows(mixed, 2), slot_rows(mixed, 1)
    for name, (weight, m, v) in after.items():
        if group(name) is LoraGroup.ATTN:
            assert torch.equal(weight, before[name][0]), name  # never stepped, not even decayed
            assert torch.count_nonzero(m) == 0 and torch.count_nonzero(v) == 0, name
            if name.endswith(".lora_B"):
                assert torch.count_nonzero(weight) == 0, name  # the base on this layer, exactly
                assert torch.count_nonzero(full[name][0]) > 0, name  # the other slot's moved
        else:
            assert not torch.equal(weight, before[name][0]), name
    assert max_abs_diff(mixed.export_adapter("no-attn"), alone.export_adapter("no-attn")) <= 1e-5


@pytest.mark.parametrize("trained", [LoraGroup.ATTN, LoraGroup.MLP])
def test_a_layout_that_trains_one_group_trains_only_that(tiny_model_dir, tmp_path, trained):
    frozen = frozenset(set(LoraGroup) - {trained})
    actor = new_actor(tiny_model_dir)
    actor.load_adapter(spec("one", 1, frozen=frozen))
    before = slot_rows(actor, 1)
    for seed in range(2):
        actor.train_batch([], [], {}, client=[client_work("one", 1, client_datums("importance_sampling", 3, seed),
                                                          "importance_sampling")])
        actor.step_adapters(["one"], adam={"one": ADAM})
    for name, (weight, m, _) in slot_rows(actor, 1).items():
        assert torch.equal(weight, before[name][0]) == (group(name) is not trained), name
        assert (torch.count_nonzero(m) > 0) == (group(name) is trained), name

    # Exports and checkpoints list the layers it trains only; a load gives the rest zero B.
    exported = actor.export_adapter("one")
    assert exported and all(LoraGroup.of(k.split("base_model.model.")[1].rsplit(".", 2)[0]) is trained
                            for k in exported)
    config = actor.core.peft_config(actor.core.loaded("one").spec)
    short = {"q_proj", "k_proj", "v_proj", "o_proj"} if trained is LoraGroup.ATTN else \
        {"gate_proj", "up_proj", "down_proj"}
    assert set(config["target_modules"]) == short
    path = actor.save_client_state("one", str(tmp_path / "state"))
    tensors, saved = read_peft_dir(path)
    assert tensors.keys() == exported.keys() and saved["target_modules"] == config["target_modules"]
    resumed = new_actor(tiny_model_dir)
    resumed.load_adapter(spec("again", 3, frozen=frozen))
    resumed.load_client_state("again", path)
    assert max_abs_diff(resumed.export_adapter("again"), exported) == 0.0
    for name, (weight, m, v) in slot_rows(resumed, 3).items():
        if group(name) is not trained and name.endswith(".lora_B"):
            assert torch.count_nonzero(weight) == 0 and torch.count_nonzero(m) == 0 and torch.count_nonzero(v) == 0
    data = client_datums("cispo", 3, seed=9)
    for a, name, slot in ((actor, "one", 1), (resumed, "again", 3)):
        a.train_batch([], [], {}, client=[client_work(name, slot, data, "cispo")])
        a.step_adapters([name], adam={name: ADAM})
    assert max_abs_diff(resumed.export_adapter("again"), actor.export_adapter("one")) <= 1e-6
    assert json.loads((tmp_path / "state" / "adapter_config.json").read_text())["r"] == 4
    assert fused_head_weight(actor.core.model.module) is not None  # the head stays the plain one
