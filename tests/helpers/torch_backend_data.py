"""Seeded synthetic samples and small builders shared by the torch-backend tests."""

from __future__ import annotations

import random

import torch

from miles.backends.base import AdapterSpec
from miles.backends.common.loss import grpo_advantages
from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.actor import TorchTrainActor
from miles.utils.loss_settings import LossSettings
from miles.utils.types import Sample
from miles.utils.types.client import ClientDatum, ClientLoss, ClientWork

VOCAB = 100  # the tiny models' vocabulary size


def make_groups(adapter: str, slot: int, n_groups: int, group_size: int, seed: int) -> list[list[Sample]]:
    """Prompt groups of random tokens, rewards and engine logprobs (prompts of varied length)."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 6))]
        group = []
        for i in range(group_size):
            response = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 5))]
            group.append(Sample(
                adapter=adapter, slot=slot, group_index=g, index=i, prompt="", label=None, metadata={},
                prompt_ids=list(prompt), response_ids=response,
                rollout_logprobs=[-rng.uniform(3.0, 6.0) for _ in response],
                reward=float(rng.randint(0, 1)) + rng.random(),
            ))
        groups.append(group)
    return groups


def flatten_with_advantages(groups: list[list[Sample]]) -> tuple[list[Sample], list[float]]:
    samples = [s for group in groups for s in group]
    rewards = torch.tensor([s.reward for s in samples])
    return samples, grpo_advantages(rewards, [len(g) for g in groups]).tolist()


def counts(samples: list[Sample]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in samples:
        out[s.adapter] = out.get(s.adapter, 0) + 1
    return out


def new_actor(model_dir, *, n_slots: int = 4, lora_rank: int = 4, micro_batch_size: int | None = None,
              max_tokens: int | None = None, activation_budget_mb: float | None = None,
              loss: LossSettings | None = None, clip_grad: float = 1.0, rank: int = 0,
              world_size: int = 1) -> TorchTrainActor:
    """A torch train rank driven in-process (`rank` of `world_size`: no process group is joined)."""
    return TorchTrainActor(TrainActorConfig(
        hf_checkpoint=str(model_dir), n_slots=n_slots, lora_rank=lora_rank, micro_batch_size=micro_batch_size,
        max_tokens_per_micro_batch=max_tokens, activation_budget_mb=activation_budget_mb,
        loss=loss or LossSettings(), clip_grad=clip_grad,
    ), rank, world_size)


def spec(name: str, slot: int, *, rank: int = 4, global_batch_size: int = 4, save_dir=None, **kw) -> AdapterSpec:
    kw = {"lr": 0.02, "weight_decay": 0.01, **kw}
    return AdapterSpec(name=name, slot=slot, rank=rank, alpha=8.0, global_batch_size=global_batch_size,
                       save_dir=None if save_dir is None else str(save_dir), **kw)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def client_datums(loss: str, n: int, seed: int) -> list[ClientDatum]:
    """Random datums for `loss`: tokens, arbitrary targets and that loss's inputs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(2, 9)
        inputs: dict = {"target_tokens": [rng.randrange(4, VOCAB) for _ in range(length)]}
        if loss == "cross_entropy":
            inputs["weights"] = [float(rng.random() < 0.7) for _ in range(length)]
        else:
            inputs["logprobs"] = [-rng.uniform(3.0, 6.0) for _ in range(length)]
            inputs["advantages"] = [rng.uniform(-1.0, 1.0) for _ in range(length)]
        out.append(ClientDatum(tokens=[rng.randrange(4, VOCAB) for _ in range(length)], inputs=inputs))
    return out


def client_work(adapter: str, slot: int, data: list[ClientDatum], loss: str | None, *, backward: bool = True,
                config: dict | None = None) -> ClientWork:
    """One client call's datums for `adapter` (loss None: a `forward` for logprobs only)."""
    return ClientWork(adapter=adapter, slot=slot, datums=data,
                      loss=None if loss is None else ClientLoss(loss, config or {}), backward=backward)  # type: ignore[arg-type]
