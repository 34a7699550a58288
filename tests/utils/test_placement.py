"""Placement on a two-node Ray cluster on one machine (`ray.cluster_utils.Cluster`, loopback).

Two train ranks of one CPU each on two one-CPU nodes: one bundle per rank puts them on
different nodes, they rendezvous at rank 0's node address, and a train step all-reduces
over that process group: both ranks hold the weights (and gradient norm) one rank alone
reaches on the whole batch. Then the same for the two tensor-parallel ranks of one Megatron
replica (placed by the same `TrainGroup.start`), whose gradient norm is summed over the TP
shards on the two nodes. Runs in its own process: the suite's Ray session stays untouched.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import asyncio, json, sys
    import ray
    from ray.cluster_utils import Cluster
    from miles.backends.base import AdapterSpec
    from miles.backends.megatron.actor import MegatronActorConfig
    from miles.backends.common.train_group import TrainGroupConfig
    from miles.backends.megatron.train_group import MegatronGroupConfig, megatron_train_group
    from miles.backends.torch.actor import TrainActorConfig
    from miles.backends.torch.train_group import torch_train_group
    from miles.utils.types import RolloutBatch, Sample

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False)

    def max_diff(x, y):
        assert sorted(x) == sorted(y), (sorted(x), sorted(y))
        return max(float((x[k] - y[k]).abs().max()) for k in x)

    async def weights(group):
        export = await group.export_adapter("a")  # every rank takes part (Megatron's TP gather)
        return ray.get(export.tensors) if isinstance(export.tensors, ray.ObjectRef) else export.tensors

    async def train_once(group, each_rank=False):
        """One train call and step of adapter a on two distinct prompt groups (one per rank of
        two); a's weights before and after, and with `each_rank` every rank's own after."""
        await group.start()
        nodes = ray.util.placement_group_table(group.ranks.placement)["bundles_to_node_id"]
        address = await group.actors[0].master_address.remote()
        await group.load_adapter(AdapterSpec(name="a", slot=0, rank=2, alpha=4.0, global_batch_size=4, lr=0.1))
        fresh = await weights(group)
        samples = [Sample(adapter="a", slot=0, group_index=g, index=i, prompt="", label=None, metadata={},
                          prompt_ids=[5 + g, 6, 7], response_ids=[8 + i + 3 * g, 9], reward=float(i))
                   for g in range(2) for i in range(2)]
        await group.train(0, RolloutBatch(rollout_id=0, samples=samples, prompt_group_sizes=[2, 2],
                                          groups_per_adapter={"a": 2}, step_names=["a"]))
        steps = await group.step_adapters(["a"])
        stepped = await weights(group)
        ranks = await asyncio.gather(*(a.export_adapter.remote("a") for a in group.actors)) if each_rank else []
        await group.shutdown()
        return {"nodes": sorted(set(nodes.values())), "n_bundles": len(nodes), "address": address,
                "alive_nodes": sum(n["Alive"] for n in ray.nodes()), "grad_norm": steps["a"].grad_norm,
                "fresh": fresh, "stepped": stepped, "ranks": ranks}

    def compared(result, alone):
        """What the test asserts on, JSON-able: how far the ranks' weights are from each other
        and from the weights one rank alone reached on the whole batch."""
        ranks = result.pop("ranks")
        result["ranks_apart"] = max((max_diff(ranks[0], r) for r in ranks[1:]), default=None)
        result["vs_alone"] = max_diff(result.pop("stepped"), alone["stepped"])
        result["fresh_vs_alone"] = max_diff(result.pop("fresh"), alone["fresh"])
        result["alone_grad_norm"] = alone["grad_norm"]
        result["alone_moved"] = max_diff(alone["stepped"], alone["fresh"])
        return result

    async def main():
        actor = TrainActorConfig(hf_checkpoint=sys.argv[1], n_slots=1, lora_rank=2)
        one, two = (TrainGroupConfig(actor=actor, n_workers=n, num_cpus_per_worker=1) for n in (1, 2))
        alone = await train_once(torch_train_group(one))
        torch_ranks = await train_once(torch_train_group(two), each_rank=True)
        megatron = MegatronActorConfig(**actor.__dict__, tensor_model_parallel_size=2)
        tp_ranks = await train_once(megatron_train_group(MegatronGroupConfig(actor=megatron, n_workers=1,
                                                                             num_cpus_per_worker=1)))
        torch_ranks, tp_ranks = compared(torch_ranks, alone), compared(tp_ranks, alone)
        try:  # two CPUs for one rank: no node of one CPU holds it, said at once rather than waited on
            await torch_train_group(TrainGroupConfig(actor=actor, n_workers=1, num_cpus_per_worker=2)).start()
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        print(json.dumps({"torch": torch_ranks, "megatron": tp_ranks, "refused": refused}))

    asyncio.run(main())
    ray.shutdown()
    cluster.shutdown()
''')


def test_two_ranks_on_two_nodes_rendezvous_and_step(tiny_model_dir):
    """Torch DP ranks and Megatron TP ranks alike: one per node, joined at rank 0's node address."""
    import json

    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                         timeout=300, env={"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
                                           "PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    refused = results.pop("refused")
    assert "cannot fit" in refused and "at most 0 fit" in refused and "--actor-num-cpus-per-worker" in refused, refused
    for backend, result in results.items():
        assert result["alive_nodes"] == 2 and result["n_bundles"] == 2, backend
        assert len(result["nodes"]) == 2, (f"one bundle per {backend} rank should have put the two ranks "
                                           "on the two nodes")
        assert result["address"].startswith("tcp://") and not result["address"].startswith("tcp://127."), backend
        # The step all-reduced: the weights are those one rank reaches on the whole batch (two
        # prompt groups that differ, one per DP rank; Megatron's two TP ranks share them), far
        # from the fresh ones; every DP rank holds them.
        assert result["fresh_vs_alone"] == 0.0, backend
        assert result["alone_moved"] > 1e-2, result
        assert result["vs_alone"] < {"torch": 1e-5, "megatron": 1e-4}[backend], (backend, result)
        assert result["grad_norm"] == pytest.approx(result["alone_grad_norm"], rel=1e-4), (backend, result)
    assert results["torch"]["ranks_apart"] == 0.0, results["torch"]


def test_a_placement_no_node_holds_is_refused_here_and_awaited_on_a_joined_cluster(monkeypatch, caplog):
    """On a Ray instance of the job's own the cluster cannot grow: refuse at once. On a cluster
    the job joined (RAY_ADDRESS) an autoscaler may add nodes: warn, then wait as Ray does."""
    import logging

    import ray

    from miles.utils import placement

    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": False, "Resources": {"CPU": 64.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    placement.check_fits(2, {"CPU": 1.0})  # two of one CPU fit on the live node
    with pytest.raises(ValueError, match=r"2 placement bundles of 2 CPU cannot fit .*\(2 CPU / 0 GPU\); at most 1 fit"):
        placement.check_fits(2, {"CPU": 2.0})
    monkeypatch.setenv("RAY_ADDRESS", "ray://10.0.0.1:10001")
    with caplog.at_level(logging.WARNING, logger="miles.utils.placement"):
        placement.check_fits(2, {"CPU": 2.0})
    assert any("Waiting for the cluster to grow" in r.getMessage() for r in caplog.records)
