"""Per-token advantages through the torch DP group over real Ray actors: reinforce++ with
`--kl-coef` (each rank forwards the KL of its share) and `--normalize-advantages` (whitened
over the adapter's whole batch, every rank's share) train two ranks exactly as one.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from miles.backends.base import AdapterSpec
from miles.backends.common.train_group import TrainGroup, TrainGroupConfig
from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.train_group import torch_train_group
from miles.utils.loss_settings import LossSettings
from miles.utils.types import RolloutBatch
from tests.helpers.numerics import AdamBound, reduction_terms, sum_tolerance, within
from tests.helpers.torch_backend_data import make_groups, max_abs_diff

SETTINGS = {
    "a": LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.5, gamma=0.9),
    "b": LossSettings(advantage_estimator="reinforce_plus_plus_baseline", normalize_advantages=True, kl_coef=0.3,
                      kl_loss_type="k3"),
    "c": LossSettings(normalize_advantages=True),
}


def _batch(rollout_id: int, seed: int) -> RolloutBatch:
    groups = [g for slot, name in enumerate(SETTINGS) for g in make_groups(name, slot, 2, 3, seed=seed + slot)]
    return RolloutBatch(rollout_id=rollout_id, samples=[s for g in groups for s in g],
                        prompt_group_sizes=[len(g) for g in groups], groups_per_adapter={n: 2 for n in SETTINGS},
                        step_names=list(SETTINGS))


async def _trained(model_dir, n_workers: int) -> tuple[TrainGroup, list]:
    actor = TrainActorConfig(hf_checkpoint=str(model_dir), n_slots=4, lora_rank=4, micro_batch_size=4)
    group = torch_train_group(TrainGroupConfig(actor=actor, n_workers=n_workers, num_cpus_per_worker=0))
    await group.start()
    for slot, (name, settings) in enumerate(SETTINGS.items()):
        await group.load_adapter(AdapterSpec(name=name, slot=slot, rank=4, alpha=8.0, global_batch_size=6, lr=0.05,
                                             loss=settings))
    results = []
    for rollout_id in range(3):  # the first step leaves the base, so the later KLs are not 0
        batch = _batch(rollout_id, seed=10 * rollout_id)
        results.append((await group.train(rollout_id, batch), await group.step_adapters(batch.step_names),
                        {n: await group.actors[0].optimizer_state.remote(n) for n in SETTINGS}))
    return group, results


def _terms(batch: RolloutBatch, model_dir) -> int:
    """Terms of one gradient element's sum: every token of the batch, times the widest layer."""
    config = json.loads((model_dir / "config.json").read_text())
    return reduction_terms(sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples),
                           max(config["hidden_size"], config["intermediate_size"]))


@pytest.mark.slow
async def test_dp2_equals_dp1_with_kl_shaped_whitened_token_advantages(ray_session, tiny_model_dir):
    (dp1, r1), (dp2, r2) = await asyncio.gather(_trained(tiny_model_dir, 1), _trained(tiny_model_dir, 2))
    # Two ranks sum each gradient in another order than one: everything agrees to the
    # rounding of sums over the batch's tokens, and weights to what AdamW makes of it.
    bounds = {}
    for rollout_id, ((t1, s1, opt1), (t2, s2, _)) in enumerate(zip(r1, r2)):
        terms = _terms(_batch(rollout_id, seed=10 * rollout_id), tiny_model_dir)
        for name in SETTINGS:
            assert t1.adapters[name].loss == pytest.approx(t2.adapters[name].loss,
                                                           abs=sum_tolerance(t1.adapters[name].loss, terms))
            assert s1[name].grad_norm == pytest.approx(s2[name].grad_norm, abs=sum_tolerance(s1[name].grad_norm, terms))
            hyper = opt1[name].hyper
            bound = bounds.setdefault(name, AdamBound(lr=hyper["lr"], beta2=hyper["betas"][1], adam_eps=hyper["eps"]))
            bound.observe([opt1[name].exp_avg_sq[k] for k in sorted(opt1[name].exp_avg_sq)], terms)
    kl = await dp1.actors[0].reward_kl.remote(_batch(9, seed=99).samples)
    assert max(abs(v) for k in kl for v in k) > 1e-4  # the KL shaping was live
    for name in SETTINGS:
        w1 = await dp1.actors[0].export_adapter.remote(name)
        w2 = await dp2.actors[0].export_adapter.remote(name)
        # The moments are keyed by parameter name, the export by PEFT's: the same tensors in the same order.
        assert sorted(w1) == sorted(w2) == sorted(f"base_model.model.{k}.weight" for k in r1[-1][2][name].exp_avg_sq)
        assert within([w1[k] for k in sorted(w1)], [w2[k] for k in sorted(w2)], bounds[name].bound) <= 1
        assert bounds[name].median() < 0.05 / 10  # tight enough to see a wrong update (lr 0.05)
        assert max_abs_diff(w2, await dp2.actors[1].export_adapter.remote(name)) == 0.0  # ranks agree
    await dp1.shutdown()
    await dp2.shutdown()
