"""Megatron backend vs torch backend on the same model, adapters and samples: one verdict line.

Prints `PASS|FAIL|SKIP megatron-tp<N>: <detail>` (the verdict format of `scripts/gpu_check.py`).

    python -m miles.backends.megatron.gpu_check --hf-checkpoint /path/to/hf --device cuda --dtype bfloat16 --tp 2

Spawns `--tp` Megatron ranks (rank r on `cuda:r`; gloo on CPU, nccl on GPU), loads two
adapters with the same seeded random A and B into both backends, and compares the
response logprobs of a mixed batch (both adapters and base-only rows) and the LoRA
weights after one optimizer step of both adapters. Exits 1 when a difference exceeds
`--tol` (default 1e-2 in bf16, 1e-4 in fp32). On a machine without CUDA it runs in fp32
on the CPU (a rehearsal of the GPU check).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from miles.backends.base import AdapterSpec
from miles.backends.common.loss import grpo_advantages
from miles.utils.types import Sample

N_SLOTS, RANK = 4, 8
ADAPTERS = {"a": 0, "b": 2}


def _samples(vocab: int) -> tuple[list[Sample], list[float]]:
    rng = random.Random(0)
    samples = []
    for name, slot in ADAPTERS.items():
        for g in range(2):
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(4, 12))]
            for i in range(4):
                response = [rng.randrange(4, vocab) for _ in range(rng.randint(2, 10))]
                samples.append(Sample(adapter=name, slot=slot, group_index=g, index=i, prompt="", label=None,
                                      metadata={}, prompt_ids=prompt, response_ids=response,
                                      rollout_logprobs=[-4.0] * len(response), reward=float(rng.random())))
    advantages = grpo_advantages(torch.tensor([s.reward for s in samples]), [4] * (len(samples) // 4)).tolist()
    return samples, advantages


def _probe(samples: list[Sample]) -> list[Sample]:
    """The mixed batch whose logprobs are compared: every sample, and base-only copies."""
    return samples + [Sample(**{**s.__dict__, "slot": -1}) for s in samples[::4]]


def _specs() -> list[AdapterSpec]:
    return [AdapterSpec(name=n, slot=s, rank=RANK, alpha=16.0, global_batch_size=8, lr=1e-4)
            for n, s in ADAPTERS.items()]


def _weights(shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.05 for k, shape in sorted(shapes.items())}


def _play(actor, set_weights, vocab: int, shapes) -> dict:
    for spec in _specs():
        actor.load_adapter(spec)
    for i, slot in enumerate(ADAPTERS.values()):
        set_weights(slot, _weights(shapes, 10 + i))
    samples, advantages = _samples(vocab)
    seen = {"logprobs": actor.logprobs(_probe(samples))}
    actor.train(samples, advantages, {n: 8 for n in ADAPTERS})
    actor.step_adapters(list(ADAPTERS))
    seen["lora"] = {n: actor.export_adapter(n) for n in ADAPTERS}
    return seen


def _not_alike(meg: dict, ref: dict, vocab: int) -> str | None:
    """Why the two runs' outputs cannot be compared value by value (None: they can). Fewer or
    no values on one side must be a FAIL, never a max over what happens to be there."""
    expected = [len(s.response_ids) for s in _probe(_samples(vocab)[0])]
    counts = {side: [len(xs) for xs in seen["logprobs"]] for side, seen in (("Megatron", meg), ("torch", ref))}
    if any(found != expected for found in counts.values()):
        return f"logprobs per sample {counts}, responses of {expected} tokens"
    keys = {side: {n: sorted(seen["lora"].get(n, {})) for n in ADAPTERS}
            for side, seen in (("Megatron", meg), ("torch", ref))}
    if keys["Megatron"] != keys["torch"] or not all(keys["torch"].values()):
        return f"LoRA tensors after the step differ in names or are missing: {keys}"
    return None


def rendezvous(actor, rank: int, world: int, addresses) -> str:
    """The process group's address: rank 0 listens on a port the OS picked (`master_address`
    holds it until the group forms) and hands the address to the other ranks."""
    if rank == 0:
        address = actor.master_address("127.0.0.1")
        for _ in range(world - 1):
            addresses.put(address)
        return address
    return addresses.get(timeout=600)


def _rank_main(rank: int, world: int, addresses, args: argparse.Namespace, shapes, out: str) -> None:
    from miles.backends.megatron import lora as mlora
    from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor
    from miles.backends.megatron.train_model import MegatronTrainModel

    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    actor = MegatronTrainActor(MegatronActorConfig(hf_checkpoint=args.hf_checkpoint, n_slots=N_SLOTS, lora_rank=RANK,
                                                   device=device, dtype=args.dtype, tensor_model_parallel_size=world),
                               rank, world)
    actor.init_process_group(rendezvous(actor, rank, world, addresses))
    model = actor.model
    assert isinstance(model, MegatronTrainModel)
    seen = _play(actor, lambda slot, t: mlora.set_slot_weights(model.parts, slot, t, rank=RANK, alpha=16.0),
                 actor.shape.vocab_size, shapes)
    if rank == 0:
        torch.save(seen, out)
    actor.shutdown()


def main(argv: list[str] | None = None) -> int:
    from miles.backends.rank.config import TrainActorConfig
    from miles.backends.torch.actor import TorchTrainActor
    from miles.backends.torch.train_model import TorchTrainModel
    from miles.lora import set_slot_weights

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-checkpoint", required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tol", type=float, default=None)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    tol = args.tol if args.tol is not None else (1e-2 if args.dtype == "bfloat16" else 1e-4)
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"SKIP megatron-tp{args.tp}: {torch.cuda.device_count()} GPU(s), TP={args.tp} needs {args.tp}")
        return 0

    ref_actor = TorchTrainActor(TrainActorConfig(hf_checkpoint=args.hf_checkpoint, n_slots=N_SLOTS, lora_rank=RANK,
                                                 device=args.device, dtype=args.dtype))
    ref_actor.load_adapter(_specs()[0])
    shapes = {k: v.shape for k, v in ref_actor.export_adapter("a").items()}
    ref_actor.cleanup_adapter("a")
    ref_model = ref_actor.model
    assert isinstance(ref_model, TorchTrainModel)
    vocab = ref_model.module.config.vocab_size
    # The setter binds the model now (no closure over ref_actor), so the `del` below is the names' last use.
    ref = _play(ref_actor, functools.partial(set_slot_weights, ref_model.module, rank=RANK, alpha=16.0),
                vocab, shapes)
    del ref_actor, ref_model
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "megatron.pt")
        addresses = mp.get_context("spawn").Queue()
        mp.start_processes(_rank_main, args=(args.tp, addresses, args, shapes, out), nprocs=args.tp, join=True,
                           start_method="spawn")
        meg = torch.load(out, weights_only=False)
    unlike = _not_alike(meg, ref, vocab)
    if unlike is not None:
        print(f"FAIL megatron-tp{args.tp}: Megatron vs torch backend ({args.device}, {args.dtype}): {unlike}")
        return 1
    logprob_diff = max(abs(x - y) for xs, ys in zip(meg["logprobs"], ref["logprobs"]) for x, y in zip(xs, ys))
    lora_diff = max(float((meg["lora"][n][k] - ref["lora"][n][k]).abs().max())
                    for n in ADAPTERS for k in ref["lora"][n])
    ok = logprob_diff <= tol and lora_diff <= tol
    print(f"{'PASS' if ok else 'FAIL'} megatron-tp{args.tp}: Megatron vs torch backend ({args.device}, {args.dtype}): "
          f"max |d logprob| = {logprob_diff:.2e}, max |d LoRA after one step| = {lora_diff:.2e} (tol {tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
