"""RL on SmolLM2-135M-Instruct through the Tinker SDK: the held-out reward rises.

    .venv/bin/python scripts/tinker_smollm2_rl.py [--task next] [--steps 16] [--prompts 4] [--group 8] [--lr 1e-3]
    .venv/bin/python scripts/tinker_smollm2_rl.py --base-url http://127.0.0.1:8068   # a running trainer

Starts the trainer (`python -m miles.main.train_multi_lora_async`: one slot, one builtin
engine, CPU) unless `--base-url` is given, and runs the loop a Tinker user writes with the
official `tinker` SDK, every call against that trainer:

    sampler = trainer.save_weights_and_get_sampling_client()
    each step: sample a group of --group replies for each of --prompts new train prompts
               (temperature 1, seeded), reward each reply with the task's `exact` reward,
               advantage = reward - its group's mean (client-side), one `importance_sampling`
               (or `ppo`) datum per reply with the sampler's logprobs, forward_backward,
               optim_step, and a new sampler snapshot for the next step's samples.
               A group whose replies all score alike has no advantage and is left out; a
               step with no other group trains nothing and keeps its sampler.

Prompts are chat conversations in the model's own template (see `tinker_smollm2_common.py`);
a reply earns 1 only when it is the bare number and ends its turn within `--max-tokens`.
Measured: the greedy exact-match accuracy (= mean reward) on `--held-out` rows of the task's
test split, never trained on, with the untrained model's snapshot and with the last one.
Prints one line per step (mean reward of its samples; seconds and tokens/s of sampling,
training and the snapshot) and a final `SUMMARY` line; exits 1 when the accuracy did not rise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import tinker
from tinker import types
from tinker_smollm2_common import (
    ROOT,
    TIMEOUT,
    Row,
    base_parser,
    create_model,
    greedy_accuracy,
    minutes,
    prepare,
    reward,
    running_trainer,
    service_client,
    split_rows,
    timed,
)
from transformers import PreTrainedTokenizerBase


def rl_datums(row: Row, sequences: Sequence[types.SampledSequence], rewards_G: list[float]) -> list[types.Datum]:
    """One datum per reply: its tokens carry the reply's reward minus the group's mean as
    advantage and the sampler's logprobs; the prompt's positions carry neither."""
    baseline = sum(rewards_G) / len(rewards_G)
    n_prompt = len(row.prompt) - 1
    data = []
    for seq, value in zip(sequences, rewards_G, strict=True):
        if seq.logprobs is None or len(seq.logprobs) != len(seq.tokens):
            raise RuntimeError("the sampler returned no logprob per sampled token")
        tokens = row.prompt + seq.tokens
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:],
                            "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                            "advantages": [0.0] * n_prompt + [value - baseline] * len(seq.tokens)}))
    return data


@dataclass
class StepReport:
    reward: float
    """Mean reward of the step's samples."""
    sampled_tokens: int
    """Tokens the engine read and wrote: it prefills each sample's prompt (no prefix cache)."""
    train_rows: int = 0
    """Replies trained on: those of groups whose rewards differ."""
    trained_tokens: int = 0
    times: dict[str, float] = field(default_factory=dict)

    def line(self, step: int, steps: int) -> str:
        sample_s = self.times["sample"]
        line = (f"step {step:3d}/{steps}  reward {self.reward:.3f}  sample {sample_s:5.1f} s "
                f"{self.sampled_tokens / sample_s:4.0f} tok/s  ")
        if not self.train_rows:
            return line + "train skipped: every group scored alike"
        train_s = self.times["train"]
        return line + (f"train {self.train_rows:2d} rows {train_s:5.1f} s {self.trained_tokens / train_s:4.0f} tok/s  "
                       f"snapshot {self.times['snapshot']:.1f} s")


