"""Activation recomputation in the Megatron backend (Megatron's `--recompute-*` settings):
the same loss and LoRA gradients as keeping every activation, the recomputed modules really
run twice, and the replay sees the forward's slots though `backward()` runs outside the
`use_slots` block, on another thread. Spawned gloo ranks at TP = 1 and 2, fp32.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from miles.backends.megatron.model import ModelShape, recompute_settings
from tests.helpers.megatron_scenario import RANK, random_adapter
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, make_groups, spec

pytestmark = pytest.mark.timeout(300)

SETTINGS = {
    "full-uniform-1": ("full", "uniform", 1, None),
    "full-uniform-2": ("full", "uniform", 2, None),
    "full-block-1": ("full", "block", 1, None),
    "selective": ("selective", None, None, None),
    "selective-mlp": ("selective", None, None, ("mlp",)),
}
BATCH_SLOTS = [2, -1, 0, 2, 1]


def _lora_model(model_dir: str, shape: ModelShape, recompute: dict):
    """The tiny model with three slots of seeded random LoRA weights, in eval mode."""
    from miles.backends.megatron import lora as mlora
    from miles.backends.megatron.model import (
        allow_recompute_in_eval,
        build_gpt_model,
        load_hf_weights,
        read_hf_state_dict,
    )
    from miles.lora.slots import peft_names

    model = build_gpt_model(shape, recompute=recompute)
    load_hf_weights(model, shape, read_hf_state_dict(model_dir))
    parts = mlora.inject_parallel_lora(model, shape, n_slots=3, max_rank=RANK, target_modules="all-linear")
    shapes = {}
    for name, part in parts.items():
        a_name, b_name = peft_names(name)
        shapes[a_name], shapes[b_name] = (RANK, part.in_features), (part.out_features, RANK)
    for slot in range(3):
        mlora.set_slot_weights(parts, slot, random_adapter(shapes, seed=300 + slot), rank=RANK, alpha=8.0)
    model.eval()
    allow_recompute_in_eval(model)
    return model, parts


def _call_counter(modules) -> list[int]:
    calls = [0] * len(modules)
    for i, module in enumerate(modules):
        module.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _model_rank(rank: int, world: int, rendezvous: str, model_dir: str, out: str) -> None:
    """Per setting: a mixed-slot forward inside `use_slots`, `backward()` after the block on
    a fresh thread; the loss, this rank's LoRA gradients and per-layer call counts."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from miles.backends.megatron import lora as mlora
    from miles.backends.megatron.model import forward_logits

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    shape = ModelShape.from_hf_dir(model_dir)
    ids = torch.randint(4, 100, (len(BATCH_SLOTS), 9), generator=torch.Generator().manual_seed(5))
    seen = {}
    for name, (granularity, method, num_layers, modules) in {"keep": (None, None, None, None), **SETTINGS}.items():
        recompute = recompute_settings(shape, granularity, method, num_layers, modules)
        model, parts = _lora_model(model_dir, shape, recompute)
        layers = list(model.decoder.layers)
        lora_calls = _call_counter([layer.self_attention.linear_qkv for layer in layers])
        attention_calls = _call_counter([layer.self_attention.core_attention for layer in layers])
        mlp_calls = _call_counter([layer.mlp for layer in layers])
        with mlora.use_slots(model, BATCH_SLOTS):
            loss = forward_logits(model, shape, ids).square().mean()
        _backward_on_another_thread(loss)
        seen[name] = {"loss": loss.item(), "lora_calls": lora_calls, "attention_calls": attention_calls,
                      "mlp_calls": mlp_calls,
                      "grads": {f"{n}.{ab}": _grad(getattr(p, f"lora_{ab}")) for n, p in parts.items() for ab in "AB"}}
    torch.save(seen, Path(out) / f"rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _backward_on_another_thread(loss: torch.Tensor) -> None:
    """`loss.backward()` on a thread that never entered `use_slots` (its error re-raised here)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loss.backward()
        except BaseException as e:  # noqa: BLE001  (re-raised on the caller's thread)
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


def _grad(param: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(param) if param.grad is None else param.grad.clone()


# Forward calls per layer (the tiny model has two) of a LoRA linear, core attention and the MLP.
CALLS = {
    "keep": ([1, 1], [1, 1], [1, 1]),
    "full-uniform-1": ([2, 2], [2, 2], [2, 2]),
    "full-uniform-2": ([2, 2], [2, 2], [2, 2]),
    "full-block-1": ([2, 1], [2, 1], [2, 1]),
    "selective": ([1, 1], [2, 2], [1, 1]),
    "selective-mlp": ([1, 1], [1, 1], [2, 2]),
}


@pytest.mark.parametrize("tp", [1, 2])
def test_recompute_gives_the_same_loss_and_lora_grads_and_replays_the_forward_slots(tiny_model_dir, tmp_path, tp):
    rendezvous = f"file://{tmp_path / 'rendezvous'}"  # the ranks meet in a file: no port to pick
    mp.start_processes(_model_rank, args=(tp, rendezvous, str(tiny_model_dir), str(tmp_path)), nprocs=tp, join=True,
                       start_method="spawn")
    for rank in range(tp):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        keep = seen["keep"]
        # Every slot of the batch has a gradient in every part (slot 1 from one sample).
        assert all(grad[slot].abs().max() > 0 for grad in keep["grads"].values() for slot in (0, 1, 2))
        for name, calls in CALLS.items():
            got = seen[name]
            assert (got["lora_calls"], got["attention_calls"], got["mlp_calls"]) == calls, name
            assert got["loss"] == pytest.approx(keep["loss"], abs=1e-6), name
            for key, grad in keep["grads"].items():
                torch.testing.assert_close(got["grads"][key], grad, atol=1e-6, rtol=0, msg=f"{name} {key}")


def _actor_rank(rank: int, model_dir: str, out: str) -> None:
    """The actor with `--recompute-granularity full` (Megatron's defaults after it): a train
    call of three adapters in mixed micro-batches, then the same call with Megatron's
    recompute gate closed (the plain forward); the loss sums and the gradients of both."""
    from miles.backends.megatron import lora as mlora
    from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor

    torch.set_num_threads(1)
    actor = MegatronTrainActor(MegatronActorConfig(hf_checkpoint=model_dir, n_slots=4, lora_rank=RANK,
                                                   micro_batch_size=4, recompute_granularity="full"), rank, 1)
    actor.init_process_group(None)  # one rank: its own group, on a port the OS picks
    config = actor.model.module.config
    seen: dict = {"config": (config.recompute_granularity, config.recompute_method, config.recompute_num_layers)}
    slots = {"a": 0, "b": 2, "c": 3}
    for i, (name, slot) in enumerate(slots.items()):
        actor.load_adapter(spec(name, slot, rank=RANK, global_batch_size=4))
        shapes = {k: v.shape for k, v in actor.export_adapter(name).items()}
        mlora.set_slot_weights(actor.model.parts, slot, random_adapter(shapes, seed=400 + i), rank=RANK, alpha=8.0)
    groups = [g for trio in zip(make_groups("a", 0, 2, 2, seed=1), make_groups("b", 2, 2, 2, seed=2),
                                make_groups("c", 3, 2, 2, seed=3)) for g in trio]
    samples, adv = flatten_with_advantages(groups)
    calls = _call_counter(list(actor.model.module.decoder.layers))
    for run in ("recompute", "plain"):
        actor.model.module.decoder.training = run == "recompute"
        calls[:] = [0] * len(calls)
        stats = actor.train(samples, adv, counts(samples))
        seen[run] = {"loss": {n: s.loss_sum for n, s in stats.items()}, "calls": list(calls),
                     "grads": {n: actor.accumulated_grad(n).tensors for n in slots}}
        for slot in slots.values():
            actor.core.optimizer.zero_slot_grad(slot)
    torch.save(seen, out)
    actor.shutdown()


def test_the_actor_recomputes_with_megatrons_defaults_and_trains_the_same(tiny_model_dir, tmp_path):
    out = tmp_path / "actor.pt"
    mp.start_processes(_actor_rank, args=(str(tiny_model_dir), str(out)), nprocs=1, join=True,
                       start_method="spawn")
    seen = torch.load(out, weights_only=False)
    assert seen["config"] == ("full", "uniform", 1)
    # 12 samples in micro-batches of 4: three forwards, plus three replays when recomputing.
    assert seen["recompute"]["calls"] == [6, 6] and seen["plain"]["calls"] == [3, 3]
    for name in ("a", "b", "c"):
        assert seen["recompute"]["loss"][name] == pytest.approx(seen["plain"]["loss"][name], abs=1e-6)
        for key, grad in seen["plain"]["grads"][name].items():
            assert grad.abs().max() > 0
            torch.testing.assert_close(seen["recompute"]["grads"][name][key], grad, atol=1e-6, rtol=0)


def test_recompute_settings_fill_megatrons_defaults(tiny_model_dir):
    shape = ModelShape.from_hf_dir(tiny_model_dir)  # two layers
    assert recompute_settings(shape, None) == {}
    assert recompute_settings(shape, "selective") == {"recompute_granularity": "selective"}
    assert recompute_settings(shape, "selective", modules=("core_attn", "mlp")) == {
        "recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}
    with pytest.raises(ValueError, match="recompute_modules choose"):
        recompute_settings(shape, "full", modules=("mlp",))
    full = {"recompute_granularity": "full"}
    assert recompute_settings(shape, "full") == {**full, "recompute_method": "uniform", "recompute_num_layers": 1}
    block = recompute_settings(shape, "full", "block")
    assert block == {**full, "recompute_method": "block", "recompute_num_layers": 2}
    assert recompute_settings(shape, "full", "uniform", 2)["recompute_num_layers"] == 2
    with pytest.raises(ValueError, match="does not divide the model's 2 layers"):
        recompute_settings(shape, "full", "uniform", 3)
    with pytest.raises(ValueError, match="selective recomputation takes no recompute_method"):
        recompute_settings(shape, "selective", "block")
