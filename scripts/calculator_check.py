"""Check that a calculator-tool adapter learns, in one process: no Ray, no router.

    .venv/bin/python scripts/calculator_check.py [--warm-steps 100] [--warm-until 0.25] [--rl-steps 60] [--seed 0]

The tiny base writes digits after `=` and has never seen `<calc>`, so RL from a fresh
adapter never samples a tool call and its reward stays 0. The adapter therefore gets
a short supervised warm start on the tool format (`--warm-steps` teacher-forced steps
on its own slot, loss on the model's tokens only, the tool's output masked out), kept
short so the warm-started adapter is still often wrong; then GRPO, with a fresh
optimizer, through the recipe's own generate function
(`miles.recipes.calculator_tool.generate`, the one the trainer calls through
`--custom-generate-function-path`) against an in-process builtin engine, with its loss
mask (`make_micro_batches`, as the train actors) and its reward. The adapter's weights
are pushed to the engine (an in-place upsert) before every rollout, as the trainer does.

Why a low rollout temperature (`--temperature 0.3`): the base was pretrained with loss
on digits and EOS only, so the LM-head rows of every other character are nearly alike,
and LoRA (decoder layers only, never `lm_head`) cannot pull them apart: teacher-forced
loss on each letter of `<calc>` plateaus near 1.7 nats however long the warm start
runs. Greedy decoding still picks the right letter, but at temperature 1 a 20-letter
call is almost never sampled intact, and RL gets no reward to learn from.

How long the warm start runs: `--warm-steps`, then `--warm-check-every` steps at a time
until greedy success on `--probe-rows` training problems reaches `--warm-until` (at most
`--warm-max-steps`). The tool format is learnt all at once (on one tiny base build success
went 0.00 -> 0.88 from 150 to 175 steps), and where that happens depends on the base, which
is bitwise repeatable per machine but not across CPUs; a fixed step count leaves one build
at 0 and another near 1, with no room for RL either way.

Printed: the held-out success rate (a well-formed call whose expression is the
problem's, and the right final answer; greedy, on `--eval-rows` products never
trained on) of the fresh adapter, after the warm start and after RL. Exits 1 when RL
gains less than `--min-gain` over the warm start.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.backends.common.batching import make_micro_batches, next_token_logprobs
from miles.backends.common.loss import LossParams, grpo_advantages, policy_loss_terms
from miles.backends.common.optimizer import SlotAdamW
from miles.lora import export_peft_adapter, init_slot, inject_multi_lora, lora_modules, use_slots
from miles.recipes import calculator_tool as calc
from miles.recipes.tiny_base import ensure_tiny_base
from miles.rollout.engines.builtin_engine import BuiltinEngine, EngineOptions
from miles.rollout.generate import GenerateFnInput, call_generate_function
from miles.utils.arguments import parse_args
from miles.utils.loss_settings import LossSettings
from miles.utils.types import GenerateRequest, GenerateResponse, LoadLoraRequest, Sample, SamplingParams

ADAPTER, SLOT = "calc", 0


class LocalAdapterEngine:
    """The `input.engine` handle of a generate function, over an in-process builtin engine."""

    def __init__(self, engine: BuiltinEngine, lora_name: str) -> None:
        self.engine, self.lora_name = engine, lora_name

    async def generate(self, input_ids: list[int], sampling_params: dict, *,
                       return_logprob: bool = True) -> GenerateResponse:
        request = GenerateRequest(input_ids=list(input_ids), sampling_params=SamplingParams(**sampling_params),
                                  lora_path=self.lora_name, return_logprob=return_logprob)
        return await self.engine.generate(request)


@dataclass
class Setup:
    model: torch.nn.Module
    tokenizer: object
    engine: BuiltinEngine
    opt: SlotAdamW
    train: list[dict[str, str]]
    test: list[dict[str, str]]
    workdir: Path
    seeds: random.Random = field(default_factory=lambda: random.Random(0))


def warm_start_batch(tokenizer, rows: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced conversations: ids [B, L] and the loss mask of next-token positions [B, L-1]."""
    seqs, masks = [], []
    for row in rows:
        prompt = tokenizer.encode(row["text"], add_special_tokens=False)
        turns = [(calc.CALL_OPEN + row["text"].rstrip("=") + calc.CALL_CLOSE, 1),
                 (calc.RESULT_OPEN + calc.calculator(row["text"].rstrip("=")) + calc.RESULT_CLOSE, 0),
                 (row["label"], 1)]
        ids, mask = list(prompt), [0] * (len(prompt) - 1)
        for text, m in turns:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [m] * len(piece)
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
        seqs.append(ids)
        masks.append(mask)
    width = max(map(len, seqs))
    ids_BL = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
    mask_BT = torch.tensor([m + [0] * (width - 1 - len(m)) for m in masks], dtype=torch.float32)
    return ids_BL, mask_BT


