"""Shared pieces of the benchmark scripts: models, samples, paired timing and results.

Every figure is the ratio of two things measured in the same process run, alternating
(A B, B A, A B, ...) so that load from other processes on a shared machine hits both
sides alike; each repetition gives one ratio, and a figure reports the median ratio
with its min..max spread. Scripts print a table and, with `--json PATH`, write their
figures for `run_all.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
MODELS = ("tiny", "llama60m", "smollm2")


# ---- models -------------------------------------------------------------------------


def model_dir(name: str) -> Path:
    """Directory of a Hugging Face causal LM: a named benchmark model or a path."""
    if name == "tiny":
        from miles.recipes.tiny_base import ensure_tiny_base

        return ensure_tiny_base(CACHE / "tiny_base")
    if name == "llama60m":
        return ensure_random_llama(CACHE / "bench" / "llama60m")
    if name == "smollm2":
        try:
            from miles.recipes import smollm2
        except ImportError:
            sys.exit("--model smollm2 needs miles/recipes/smollm2.py (the SmolLM2-135M loader)")
        return Path(smollm2.ensure_smollm2(CACHE / "smollm2"))
    path = Path(name)
    if not (path / "config.json").exists():
        sys.exit(f"--model {name!r}: not one of {MODELS} and not a Hugging Face model directory")
    return path


def ensure_random_llama(out_dir: Path, *, hidden: int = 512, layers: int = 8, vocab: int = 32000) -> Path:
    """A randomly initialised Llama of ~60M parameters (seeded, built locally, no download)."""
    if (out_dir / "model.safetensors").exists():
        return out_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():  # another process built it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def vocab_size(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def random_lora_weights(model: torch.nn.Module, n_slots: int, rank: int, alpha: float, seed: int = 0) -> None:
    """Fill slots 0..n_slots-1 with random A and B (B non-zero, so every delta is real work)."""
    from miles.lora import lora_modules

    g = torch.Generator().manual_seed(seed)
    for slot in range(n_slots):
        for module in lora_modules(model).values():
            a = torch.randn(rank, module.in_features, generator=g) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, generator=g) * 0.01
            module.set_slot(slot, a, b, alpha=alpha)


# ---- samples --------------------------------------------------------------------------


def make_samples(n: int, adapters: list[tuple[str, int]], prompt_len: int, response_len: int, vocab: int,
                 seed: int = 0):
    """`n` samples spread round-robin over `adapters` ((name, slot) pairs), random tokens."""
    from miles.utils.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, slot = adapters[i % len(adapters)]
        out.append(Sample(
            adapter=name, slot=slot, group_index=i, index=0, prompt="", label=None, metadata={},
            prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt_len)],
            response_ids=[rng.randrange(3, vocab) for _ in range(response_len)],
        ))
    advantages = [rng.choice((-1.0, 1.0)) for _ in range(n)]
    return out, advantages


# ---- timing and results -------------------------------------------------------------------


def synchronize() -> None:
    """Waits for queued GPU work, so that a wall-clock time covers it (nothing on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def alternate(cases: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall time of each case, `reps` times, in alternating order (forward, then reversed);
    each time ends once the GPU's queued work (if any) is done."""
    for _ in range(warmup):
        for run in cases.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(reps):
        order = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for name in order:
            synchronize()
            start = time.perf_counter()
            cases[name]()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return times


@dataclass
class Figure:
    """One benchmark figure: `ratio = ours / baseline` per repetition (or the inverse, see `ratio_of`)."""

    figure: str
    model: str
    ours_label: str
    baseline_label: str
    ours: list[float]
    baseline: list[float]
    unit: str
    ratio_of: str
    """"ours/baseline" or "baseline/ours": which way the ratio is taken."""
    target: str
    """e.g. "<= 1.10", ">= 0.80", "== 1" (within 1e-9), or "report" (no target)."""
    params: dict = field(default_factory=dict)

    @property
    def ratios(self) -> list[float]:
        pairs = zip(self.ours, self.baseline)
        if self.ratio_of == "ours/baseline":
            return [o / b for o, b in pairs]
        return [b / o for o, b in pairs]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def met(self) -> bool | None:
        if self.target == "report":
            return None
        op, value = self.target.split()
        if op == "==":
            return all(abs(r - float(value)) <= 1e-9 for r in self.ratios)
        return self.ratio <= float(value) if op == "<=" else self.ratio >= float(value)

    def summary(self) -> dict:
        out = asdict(self)
        out.update(
            ours_median=statistics.median(self.ours), baseline_median=statistics.median(self.baseline),
            ratio=self.ratio, ratio_min=min(self.ratios), ratio_max=max(self.ratios), reps=len(self.ours), met=self.met,
        )
        return out


def report(figures: list[Figure], json_path: str | None, command: list[str]) -> None:
    for f in figures:
        s = f.summary()
        print(
            f"{f.figure} [{f.model}] {f.ours_label}: {s['ours_median']:.4g} {f.unit} | {f.baseline_label}: "
            f"{s['baseline_median']:.4g} {f.unit} | ratio ({f.ratio_of}) {s['ratio']:.3f} "
            f"[{s['ratio_min']:.3f}..{s['ratio_max']:.3f}] target {f.target} "
            f"{'' if f.met is None else 'ok' if f.met else 'MISSED'}"
        )
    if json_path:
        payload = {"command": " ".join(command), "figures": [f.summary() for f in figures]}
        Path(json_path).write_text(json.dumps(payload, indent=1))


def base_parser(doc: str, default_reps: int = 5) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help=f"one of {MODELS} or a Hugging Face model directory")
    parser.add_argument("--reps", type=int, default=default_reps, help="repetitions of each side (alternating)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 repetition")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: stable timings on a machine shared with other jobs)")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    return parser


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """`--device` and `--dtype`, for the scripts whose timed models can run on a GPU."""
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the timed models run")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="their weights' dtype (default: float32 on CPU, bfloat16 on CUDA)")


def setup(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if hasattr(args, "device"):
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.exit("--device cuda: torch.cuda.is_available() is False")
        args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.quick:
        args.reps = 1
    torch.manual_seed(0)
