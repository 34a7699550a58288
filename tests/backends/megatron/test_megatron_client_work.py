"""Client work (the Tinker protocol) in the Megatron backend equals the torch backend's.

One train call mixes a server-driven adapter (entropy bonus and KL loss, so the mixed
forward's reference and entropy are live) with a client adapter's PPO datums and a
`forward` of another client adapter; then a step with the client's `AdamStep`. The client
adapter freezes its attention LoRA (`train_attn=False`): on TP 2 its frozen rows are shards. Megatron
at TP = 1 and TP = 2 (spawned gloo ranks) and one torch rank play the same script on the
same tiny model, in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from miles.utils.loss_settings import LossSettings
from miles.utils.types.client import AdamStep
from miles.utils.types.client_commands import LoraGroup
from tests.helpers.megatron_scenario import RANK, broadcast_shapes, random_adapter, rendezvous
from tests.helpers.torch_backend_data import (
    client_datums,
    client_work,
    counts,
    flatten_with_advantages,
    make_groups,
    max_abs_diff,
    spec,
)

pytestmark = pytest.mark.timeout(300)

SLOTS = {"rl": 0, "c": 2, "f": 1}
RL_LOSS = LossSettings(entropy_coef=0.05, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
NO_ATTN = frozenset({LoraGroup.ATTN})
ADAM = AdamStep(learning_rate=0.02, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)


def play(actor, set_weights, state_dir: Path, other_state: Path | None = None) -> dict:
    """The script; saves c's client state to `state_dir` and loads `other_state` (the other
    backend's) into a fourth slot as "loaded"."""
    for i, (name, slot) in enumerate(SLOTS.items()):
        actor.load_adapter(spec(name, slot, rank=RANK, global_batch_size=4, loss=RL_LOSS if name == "rl" else None,
                                frozen=NO_ATTN if name == "c" else frozenset()))
        shapes = broadcast_shapes({k: v.shape for k, v in actor.export_adapter(name).items()})  # TP rank 0's
        set_weights(slot, random_adapter(shapes, seed=300 + i))
    samples, adv = flatten_with_advantages(make_groups("rl", 0, 2, 2, seed=21))
    forward = client_work("f", 1, client_datums("cross_entropy", 2, seed=23), "cross_entropy", backward=False)
    result = actor.train_batch(samples, adv, counts(samples),
                               client=[client_work("c", 2, client_datums("ppo", 4, seed=22), "ppo"), forward])
    stats = actor.step_adapters(["rl", "c"], adam={"c": ADAM})
    seen = {"client": result.client, "loss": result.stats["rl"].loss_sum if result.stats else None,
            "grad_norm": stats["c"].grad_norm, "weights": {n: actor.export_adapter(n) for n in SLOTS}}
    actor.save_client_state("c", str(state_dir))  # a TP gather in Megatron: rank 0 writes
    if other_state is not None:
        actor.load_adapter(spec("loaded", 3, rank=RANK, frozen=NO_ATTN))
        actor.load_client_state("loaded", str(other_state))
        seen["loaded"] = actor.export_adapter("loaded")
        seen["loaded_step"] = actor.optimizer_state("loaded").step
    return seen


def _megatron_main(rank: int, world: int, addresses, model_dir: str, out: str, torch_state: str) -> None:
    from miles.backends.megatron import lora as mlora
    from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor

    torch.set_num_threads(1)
    actor = MegatronTrainActor(MegatronActorConfig(hf_checkpoint=model_dir, n_slots=4, lora_rank=RANK,
                                                   tensor_model_parallel_size=world), rank, world)
    actor.init_process_group(rendezvous(actor, rank, world, addresses))
    seen = play(actor, lambda slot, t: mlora.set_slot_weights(actor.model.parts, slot, t, rank=RANK, alpha=8.0),
                Path(out).parent / "megatron_state", Path(torch_state))
    if rank == 0:
        torch.save(seen, out)
    actor.shutdown()


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_client_work_and_adam_step_equal_the_torch_backend(tiny_model_dir, tmp_path, tp):
    from miles.backends.rank.config import TrainActorConfig
    from miles.backends.torch.actor import TorchTrainActor
    from miles.lora import set_slot_weights

    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint=str(tiny_model_dir), n_slots=4, lora_rank=RANK))
    ref = play(actor, lambda slot, t: set_slot_weights(actor.model.module, slot, t, rank=RANK, alpha=8.0),
               tmp_path / "torch_state")
    out = tmp_path / "megatron.pt"
    addresses = mp.get_context("spawn").Queue()
    args = (tp, addresses, str(tiny_model_dir), str(out), str(tmp_path / "torch_state"))
    mp.start_processes(_megatron_main, args=args, nprocs=tp, join=True, start_method="spawn")
    meg = torch.load(out, weights_only=False)
    assert meg["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert [len(outputs) for outputs in meg["client"]] == [4, 2]
    for got_work, want_work in zip(meg["client"], ref["client"]):
        for got, want in zip(got_work, want_work):
            assert got.outputs.keys() == want.outputs.keys()
            for key in got.outputs:
                assert got.outputs[key] == pytest.approx(want.outputs[key], abs=1e-5)
            assert got.loss == pytest.approx(want.loss, abs=1e-5)
    assert meg["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    # As in the loss-settings test: Adam's first step amplifies summation-order rounding
    # where a gradient nearly cancels; weights agree to 1/80 of the lr.
    for name in SLOTS:
        assert max_abs_diff(meg["weights"][name], ref["weights"][name]) <= 2.5e-4
    assert max_abs_diff(meg["weights"]["f"], ref["weights"]["f"]) == pytest.approx(0.0, abs=1e-6)
    # Client state crosses the backends: torch's save_state loads into the Megatron shards whole,
    # and Megatron's (gathered over TP) loads into torch.
    assert max_abs_diff(meg["loaded"], ref["weights"]["c"]) == 0.0 and meg["loaded_step"] == 1
    assert ref["weights"]["c"] and not any("self_attn" in k for k in ref["weights"]["c"])  # its trained layers only
    actor.load_adapter(spec("from-megatron", 3, rank=RANK, frozen=NO_ATTN))
    actor.load_client_state("from-megatron", str(tmp_path / "megatron_state"))
    assert max_abs_diff(actor.export_adapter("from-megatron"), meg["weights"]["c"]) == 0.0
