"""What the two SmolLM2 Tinker scripts share: the trainer they drive, the task's rows as
tokens, its reward, held-out scoring through a sampler, and stage timing.

Used by `scripts/tinker_smollm2_sft.py` and `scripts/tinker_smollm2_rl.py` (run those).
The model is SmolLM2-135M-Instruct as `miles.recipes.smollm2` converts it offline into
`.cache/smollm2`, with its task datasets in `.cache/smollm2/data/`.

Prompt format: the model's own chat template (the dataset rows are chat messages: a system
prompt, one worked exchange, the question), rendered with the assistant turn opened, exactly
as the trainer's data source renders them for server-driven adapters. A reply is the bare
number followed by the end-of-turn token `<|im_end|>` (the tokenizer's EOS); it earns the
built-in `exact` reward only when the model ends its turn and the text before is the label.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import tinker
from tinker import types
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from miles.controller.actor import API_URL_LINE
from miles.recipes import smollm2
from miles.rollout.rewards import get_reward_fn
from miles.utils.types import Sample

ROOT = Path(__file__).resolve().parents[1]
TRAINER = "miles.main.train_multi_lora_async"
API_KEY = "tml-local"
"""Any key does for a trainer started without --multi-lora-api-token (the scripts' own)."""
TIMEOUT = 600.0
"""Seconds a single SDK call may take (a train step of 56 rows took 33 s on 2 busy cores)."""
REWARD = get_reward_fn("exact")
"""The reward of the task's server-driven adapters (configs/adapters/smollm2-*.yaml)."""


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "smollm2",
                        help="SmolLM2 as miles.recipes.smollm2 converts it (converted here when missing).")
    parser.add_argument("--task", choices=sorted(smollm2.TASKS), default="next", help="Which SmolLM2 task.")
    parser.add_argument("--seed", type=int, default=0, help="Seeds the model's LoRA init, row order and sampling.")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the model (and the trainer's slot width).")
    parser.add_argument("--train-unembed", action=argparse.BooleanOptionalAction, default=True,
                        help="Also train a LoRA on lm_head (the SDK's default; the trainer runs with --lora-unembed).")
    parser.add_argument("--held-out", type=int, default=200,
                        help="Held-out rows scored before and after (the first N of the test split; it has 200).")
    parser.add_argument("--base-url", default=None,
                        help="Drive a trainer already running at this URL instead of starting one (it must "
                             "serve the model of --model-dir, whose tokenizer is read here, with --save and a "
                             "free slot of at least --rank).")
    parser.add_argument("--api-key", default=os.environ.get("MILES_API_TOKEN", API_KEY),
                        help="The trainer's token (default: $MILES_API_TOKEN, else any key).")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of the train rank and of the engine (they take turns in these loops).")
    parser.add_argument("--save", type=Path, default=None,
                        help="The started trainer's --save: its registry, snapshots, metrics and log. Default: "
                             "runs/tinker-smollm2-{sft,rl}, emptied at each start (a given one is kept as it is).")
    return parser


# ---- the trainer ------------------------------------------------------------------------


def trainer_flags(model_dir: Path, save: Path, *, rank: int, seed: int, threads: int, unembed: bool) -> list[str]:
    """One slot, one builtin engine on CPU, the control plane on a port the OS picks."""
    flags = [
        "--hf-checkpoint", str(model_dir),
        "--device", "cpu",
        "--seed", str(seed),
        "--multi-lora-n-adapters", "1",
        "--multi-lora-api-port", "0",
        "--multi-lora-allowed-roots", str(save.parent),
        "--multi-lora-idle-poll-s", "0.5",
        "--lora-rank", str(rank),
        "--rollout-num-engines", "1",
        "--engine-num-threads", str(threads),
        "--actor-num-cpus-per-worker", str(threads),
        "--micro-batch-size", "16",  # bounds the [rows, length, 49152] logits in memory
        "--save", str(save),
    ]
    return [*flags, "--lora-unembed"] if unembed else flags


@contextmanager
def running_trainer(args: argparse.Namespace, default_save: Path) -> Iterator[str]:
    """The URL of the trainer to drive: `--base-url`, else a trainer started here as a
    subprocess (its log in `{save}/trainer.log`), stopped with SIGTERM when the block ends."""
    if args.base_url:
        yield args.base_url
        return
    save = args.save or default_save
    if args.save is None:  # the previous run's: a trainer would restore its registry
        shutil.rmtree(save, ignore_errors=True)
    save.mkdir(parents=True, exist_ok=True)
    log_path = save / "trainer.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    flags = trainer_flags(args.model_dir, save, rank=args.rank, seed=args.seed, threads=args.threads,
                          unembed=args.train_unembed)
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", TRAINER, *flags], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = _wait_for_url(proc, log_path, timeout=300.0)
            print(f"trainer at {url} ({time.monotonic() - started:.0f} s to start; log {log_path})", flush=True)
            yield url
        finally:
            _stop(proc, log_path)


def _log_tail(log_path: Path, n: int = 30) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-n:])


