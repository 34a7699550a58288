"""One scripted run of the Megatron backend on TP ranks spawned over gloo, and its torch twin.

`run_megatron(model_dir, tp, work)` spawns `tp` processes (one Megatron rank each, one
DP replica) that play `SCRIPT` and leave what they saw in `work/megatron.pt`;
`run_torch(model_dir, work)` plays the same script on one torch-backend rank in-process.
The tests compare the two. The script:

1. adapters a (slot 0), b (slot 2), c (slot 1) loaded fresh, then given random A and B
   (seeded) so every LoRA gradient is non-zero; "fresh" keeps the fresh export of a,
   "fresh_export" what `fresh_export_for_push` gave for a before the load;
2. "logits": logits of one mixed batch (slots 0, 2, -1, 1, 0) and response logprobs of
   a mixed batch of a, b, c samples and base-only copies;
3. one train call of a and b samples, then a step of a and b only ("step1": a, b, c
   exported; c must be untouched);
4. a's checkpoint written at step 1 ("ckpt_a"), then a loaded into slot 3 as "a2" from
   `work/torch_ckpt` (a checkpoint the torch backend wrote at step 1) and both trained one
   more step on the same samples ("step2");
5. one group of a's next window trained, a saved at step 2 with that gradient
   ("ckpt_a_mid"), c cleaned up and a resumed from that checkpoint into slot 1 as "a3";
   a and a3 trained on the same second group and stepped ("step3").
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from miles.backends.common.checkpoint import AccumulatedGrad
from miles.backends.megatron.gpu_check import rendezvous
from miles.utils.types import Sample
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, make_groups, spec

N_SLOTS, RANK = 4, 4
SLOTS = {"a": 0, "b": 2, "c": 1}
LOGIT_SLOTS = [0, 2, -1, 1, 0]


def random_adapter(actor_parts_or_names, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random A and B for every target of the tiny model, in PEFT names."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.1 for k, shape in sorted(actor_parts_or_names.items())}


def step1_groups():
    return make_groups("a", 0, 2, 3, seed=1) + make_groups("b", 2, 2, 3, seed=2)


def step2_groups():
    return make_groups("a", 0, 2, 2, seed=3) + make_groups("a2", 3, 2, 2, seed=3)


def step3_groups(names: tuple[str, ...], seed: int):
    return [g for name in names for g in make_groups(name, {"a": 0, "a3": 1}[name], 1, 2, seed=seed)]


def logprob_samples() -> list[Sample]:
    groups = make_groups("a", 0, 1, 2, 4) + make_groups("b", 2, 1, 2, 5) + make_groups("c", 1, 1, 2, 6)
    samples = [s for g in groups for s in g]
    base = [Sample(**{**s.__dict__, "slot": -1, "adapter": "a"}) for s in samples[::2]]
    return samples + base


def logit_input_ids() -> torch.Tensor:
    return torch.randint(4, 100, (len(LOGIT_SLOTS), 9), generator=torch.Generator().manual_seed(7))


def play(actor, *, set_weights, logits_fn, save_dir: Path, torch_ckpt: Path) -> dict:
    """The script, on one rank of either backend; returns what it saw (rank 0's matters)."""
    seen: dict = {}
    specs = {name: spec(name, slot, rank=RANK, global_batch_size=6, save_dir=save_dir / name)
             for name, slot in SLOTS.items()}
    seen["fresh_export"] = actor.fresh_export_for_push(specs["a"])  # before the load, as a registration's push
    for name in SLOTS:
        actor.load_adapter(specs[name])
    seen["fresh"] = actor.export_adapter("a")
    shapes = {k: v.shape for k, v in seen["fresh"].items()} if seen["fresh"] else None
    shapes = broadcast_shapes(shapes)
    for i, slot in enumerate(SLOTS.values()):
        set_weights(slot, random_adapter(shapes, seed=100 + i))
    seen["logits"] = logits_fn(logit_input_ids(), LOGIT_SLOTS)
    seen["logprobs"] = actor.logprobs(logprob_samples())
    c_before = actor.export_adapter("c")
    samples, adv = flatten_with_advantages(step1_groups())
    seen["train1"] = actor.train(samples, adv, counts(samples))
    seen["step1_stats"] = actor.step_adapters(["a", "b"])
    seen["step1"] = {n: actor.export_adapter(n) for n in SLOTS}
    seen["c_before"] = c_before
    seen["ckpt_a"] = actor.save_adapter("a", 1)
    actor.load_adapter(spec("a2", 3, rank=RANK, global_batch_size=4), str(torch_ckpt))
    samples, adv = flatten_with_advantages(step2_groups())
    actor.train(samples, adv, counts(samples))
    actor.step_adapters(["a", "a2"])
    seen["step2"] = {n: actor.export_adapter(n) for n in ("a", "a2")}
    samples, adv = flatten_with_advantages(step3_groups(("a",), seed=8))
    actor.train(samples, adv, counts(samples))
    share = actor.accumulated_grad("a")  # a TP gather in Megatron: rank 0 holds it
    seen["ckpt_a_mid"] = actor.save_adapter("a", 2, None,
                                            AccumulatedGrad(share.tensors, groups=1, samples=share.samples))
    _barrier()  # rank 0 writes; every rank reads it back
    actor.cleanup_adapter("c")
    actor.load_adapter(spec("a3", 1, rank=RANK, global_batch_size=6), str(save_dir / "a" / "checkpoints" / "step_2"))
    samples, adv = flatten_with_advantages(step3_groups(("a", "a3"), seed=9))
    actor.train(samples, adv, counts(samples))
    actor.step_adapters(["a", "a3"])
    seen["step3"] = {n: actor.export_adapter(n) for n in ("a", "a3")}
    return seen


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def broadcast_shapes(shapes):
    """Rank 0's export shapes for every rank (the others export nothing)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return shapes
    box = [shapes]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank_main(rank: int, world: int, addresses, model_dir: str, work: str) -> None:
    from miles.backends.megatron import lora as mlora
    from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor
    from miles.backends.megatron.model import forward_logits

    torch.set_num_threads(1)
    work_dir = Path(work)
    actor = MegatronTrainActor(MegatronActorConfig(hf_checkpoint=model_dir, n_slots=N_SLOTS, lora_rank=RANK,
                                                   tensor_model_parallel_size=world), rank, world)
    actor.init_process_group(rendezvous(actor, rank, world, addresses))

    def set_weights(slot, tensors):
        mlora.set_slot_weights(actor.model.parts, slot, tensors, rank=RANK, alpha=8.0)

    @torch.no_grad()
    def logits_fn(ids, slots):
        with mlora.use_slots(actor.model.module, slots):
            return forward_logits(actor.model.module, actor.model.shape, ids)

    seen = play(actor, set_weights=set_weights, logits_fn=logits_fn, save_dir=work_dir / "megatron_save",
                torch_ckpt=work_dir / "torch_ckpt")
    if rank == 0:
        torch.save(seen, work_dir / "megatron.pt")
    actor.shutdown()


def run_megatron(model_dir: Path, tp: int, work: Path) -> dict:
    addresses = mp.get_context("spawn").Queue()
    mp.start_processes(_rank_main, args=(tp, addresses, str(model_dir), str(work)), nprocs=tp, join=True,
                       start_method="spawn")
    return torch.load(work / "megatron.pt", weights_only=False)


def run_torch(model_dir: Path, work: Path) -> dict:
    """The torch twin; also leaves `work/torch_ckpt` (adapter a at step 1) for the Megatron run."""
    from miles.backends.rank.config import TrainActorConfig
    from miles.backends.torch.actor import TorchTrainActor
    from miles.lora import set_slot_weights, use_slots

    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint=str(model_dir), n_slots=N_SLOTS, lora_rank=RANK))

    def set_weights(slot, tensors):
        set_slot_weights(actor.model.module, slot, tensors, rank=RANK, alpha=8.0)

    @torch.no_grad()
    def logits_fn(ids, slots):
        with use_slots(actor.model.module, slots):
            return actor.model.module(input_ids=ids).logits

    seen = play(actor, set_weights=set_weights, logits_fn=logits_fn, save_dir=work / "torch_save",
                torch_ckpt=work / "torch_save" / "a" / "checkpoints" / "step_1")
    # The Megatron run resumes "a2" from the torch backend's step-1 checkpoint of a.
    import shutil

    shutil.copytree(work / "torch_save" / "a" / "checkpoints" / "step_1", work / "torch_ckpt")
    return seen


def _dp_rank_main(rank: int, world: int, addresses, model_dir: str, work: str) -> None:
    """Two DP replicas of one TP rank each: the script's adapters and random weights, then
    step 1 with the prompt groups split over the replicas as the Megatron group splits them."""
    from miles.backends.common.rank_group import split_prompt_groups
    from miles.backends.megatron import lora as mlora
    from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor

    torch.set_num_threads(1)
    actor = MegatronTrainActor(MegatronActorConfig(hf_checkpoint=model_dir, n_slots=N_SLOTS, lora_rank=RANK),
                               rank, world)
    actor.init_process_group(rendezvous(actor, rank, world, addresses))
    for name, slot in SLOTS.items():
        actor.load_adapter(spec(name, slot, rank=RANK, global_batch_size=6))
    shapes = broadcast_shapes({k: v.shape for k, v in actor.export_adapter("a").items()} if rank == 0 else None)
    for i, slot in enumerate(SLOTS.values()):
        mlora.set_slot_weights(actor.model.parts, slot, random_adapter(shapes, seed=100 + i), rank=RANK, alpha=8.0)
    groups = step1_groups()
    samples, adv = flatten_with_advantages(groups)
    mine = split_prompt_groups([len(g) for g in groups], world)[rank]
    actor.train([samples[i] for i in mine], [adv[i] for i in mine], counts(samples))
    actor.step_adapters(["a", "b"])
    # Each replica's own copy (export_adapter answers from replica 0 only).
    seen = {n: mlora.gather_slot_weights(actor.model.parts, slot) for n, slot in SLOTS.items()}
    torch.save(seen, Path(work) / f"dp{rank}.pt")
    actor.shutdown()


def run_megatron_dp(model_dir: Path, work: Path) -> list[dict]:
    addresses = mp.get_context("spawn").Queue()
    mp.start_processes(_dp_rank_main, args=(2, addresses, str(model_dir), str(work)), nprocs=2, join=True,
                       start_method="spawn")
    return [torch.load(work / f"dp{r}.pt", weights_only=False) for r in range(2)]
