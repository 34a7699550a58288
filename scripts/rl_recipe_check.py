"""Check the demo's RL recipe in one process: GRPO on the tiny base, no Ray, no engines.

    .venv/bin/python scripts/rl_recipe_check.py --config configs/tiny-multi-lora.yaml [trainer flags]

Reads the same run config and adapter YAMLs as `make demo`, builds the tiny base if it
is missing, puts every adapter in its own slot of the multi-LoRA page table, and trains
them together the way the trainer does (sampled groups of `n_samples_per_prompt`
responses, the adapter's own reward, GRPO advantages, the PPO policy loss, per-slot
AdamW stepping once `rollout_batch_size` groups are in, gradient scaled by
1 / adapter_global_batch_size and clipped per slot). At the end it prints greedy
held-out accuracy of the base and of every adapter on every task, and exits 1 when an
adapter does not beat the base on its own task by `--min-gain`.

Time is reported as CPU seconds of this single-threaded process, which is what an
uncontended core would take, whatever else the machine is running.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.backends.common.loss import LossParams, grpo_advantages, policy_loss_terms
from miles.backends.common.optimizer import SlotAdamW
from miles.lora import init_slot, inject_multi_lora, lora_modules, use_slots
from miles.recipes.tasks import Example, evaluate_accuracy, read_examples
from miles.recipes.tiny_base import ensure_tiny_base
from miles.rollout.rewards.registry import RewardSpec
from miles.utils.adapter_config import AdapterDefaults, AdapterRunConfig, parse_adapter_run_yaml, resolve_adapter_config
from miles.utils.arguments import MilesConfig, parse_args
from miles.utils.types import Sample


@dataclass
class Tenant:
    name: str
    slot: int
    config: AdapterRunConfig
    train: list[Example]
    test: list[Example]
    order: list[int]
    cursor: int = 0
    steps: int = 0

    def next_prompts(self, rng: random.Random) -> list[Example]:
        """The next `rollout_batch_size` rows of a reshuffled-per-epoch stream."""
        out = []
        for _ in range(self.config.rollout_batch_size):
            if self.cursor == len(self.order):
                rng.shuffle(self.order)
                self.cursor = 0
            out.append(self.train[self.order[self.cursor]])
            self.cursor += 1
        return out


def test_path_of(train_path: str) -> Path:
    path = Path(train_path)
    if not path.stem.endswith("_train"):
        raise ValueError(f"{train_path}: expected a '<task>_train.jsonl' dataset next to its '<task>_test.jsonl'")
    return path.with_name(path.stem[: -len("_train")] + "_test" + path.suffix)


@torch.no_grad()
def sample_groups(model, tokenizer, prompts: list[str], n: int, slot: int, cfg: MilesConfig, gen: torch.Generator):
    """n sampled responses per prompt (prompts of equal token length); ids include EOS when emitted."""
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if len({len(x) for x in ids}) != 1:
        raise ValueError("the recipe check samples prompts of one token length per batch")
    prompt_BT = torch.tensor(ids).repeat_interleave(n, dim=0)
    seq_BT, done_B = prompt_BT, torch.zeros(prompt_BT.shape[0], dtype=torch.bool)
    with use_slots(model, [slot] * prompt_BT.shape[0]):
        for _ in range(cfg.rollout_max_response_len):
            logits_BV = model(input_ids=seq_BT).logits[:, -1, :].float() / cfg.rollout_temperature
            next_B = torch.multinomial(torch.softmax(logits_BV, -1), 1, generator=gen).squeeze(1)
            next_B = torch.where(done_B, torch.full_like(next_B, tokenizer.pad_token_id), next_B)
            seq_BT = torch.cat([seq_BT, next_B[:, None]], dim=1)
            done_B |= next_B == tokenizer.eos_token_id
            if bool(done_B.all()):
                break
    responses = []
    for row in seq_BT[:, prompt_BT.shape[1]:].tolist():
        cut = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        responses.append(row[:cut])
    return prompt_BT[:, :].tolist(), responses


def train_step(model, tokenizer, tenant: Tenant, opt: SlotAdamW, cfg: MilesConfig, rng, gen) -> float:
    """One optimizer step of one adapter; returns its mean raw reward."""
    rows = tenant.next_prompts(rng)
    n = tenant.config.n_samples_per_prompt
    prompt_ids, responses = sample_groups(model, tokenizer, [r.text for r in rows], n, tenant.slot, cfg, gen)
    spec = RewardSpec(tenant.config.rm_type, tenant.config.custom_rm_path, cfg.rm_type)
    rewards = []
    for i, response_ids in enumerate(responses):
        row = rows[i // n]
        text = tokenizer.decode(response_ids, skip_special_tokens=True)
        sample = Sample(tenant.name, tenant.slot, i // n, i % n, row.text, row.label, {},
                        prompt_ids[i], response_ids, text)
        rewards.append(float(spec.resolve(sample)(cfg, sample)))
    rewards_N = torch.tensor(rewards)
    adv_N = grpo_advantages(rewards_N, [n] * len(rows))
    width = max(len(r) for r in responses)
    seq_NT = torch.tensor([p + r + [tokenizer.pad_token_id] * (width - len(r)) for p, r in zip(prompt_ids, responses)])
    mask_NT = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses])
    plen = len(prompt_ids[0])
    with use_slots(model, [tenant.slot] * len(responses)):
        logits = model(input_ids=seq_NT).logits[:, plen - 1 : -1, :].float()
        logprobs_NT = torch.log_softmax(logits, -1).gather(-1, seq_NT[:, plen:, None]).squeeze(-1)
        out = policy_loss_terms(logprobs_NT, logprobs_NT.detach(), adv_N, mask_NT,
                                LossParams.uniform(cfg.loss, len(responses)))
        out.loss_B.sum().backward()
    opt.scale_slot_grad(tenant.slot, 1.0 / tenant.config.adapter_global_batch_size)
    opt.clip_slot_grad(tenant.slot, cfg.clip_grad)
    opt.step_slot(tenant.slot, tenant.config.lr)
    opt.zero_slot_grad(tenant.slot)
    tenant.steps += 1
    return float(rewards_N.mean())


def load_tenants(cfg: MilesConfig) -> list[Tenant]:
    defaults = AdapterDefaults.from_config(cfg)
    tenants = []
    for slot, (name, path) in enumerate(cfg.initial_adapters):
        config = resolve_adapter_config(name, parse_adapter_run_yaml(path, name), defaults)
        if config.num_step is None:
            raise ValueError(f"adapter {name}: set num_step in {path} so the recipe has a fixed length")
        train = read_examples(config.data, input_key=config.input_key, label_key=config.label_key)
        test = read_examples(test_path_of(config.data))
        tenants.append(Tenant(name, slot, config, train, test, list(range(len(train)))))
    return tenants


def accuracy_table(model, tokenizer, tenants: list[Tenant], slots: list[int], rows: int) -> dict[int, dict[str, float]]:
    """Greedy accuracy per slot (-1: base) and task."""
    return {
        slot: {t.name: evaluate_accuracy(model, tokenizer, t.test[:rows], max_new_tokens=6, slot=slot) for t in tenants}
        for slot in slots
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-multi-lora.yaml")
    parser.add_argument("--eval-rows", type=int, default=500)
    parser.add_argument("--min-gain", type=float, default=0.10)
    args, flags = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    cfg = parse_args(["--config", args.config, *flags])  # any trainer flag overrides the config
    # A base built with another seed or thread count (its own recipe.json) is used as it is.
    has_build = (Path(cfg.hf_checkpoint) / "recipe.json").exists()
    base_dir = Path(cfg.hf_checkpoint) if has_build else ensure_tiny_base(cfg.hf_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    tenants = load_tenants(cfg)
    inject_multi_lora(model, n_slots=len(tenants), max_rank=cfg.lora_rank, target_modules=cfg.target_modules)
    params = [p for m in lora_modules(model).values() for p in ((m.lora_A, 1), (m.lora_B, 2))]
    opt = SlotAdamW(params, n_slots=len(tenants), betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    for t in tenants:
        init_slot(model, t.slot, rank=t.config.rank, alpha=t.config.alpha,
                  generator=torch.Generator().manual_seed(cfg.seed + t.slot))
        opt.configure_slot(t.slot, rank=t.config.rank, lr=t.config.lr, weight_decay=t.config.weight_decay)
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    model.train()
    started = last = time.process_time()
    rewards: dict[str, float] = {}
    while any(t.steps < t.config.num_step for t in tenants):
        for t in tenants:
            if t.steps < t.config.num_step:
                rewards[t.name] = train_step(model, tokenizer, t, opt, cfg, rng, gen)
        if time.process_time() - last >= 5.0:
            last = time.process_time()
            line = "  ".join(f"{t.name} step {t.steps} reward {rewards[t.name]:.2f}" for t in tenants)
            print(f"[{last - started:6.1f} cpu-s] {line}", flush=True)
    rl_seconds = time.process_time() - started
    table = accuracy_table(model, tokenizer, tenants, [-1] + [t.slot for t in tenants], args.eval_rows)
    return report(tenants, table, rl_seconds, args.min_gain)


def report(tenants: list[Tenant], table: dict[int, dict[str, float]], rl_seconds: float, min_gain: float) -> int:
    names = [t.name for t in tenants]
    print(f"\nRL: {rl_seconds:.0f} CPU seconds for {sum(t.steps for t in tenants)} adapter steps")
    print("greedy held-out accuracy".ljust(24) + "".join(n.rjust(8) for n in names))
    print("base".ljust(24) + "".join(f"{table[-1][n]:8.3f}" for n in names))
    failed = []
    for t in tenants:
        print(f"adapter {t.name} (slot {t.slot})".ljust(24) + "".join(f"{table[t.slot][n]:8.3f}" for n in names))
        if table[t.slot][t.name] < table[-1][t.name] + min_gain - 1e-9:  # tolerate float rounding of the sum
            failed.append(t.name)
    if failed:
        print(f"FAIL: {failed} gained less than {min_gain:.2f} on their own task")
        return 1
    print(f"OK: every adapter beats the base on its own task by at least {min_gain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
