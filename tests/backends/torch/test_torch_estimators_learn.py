"""Each advantage estimator learns on the tiny base through a real train rank.

In one process (no Ray, no engines): one adapter samples groups of 8 answers to 16 fixed
two-digit additions from its own slot, is rewarded by `final_number`, gets its advantages
as the train group computes them (`adapter_token_advantages`, with the rank's
`reward_kl` for reinforce++'s `--kl-coef`) and steps through `TorchTrainActor.train` /
`step_adapters`. Seeded; 3 to 12 s per estimator on the shared 2-core machine.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from miles.backends.base import AdapterSpec
from miles.backends.common.loss import adapter_token_advantages, needs_reward_kl
from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.actor import TorchTrainActor
from miles.lora import use_slots
from miles.rollout.rewards.builtin import BUILTIN_REWARDS
from miles.utils.loss_settings import LossSettings
from miles.utils.types import Sample

ESTIMATORS = {
    "grpo": LossSettings(),
    "gspo": LossSettings(advantage_estimator="gspo"),
    "reinforce_plus_plus": LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True,
                                        kl_coef=0.05),
    "reinforce_plus_plus_baseline": LossSettings(advantage_estimator="reinforce_plus_plus_baseline",
                                                 normalize_advantages=True, kl_coef=0.05),
}
PROMPTS, GROUP, STEPS, MAX_NEW_TOKENS = 16, 8, 12, 6

pytestmark = pytest.mark.slow  # about 25 s for the four on the shared 2-core machine


@torch.no_grad()
def _sample(actor, tokenizer, rows, n: int, gen: torch.Generator | None) -> list[Sample]:
    """n answers per row from slot 0 (greedy when `gen` is None), rewarded by final_number."""
    prompt_BT = torch.tensor([tokenizer(r["text"], add_special_tokens=False)["input_ids"] for r in rows])
    prompt_BT = prompt_BT.repeat_interleave(n, dim=0)  # the additions all have one token length
    seq_BT, done_B = prompt_BT, torch.zeros(prompt_BT.shape[0], dtype=torch.bool)
    with use_slots(actor.model.module, [0] * prompt_BT.shape[0]):
        for _ in range(MAX_NEW_TOKENS):
            logits_BV = actor.model.module(input_ids=seq_BT).logits[:, -1].float()
            if gen is None:
                next_B = logits_BV.argmax(-1)
            else:
                next_B = torch.multinomial(torch.softmax(logits_BV, -1), 1, generator=gen).squeeze(1)
            next_B = torch.where(done_B, torch.full_like(next_B, tokenizer.pad_token_id), next_B)
            seq_BT = torch.cat([seq_BT, next_B[:, None]], dim=1)
            done_B |= next_B == tokenizer.eos_token_id
            if bool(done_B.all()):
                break
    samples = []
    for i, row_ids in enumerate(seq_BT[:, prompt_BT.shape[1]:].tolist()):
        cut = row_ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row_ids else len(row_ids)
        row = rows[i // n]
        sample = Sample("a", 0, i // n, i % n, row["text"], row["label"], {}, prompt_BT[i].tolist(), row_ids[:cut],
                        tokenizer.decode(row_ids[:cut], skip_special_tokens=True))
        sample.reward = float(BUILTIN_REWARDS["final_number"](None, sample))
        samples.append(sample)
    return samples


def _mean_reward(samples: list[Sample]) -> float:
    return sum(s.reward for s in samples) / len(samples)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_each_estimator_raises_the_reward_on_the_tiny_base(tiny_base_dir, estimator):
    settings = ESTIMATORS[estimator]
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_dir)
    rows = [json.loads(line) for line in (tiny_base_dir / "data" / "add_train.jsonl").open()][:PROMPTS]
    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint=str(tiny_base_dir), n_slots=1, lora_rank=8, seed=0))
    actor.load_adapter(AdapterSpec(name="a", slot=0, rank=8, alpha=16.0, global_batch_size=PROMPTS * GROUP, lr=5e-3,
                                   loss=settings))
    gen = torch.Generator().manual_seed(0)
    greedy_before = _mean_reward(_sample(actor, tokenizer, rows, 1, None))
    rewards = []
    for _ in range(STEPS):
        samples = _sample(actor, tokenizer, rows, GROUP, gen)
        reward_kl = actor.reward_kl(samples) if needs_reward_kl(settings) else None
        advantages = adapter_token_advantages(
            torch.tensor([s.reward for s in samples]), [GROUP] * PROMPTS, ["a"] * PROMPTS,
            [[1] * len(s.response_ids) for s in samples], {"a": settings}, reward_kl)
        if estimator.startswith("reinforce_plus_plus"):
            assert all(isinstance(a, list) for a in advantages)  # per-token advantages reached the rank
        actor.train(samples, advantages, {"a": len(samples)})
        actor.step_adapters(["a"])
        rewards.append(_mean_reward(samples))
    greedy_after = _mean_reward(_sample(actor, tokenizer, rows, 1, None))
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.2, (estimator, rewards)
    assert greedy_after >= greedy_before + 0.25, (estimator, greedy_before, greedy_after)
