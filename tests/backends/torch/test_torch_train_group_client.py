"""Client work through the Ray `TrainGroup`: datums dealt over DP ranks, outputs put back in order.

A client adapter trained by a DP=2 group in calls mixed with another client adapter and a
server-driven RL batch (whose first call fails on rank 1, so rank 0 must take back its
share) equals the same adapter trained alone by a DP=1 group.
"""

from __future__ import annotations

import pytest
import ray
import torch

from miles.backends.common.train_group import TrainGroup, TrainGroupConfig, deal_datums
from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.train_group import torch_train_group
from miles.utils.types import RolloutBatch
from miles.utils.types.client import AdamStep, ClientDatum
from tests.helpers.fault_injection import RANK_1_FAILS_FIRST, InjectedTrainFault
from tests.helpers.torch_backend_data import client_datums, client_work, make_groups, max_abs_diff, spec

pytestmark = pytest.mark.slow

ADAM = AdamStep(learning_rate=0.02, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)


def _rollout(rollout_id: int, groups) -> RolloutBatch:
    return RolloutBatch(rollout_id=rollout_id, samples=[s for g in groups for s in g],
                        prompt_group_sizes=[len(g) for g in groups],
                        groups_per_adapter={"rl": len(groups)} if groups else {}, step_names=[])


async def _group(model_dir, n_workers: int, actor_path: str | None = None) -> TrainGroup:
    actor = TrainActorConfig(hf_checkpoint=str(model_dir), n_slots=4, lora_rank=4, micro_batch_size=3)
    group = torch_train_group(TrainGroupConfig(actor=actor, n_workers=n_workers, num_cpus_per_worker=0,
                                        actor_path=actor_path))
    await group.start()
    return group


async def _weights(group: TrainGroup, name: str) -> dict[str, torch.Tensor]:
    return ray.get((await group.export_adapter(name)).tensors)


def test_datums_are_dealt_round_robin_across_works():
    works = [client_work("a", 0, client_datums("ppo", 3, seed=1), "ppo"),
             client_work("b", 1, client_datums("ppo", 1, seed=2), "ppo")]
    assert deal_datums(works, 2) == [[[0, 2], []], [[1], [0]]]
    assert deal_datums(works, 1) == [[[0, 1, 2], [0]]]


async def test_dp2_mixed_calls_equal_dp1_alone_and_a_failed_call_counts_nowhere(ray_session, tiny_model_dir,
                                                                                 tmp_path):
    dp2 = await _group(tiny_model_dir, 2, RANK_1_FAILS_FIRST)
    dp1 = await _group(tiny_model_dir, 1)
    try:
        await dp2.load_adapter(spec("rl", 0, global_batch_size=4))
        await dp2.load_adapter(spec("c1", 1))
        await dp2.load_adapter(spec("c2", 2, rank=2))
        await dp1.load_adapter(spec("c1", 3))
        ppo, sft = client_datums("ppo", 5, seed=11), client_datums("cross_entropy", 3, seed=12)
        mixed = [client_work("c1", 1, ppo, "ppo"), client_work("c2", 2, sft, "cross_entropy")]
        rl = _rollout(0, make_groups("rl", 0, 2, 2, seed=13))
        with pytest.raises(InjectedTrainFault):  # rank 1 fails; rank 0 takes its share back
            await dp2.train(0, rl, client=mixed)
        result = await dp2.train(1, rl, client=mixed)
        alone = await dp1.train(0, _rollout(0, []), client=[client_work("c1", 3, ppo, "ppo")])
        assert result.samples == 4 and set(result.adapters) == {"rl"}
        assert [len(outputs) for outputs in result.client] == [5, 3] and len(alone.client) == 1
        for got, want in zip(result.client[0], alone.client[0]):
            assert got.outputs["logprobs"] == pytest.approx(want.outputs["logprobs"], abs=1e-5)
            assert got.loss == pytest.approx(want.loss, abs=1e-5)
        assert all("elementwise_loss" in output.outputs for output in result.client[1])
        stats = await dp2.step_adapters(["rl", "c1", "c2"], adam={"c1": ADAM, "c2": ADAM})
        stats_alone = await dp1.step_adapters(["c1"], adam={"c1": ADAM})
        assert stats["c1"].grad_norm == pytest.approx(stats_alone["c1"].grad_norm, rel=1e-5)
        trained = await _weights(dp2, "c1")
        assert max_abs_diff(trained, await _weights(dp1, "c1")) <= 1e-5
        assert any(float(v.abs().sum()) > 0 for k, v in trained.items() if "lora_B" in k)  # it did step

        # A forward scores the same on both groups; a bad datum fails the call and changes nothing.
        probe = client_datums("dro", 3, seed=14)
        forward2 = await dp2.train(2, _rollout(2, []), client=[client_work("c1", 1, probe, "dro", backward=False)])
        forward1 = await dp1.train(1, _rollout(1, []), client=[client_work("c1", 3, probe, "dro", backward=False)])
        for got, want in zip(forward2.client[0], forward1.client[0]):
            assert got.outputs["logprobs"] == pytest.approx(want.outputs["logprobs"], abs=1e-5)
        bad = ClientDatum(tokens=[1, 2], inputs={"target_tokens": [1]})
        with pytest.raises(ValueError, match="'target_tokens' has 1 values for 2 tokens"):
            await dp1.train(2, _rollout(2, []), client=[client_work("c1", 3, probe[:1] + [bad], "dro")])
        beyond = ClientDatum(tokens=[1, 2], inputs={"target_tokens": [1, 100], "logprobs": [-1.0, -1.0],
                                                    "advantages": [1.0, 1.0]})
        with pytest.raises(ValueError, match=r"datum 1: target_tokens holds \[100\], outside the model's vocabulary"):
            await dp2.train(3, _rollout(3, []), client=[client_work("c1", 1, probe[:1] + [beyond], "dro")])
        await dp1.step_adapters(["c1"], adam={"c1": ADAM})  # nothing accumulated: moments decay, no new gradient
        await dp2.step_adapters(["c1"], adam={"c1": ADAM})
        assert max_abs_diff(await _weights(dp2, "c1"), await _weights(dp1, "c1")) <= 1e-5

        # save_state on the DP=2 group, load_state on the DP=1 group: the same weights.
        path = await dp2.save_client_state("c1", str(tmp_path / "c1-state"))
        await dp1.load_client_state("c1", str(path), optimizer=True)
        assert max_abs_diff(await _weights(dp2, "c1"), await _weights(dp1, "c1")) == 0.0

        # A page-out on the DP=2 group writes the pending gradient summed over its ranks: paged
        # in on the DP=1 group, the next step there is the DP=2 group's own.
        pending = client_datums("cispo", 4, seed=15)
        await dp2.train(4, _rollout(4, []), client=[client_work("c1", 1, pending, "cispo")])
        paged = await dp2.save_client_state("c1", str(tmp_path / "c1-paged"), pending=True)
        await dp1.cleanup_adapter("c1")
        await dp1.load_adapter(spec("c1", 0))
        await dp1.load_client_state("c1", str(paged))
        await dp2.step_adapters(["c1"], adam={"c1": ADAM})
        await dp1.step_adapters(["c1"], adam={"c1": ADAM})
        assert max_abs_diff(await _weights(dp2, "c1"), await _weights(dp1, "c1")) <= 1e-5
    finally:
        await dp2.shutdown()
        await dp1.shutdown()