def rl_step(trainer: tinker.TrainingClient, sampler: tinker.SamplingClient, rows: list[Row],
            tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace,
            first_seed: int) -> tuple[StepReport, tinker.SamplingClient]:
    """Sample a group per row, reward, train on the groups with an advantage, snapshot; the
    step's report and the sampler of the weights it made (the same sampler if it trained nothing)."""
    times: dict[str, float] = {}
    with timed(times, "sample"):
        futures = [sampler.sample(types.ModelInput.from_ints(row.prompt), num_samples=args.group,
                                  sampling_params=types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                                                                       seed=first_seed + i * args.group))
                   for i, row in enumerate(rows)]
        groups = [future.result(timeout=TIMEOUT).sequences for future in futures]
    data: list[types.Datum] = []
    rewards: list[float] = []
    for row, sequences in zip(rows, groups, strict=True):
        rewards_G = [reward(tokenizer, seq.tokens, row) for seq in sequences]
        rewards += rewards_G
        if len(set(rewards_G)) > 1:  # a group that scored alike has no advantage to learn from
            data += rl_datums(row, sequences, rewards_G)
    report = StepReport(reward=sum(rewards) / len(rewards), times=times, sampled_tokens=sum(
        len(row.prompt) * len(seqs) + sum(len(seq.tokens) for seq in seqs) for row, seqs in zip(rows, groups)))
    if not data:
        return report, sampler
    with timed(times, "train"):
        fwd_bwd = trainer.forward_backward(data, args.loss)
        optim = trainer.optim_step(types.AdamParams(learning_rate=args.lr))
        fwd_bwd.result(timeout=TIMEOUT)
        optim.result(timeout=TIMEOUT)
    with timed(times, "snapshot"):
        sampler = trainer.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    report.train_rows, report.trained_tokens = len(data), sum(d.model_input.length for d in data)
    return report, sampler


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--steps", type=int, default=16, help="Steps (new train prompts each).")
    parser.add_argument("--prompts", type=int, default=4, help="Train prompts per step.")
    parser.add_argument("--group", type=int, default=8, help="Replies sampled per prompt.")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of every optim_step.")
    parser.add_argument("--max-tokens", type=int, default=8, help="Most tokens of a sampled reply.")
    parser.add_argument("--loss", choices=["importance_sampling", "ppo"], default="importance_sampling")
    args = parser.parse_args(argv)
    started = time.monotonic()
    tokenizer = prepare(args)
    train, test = split_rows(args, tokenizer, args.steps * args.prompts)

    with running_trainer(args, ROOT / "runs" / "tinker-smollm2-rl") as url, \
            service_client(url, args.api_key) as service:
        trainer = create_model(service, url, args)
        print(f"model {trainer.model_id} ready {time.monotonic() - started:.0f} s after start", flush=True)
        times: dict[str, float] = {}
        with timed(times, "eval"):
            sampler = trainer.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
            acc_before = greedy_accuracy(sampler, tokenizer, test)
        print(f"held-out ({len(test)} {args.task} rows): greedy accuracy {acc_before:.1%} ({times['eval']:.0f} s)",
              flush=True)
        step_rewards: list[float] = []
        with timed(times, "loop"):
            for step in range(1, args.steps + 1):
                rows = train[(step - 1) * args.prompts: step * args.prompts]
                first_seed = args.seed * 1_000_003 + (step - 1) * args.prompts * args.group
                report, sampler = rl_step(trainer, sampler, rows, tokenizer, args, first_seed)
                step_rewards.append(report.reward)
                print(f"{report.line(step, args.steps)}  [{time.monotonic() - started:.0f} s]", flush=True)
        with timed(times, "eval"):
            acc_after = greedy_accuracy(sampler, tokenizer, test)
    third = max(1, args.steps // 3)
    print(f"SUMMARY rl task={args.task} loss={args.loss} steps={args.steps} prompts={args.prompts} "
          f"group={args.group} lr={args.lr:g} rank={args.rank} seed={args.seed}: held-out greedy accuracy "
          f"{acc_before:.1%} -> {acc_after:.1%} ({len(test)} rows); mean train reward of the first and last "
          f"{third} steps {sum(step_rewards[:third]) / third:.3f} -> {sum(step_rewards[-third:]) / third:.3f}; "
          f"wall {minutes(time.monotonic() - started)} (RL steps {minutes(times['loop'])}, held-out scoring "
          f"{minutes(times['eval'])})", flush=True)
    return 0 if acc_after > acc_before else 1


if __name__ == "__main__":
    sys.exit(main())