def warm_start(s: Setup, steps: int, lr: float, batch_size: int, rng: random.Random) -> None:
    for _ in range(steps):
        ids_BL, mask_BT = warm_start_batch(s.tokenizer, rng.sample(s.train, batch_size))
        with use_slots(s.model, [SLOT] * ids_BL.shape[0]):
            logprobs_BT = next_token_logprobs(s.model(input_ids=ids_BL).logits, ids_BL)
            loss = -(logprobs_BT * mask_BT).sum() / mask_BT.sum()
            loss.backward()
        s.opt.clip_slot_grad(SLOT, 1.0)
        s.opt.step_slot(SLOT, lr)
        s.opt.zero_slot_grad(SLOT)


async def push(s: Setup, version: int) -> None:
    """Send the slot's current weights to the engine (an in-place upsert, as `--engine-lora-update in_place`)."""
    path = export_peft_adapter(s.model, SLOT, s.workdir / f"v{version}")
    await s.engine.load_lora(LoadLoraRequest(lora_name=ADAPTER, lora_path=str(path), upsert=version > 0))


async def rollout(s: Setup, rows: list[dict[str, str]], n: int, temperature: float, cfg) -> list[Sample]:
    """n conversations per row through the recipe's generate function, concurrently."""
    handle = LocalAdapterEngine(s.engine, ADAPTER)
    params = {"max_new_tokens": 24, "temperature": temperature, "top_p": 1.0, "top_k": -1}
    samples = []
    for g, row in enumerate(rows):
        prompt_ids = s.tokenizer.encode(row["text"], add_special_tokens=False)
        for i in range(n):
            samples.append(Sample(ADAPTER, SLOT, g, i, row["text"], row["label"], {}, list(prompt_ids)))
    # A seed per conversation makes its sampling independent of how the engine batches it.
    seeds = [s.seeds.randrange(2**31) for _ in samples]
    inputs = [GenerateFnInput(args=cfg, sample=x, sampling_params={**params, "seed": seed}, engine=handle,
                              tokenizer=s.tokenizer) for x, seed in zip(samples, seeds)]
    return list(await asyncio.gather(*(call_generate_function(calc.generate, i) for i in inputs)))


async def success_rate(s: Setup, cfg, temperature: float = 0.0, n: int = 1, show: int = 0) -> float:
    """Share of held-out conversations that call the tool on the problem and answer right."""
    samples = await rollout(s, s.test, n, temperature, cfg)
    for x in samples[: show * n : n]:
        print(f"    {x.prompt}{x.response!r}", flush=True)
    return sum(calc.solved(x) for x in samples) / len(samples)


async def rl_step(s: Setup, rows: list[dict[str, str]], n: int, temperature: float, lr: float, cfg,
                  loss: LossSettings) -> float:
    """One GRPO step: sample groups, score, train on the masked-in tokens only."""
    samples = await rollout(s, rows, n, temperature, cfg)
    rewards_N = torch.tensor([calc.reward(cfg, x) for x in samples])
    adv_N = grpo_advantages(rewards_N, [n] * len(rows))
    (mb,) = make_micro_batches(samples, adv_N.tolist(), None, pad_id=s.tokenizer.pad_token_id)
    with use_slots(s.model, mb.slots):
        logprobs_BT = next_token_logprobs(
            s.model(input_ids=mb.input_ids_BL, attention_mask=mb.attention_mask_BL).logits, mb.input_ids_BL)
        out = policy_loss_terms(logprobs_BT, logprobs_BT.detach(), torch.tensor(adv_N.tolist())[mb.indices],
                                mb.loss_mask_BT, LossParams.uniform(loss, len(mb.indices)))
        out.loss_B.sum().backward()
    s.opt.scale_slot_grad(SLOT, 1.0 / len(samples))
    s.opt.clip_slot_grad(SLOT, 1.0)
    s.opt.step_slot(SLOT, lr)
    s.opt.zero_slot_grad(SLOT)
    return float(rewards_N.mean())