def _wait_for_url(proc: subprocess.Popen[bytes], log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer exited with {proc.returncode}:\n{_log_tail(log_path)}")
        found = API_URL_LINE.search(log_path.read_text(errors="replace"))
        if found:
            try:
                if httpx.get(f"{found.group(1)}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return found.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise TimeoutError(f"the trainer did not serve within {timeout:.0f} s:\n{_log_tail(log_path)}")


def _stop(proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 120.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        print(f"the trainer did not stop within {timeout:.0f} s; killed:\n{_log_tail(log_path)}", file=sys.stderr)


def service_client(url: str, api_key: str) -> tinker.ServiceClient:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    return tinker.ServiceClient(base_url=url, api_key=api_key)


def create_model(service: tinker.ServiceClient, url: str, args: argparse.Namespace) -> tinker.TrainingClient:
    """A LoRA of `--rank` on the trainer's base model, seeded by `--seed` (the trainer takes it
    into its slot once its engines are up). The base model is named as the trainer names it
    (its `--hf-checkpoint` as given, which a trainer started elsewhere may spell otherwise)."""
    rest = tinker.RestClient(base_url=url, api_key=args.api_key)
    supported = rest.get_server_capabilities().result(timeout=TIMEOUT).supported_models
    names = [m.model_name for m in supported if m.model_name and m.trainable]
    if len(names) != 1:
        raise SystemExit(f"expected the trainer to serve one trainable base model, it serves {names}")
    return service.create_lora_training_client(names[0], rank=args.rank, seed=args.seed,
                                               train_unembed=args.train_unembed).result(timeout=TIMEOUT)


# ---- the task as tokens -----------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One problem of the task as tokens."""

    prompt: list[int]
    """The conversation with the chat template, the assistant turn opened."""
    label: str
    answer: list[int]
    """The reply that earns the reward: the label's tokens and the end-of-turn token."""


def load_rows(model_dir: Path, task: str, split: str, tokenizer: PreTrainedTokenizerBase) -> list[Row]:
    examples = smollm2.read_chat_examples(model_dir / "data" / f"{task}_{split}.jsonl")
    prompts = smollm2.render_prompts(tokenizer, [e.messages for e in examples])
    eos = tokenizer.eos_token_id
    return [Row(prompt, e.label, [*tokenizer.encode(e.label, add_special_tokens=False), eos])
            for prompt, e in zip(prompts, examples, strict=True)]


def prepare(args: argparse.Namespace) -> PreTrainedTokenizerBase:
    """Quiet the SDK's long-poll warnings, convert the model if needed (offline), load its tokenizer."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # The trainer answers a long poll with `try_again` after 20 s (a train step can take longer);
    # the SDK polls again, and warns each time.
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
    smollm2.ensure_smollm2(args.model_dir)
    return AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)


def split_rows(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase,
               n_train: int) -> tuple[list[Row], list[Row]]:
    """`n_train` rows of the task's train split in a `--seed` shuffle, and the first `--held-out`
    rows of its test split."""
    train = load_rows(args.model_dir, args.task, "train", tokenizer)
    if n_train > len(train):
        raise SystemExit(f"the run needs {n_train} train rows, but the {args.task} train split has {len(train)}: "
                         "fewer steps or rows per step")
    random.Random(args.seed).shuffle(train)
    return train[:n_train], load_rows(args.model_dir, args.task, "test", tokenizer)[: args.held_out]


def reply_text(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int]) -> str | None:
    """The reply up to the end-of-turn token; None when the model did not end its turn."""
    tokens = list(tokens)
    if tokenizer.eos_token_id not in tokens:
        return None
    return str(tokenizer.decode(tokens[: tokens.index(tokenizer.eos_token_id)], skip_special_tokens=True))


def reward(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int], row: Row) -> float:
    """The `exact` reward of a sampled reply (0 for a reply that never ended its turn)."""
    text = reply_text(tokenizer, tokens)
    if text is None:
        return 0.0
    sample = Sample("tinker", 0, 0, 0, "", row.label, {}, list(row.prompt), response=text)
    return float(REWARD(None, sample))


GREEDY_MAX_TOKENS = 8
"""A bare number of up to four digits and the end-of-turn token fit; longer replies are wrong."""


def greedy_accuracy(sampler: tinker.SamplingClient, tokenizer: PreTrainedTokenizerBase, rows: Sequence[Row]) -> float:
    """Mean reward of the greedy replies to `rows` (every request sent before any is read)."""
    params = types.SamplingParams(max_tokens=GREEDY_MAX_TOKENS, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(row.prompt), num_samples=1, sampling_params=params)
               for row in rows]
    return sum(reward(tokenizer, f.result(timeout=TIMEOUT).sequences[0].tokens, row)
               for f, row in zip(futures, rows, strict=True)) / len(rows)


# ---- progress ---------------------------------------------------------------------------


@contextmanager
def timed(times: dict[str, float], stage: str) -> Iterator[None]:
    """Adds the block's seconds to `times[stage]`."""
    begun = time.monotonic()
    try:
        yield
    finally:
        times[stage] = times.get(stage, 0.0) + time.monotonic() - begun


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"