def new_optimizer(model: torch.nn.Module, lr: float) -> SlotAdamW:
    params = [p for m in lora_modules(model).values() for p in ((m.lora_A, 1), (m.lora_B, 2))]
    opt = SlotAdamW(params, n_slots=1)
    opt.configure_slot(SLOT, rank=8, lr=lr, weight_decay=0.0)
    return opt


async def run(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(args.seed)
    cfg = parse_args(["--hf-checkpoint", args.base, "--seed", str(args.seed)])
    base_dir = ensure_tiny_base(args.base)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    inject_multi_lora(model, n_slots=1, max_rank=8, target_modules="all-linear")
    init_slot(model, SLOT, rank=8, alpha=16.0, generator=torch.Generator().manual_seed(args.seed))
    opt = new_optimizer(model, args.warm_lr)
    engine = BuiltinEngine(EngineOptions(model_path=str(base_dir), max_loras_per_batch=1, max_lora_rank=8,
                                         max_running_requests=256, random_seed=args.seed))
    await engine.start()
    train, test = calc.split_rows(args.seed)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        s = Setup(model, tokenizer, engine, opt, train, test[: args.eval_rows], Path(tmp), random.Random(args.seed))
        try:
            version = 0
            await push(s, version)
            result = {"fresh": await success_rate(s, cfg)}
            started = time.process_time()
            warm_start(s, args.warm_steps, args.warm_lr, args.batch_size, rng)
            steps = args.warm_steps
            probe = Setup(model, tokenizer, engine, opt, train, train[: args.probe_rows], s.workdir,
                          random.Random(args.seed))
            while steps < args.warm_max_steps:
                version += 1
                await push(s, version)
                if await success_rate(probe, cfg) >= args.warm_until:
                    break
                warm_start(s, args.warm_check_every, args.warm_lr, args.batch_size, rng)
                steps += args.warm_check_every
            version += 1
            await push(s, version)
            result["warm"], result["warm_steps"] = await success_rate(s, cfg, show=3), steps
            print(f"fresh adapter {result['fresh']:.3f}  after {steps} warm-start steps {result['warm']:.3f}",
                  flush=True)
            # RL starts from the warm adapter with a fresh optimizer, as a run would
            s.opt = new_optimizer(model, args.rl_lr)
            for step in range(args.rl_steps):
                reward = await rl_step(s, rng.sample(train, args.prompts), args.n, args.temperature,
                                       args.rl_lr, cfg, cfg.loss)
                version += 1
                await push(s, version)
                if step % 5 == 4 or step == args.rl_steps - 1:
                    print(f"  RL step {step + 1}: mean reward {reward:.3f}", flush=True)
            result["rl"] = await success_rate(s, cfg, show=3)
            result["cpu_s"] = time.process_time() - started
        finally:
            engine.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=".cache/tiny_base")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-steps", type=int, default=100, help="warm-start steps before the first probe")
    parser.add_argument("--warm-until", type=float, default=0.25,
                        help="warm start until greedy success on the probe rows reaches this")
    parser.add_argument("--warm-check-every", type=int, default=5)
    parser.add_argument("--warm-max-steps", type=int, default=400)
    parser.add_argument("--probe-rows", type=int, default=48, help="training problems the warm start is probed on")
    parser.add_argument("--warm-lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rl-steps", type=int, default=60)
    parser.add_argument("--rl-lr", type=float, default=3e-4)
    parser.add_argument("--prompts", type=int, default=8, help="prompt groups per RL step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--temperature", type=float, default=0.3, help="rollout temperature of RL")
    parser.add_argument("--eval-rows", type=int, default=200)
    parser.add_argument("--min-gain", type=float, default=0.10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    r = asyncio.run(run(args))
    print(f"held-out success (tool call + right answer), {args.eval_rows} rows, greedy:\n"
          f"  fresh {r['fresh']:.3f}   warm start {r['warm']:.3f}   after RL {r['rl']:.3f}   ({r['cpu_s']:.0f} CPU s)")
    if r["rl"] < r["warm"] + args.min_gain:
        print(f"FAIL: RL gained less than {args.min_gain:.2f} over the warm start")
        return 1
    print(f"OK: RL gained at least {args.min_gain:.2f} over the warm start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
