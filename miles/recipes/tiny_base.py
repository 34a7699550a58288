"""The tiny pretrained base model that the demo's adapters improve with RL.

    python -m miles.recipes.tiny_base --out .cache/tiny_base [--force]

pretrains, deterministically and without downloading anything, a small Llama with
the project's character tokenizer (`miles.recipes.tiny_model.build_char_tokenizer`) on
the synthetic skills of `miles.recipes.tasks`, stopping at partial accuracy so that RL
has room to improve each skill. A second call with the same recipe returns at once:
the directory holds `recipe.json` with the recipe's fingerprint, and a build only
happens when that is missing or differs (or with `--force`).

Output directory:

    config.json, model.safetensors, generation_config.json   HF model (save_pretrained)
    tokenizer.json, tokenizer_config.json, ...               its tokenizer
    data/{task}_train.jsonl, data/{task}_test.jsonl          {"text": prompt, "label": answer}
    base_accuracy.json                                       greedy accuracy per task (test split)
    recipe.json                                              recipe, fingerprint, build time

Model (`TinyBaseRecipe` defaults): Llama, hidden 128, 4 layers, 4 heads (no GQA), MLP
256, untied embeddings, the character vocabulary of `build_char_tokenizer` (100 ids):
682,112 parameters. AdamW (lr 2e-3 after 100 warmup steps, betas 0.9/0.98), 850 steps
of 128 problems drawn with task weights add 1 : sub 1.35 : mul 3, loss on the answer
tokens and EOS only. Problems come from each task's `pretrain` split only, so the
adapters' `train` split and the `test` split are both unseen by the base model. Run
single-threaded: bitwise repeatable on one machine (not across CPUs: a build on another
machine scored add 0.716, sub 0.558, mul 0.332, twice), and no slower on a 2-core
machine where other processes compete for the second core.

Tasks: `add` "12+35=" -> "47", `sub` "52-17=" -> "35", `mul` "123*4=" -> "492".

Measured on the development machine (2 cores, shared with other jobs at the time):
    greedy accuracy on the 500-row test splits: add 0.300, sub 0.392, mul 0.376
    build: 97 s wall (95.5 s of pretraining, then datasets and scoring)
The accuracy curve is steep around this point (at 900 steps, on 300 test rows: add
0.43, sub 0.49, mul 0.55); bases caught mid-climb gained most from GRPO in our trials.
`scripts/rl_recipe_check.py --config configs/tiny-multi-lora.yaml` raises add
0.300 -> 0.526, sub 0.392 -> 0.570 and mul 0.376 -> 0.498 in 40/50/80 adapter steps
(47 CPU seconds in one process).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from miles.recipes.tasks import Example, evaluate_accuracy, split_task, write_task_datasets
from miles.recipes.tiny_model import build_char_tokenizer, tiny_config

logger = logging.getLogger(__name__)

RECIPE_FILE = "recipe.json"
ACCURACY_FILE = "base_accuracy.json"
# Bump when the build code changes in a way the recipe fields do not capture.
BUILD_VERSION = 1


@dataclass(frozen=True)
class TinyBaseRecipe:
    """Everything that determines the built model; its fingerprint keys the cache."""

    tasks: tuple[str, ...] = ("add", "sub", "mul")
    task_weights: tuple[float, ...] = (1.0, 1.35, 3.0)
    """Relative sampling weight of each task in pretraining batches."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 256
    steps: int = 850
    batch_size: int = 128
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.0
    seed: int = 0
    data_seed: int = 0
    """Seed of the task splits (which problems are pretrain / train / test)."""
    eval_rows: int | None = None
    """Test rows per task scored into base_accuracy.json (None: all)."""

    def __post_init__(self) -> None:
        if len(self.tasks) != len(self.task_weights):
            raise ValueError(f"give one weight per task: {len(self.tasks)} tasks, {len(self.task_weights)} weights")
        if min(self.task_weights) <= 0 or self.steps <= 0 or self.batch_size <= 0:
            raise ValueError("task weights, steps and batch_size must all be > 0")

    def fingerprint(self) -> str:
        payload = json.dumps({"build_version": BUILD_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def is_built(out_dir: str | Path, recipe: TinyBaseRecipe = TinyBaseRecipe()) -> bool:
    """True when `out_dir` holds a complete build of exactly this recipe."""
    path = Path(out_dir) / RECIPE_FILE
    try:
        return json.loads(path.read_text()).get("fingerprint") == recipe.fingerprint()
    except (FileNotFoundError, json.JSONDecodeError):
        return False


@contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """One build at a time per directory, across processes (tests, demo, CLI)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_tiny_base(out_dir: str | Path, recipe: TinyBaseRecipe = TinyBaseRecipe(), *, force: bool = False) -> Path:
    """Return `out_dir` holding the tiny base of `recipe`, building it only when needed."""
    out_dir = Path(out_dir).resolve()
    if not force and is_built(out_dir, recipe):
        return out_dir
    with _build_lock(out_dir):
        if not force and is_built(out_dir, recipe):  # another process built it meanwhile
            return out_dir
        _check_replaceable(out_dir)
        staging = out_dir.with_name(out_dir.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny_base(staging, recipe)
        # Swap in the finished build; recipe.json is written last, so a crash never
        # leaves a directory that looks complete.
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
    return out_dir


def _check_replaceable(out_dir: Path) -> None:
    """A rebuild deletes `out_dir`: allow that only for an earlier build or an empty directory."""
    if out_dir.exists() and not (out_dir / RECIPE_FILE).exists() and any(out_dir.iterdir()):
        raise FileExistsError(
            f"{out_dir} exists and is not a tiny base build (no {RECIPE_FILE}); "
            "pass a new or empty directory to --out"
        )


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------


def _encode_examples(tokenizer: PreTrainedTokenizerFast, rows: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [N, T] of prompt + answer + EOS, and labels that score only answer + EOS."""
    prompts = tokenizer([r.text for r in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r.label for r in rows], add_special_tokens=False)["input_ids"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seqs = [p + a + [eos] for p, a in zip(prompts, answers)]
    width = max(map(len, seqs))
    ids_NT = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels_NT = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        ids_NT[i, : len(seq)] = torch.tensor(seq)
        labels_NT[i, len(prompt) : len(seq)] = torch.tensor(seq[len(prompt):])
    return ids_NT, labels_NT


def _lr_at(recipe: TinyBaseRecipe, step: int) -> float:
    return recipe.lr * min(1.0, step / max(1, recipe.warmup_steps))


def _pretrain(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, recipe: TinyBaseRecipe) -> None:
    per_task = [_encode_examples(tokenizer, split_task(name, recipe.data_seed).pretrain) for name in recipe.tasks]
    rng = random.Random(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay)
    model.train()
    start = last_report = time.monotonic()
    for step in range(1, recipe.steps + 1):
        picks = rng.choices(range(len(per_task)), weights=recipe.task_weights, k=recipe.batch_size)
        rows = [(t, rng.randrange(per_task[t][0].shape[0])) for t in picks]
        ids_BT, labels_BT = _gather_batch(per_task, rows)
        logits_BTV = model(input_ids=ids_BT).logits
        loss = F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1), labels_BT[:, 1:].flatten())
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(recipe, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        now = time.monotonic()
        if now - last_report >= 5.0 or step == recipe.steps:
            logger.info("tiny base: step %d/%d  loss %.3f  elapsed %.0fs", step, recipe.steps, loss.item(), now - start)
            last_report = now


TaskTensors = tuple[torch.Tensor, torch.Tensor]
"""(ids [N, T], labels [N, T]) of one task's pretraining problems."""


def _gather_batch(per_task: list[TaskTensors], rows: list[tuple[int, int]]) -> TaskTensors:
    """Stack the chosen rows, trimmed to the longest sequence among them."""
    width = max(per_task[t][0].shape[1] for t, _ in rows)
    ids, labels = [], []
    for t, i in rows:
        task_ids, task_labels = per_task[t]
        pad = width - task_ids.shape[1]
        ids.append(F.pad(task_ids[i], (0, pad), value=0))
        labels.append(F.pad(task_labels[i], (0, pad), value=-100))
    return torch.stack(ids), torch.stack(labels)


@contextmanager
def _single_thread() -> Iterator[None]:
    """Run single-threaded: bitwise repeatable, and immune to the slowdown that
    multi-threaded kernels suffer on a shared, oversubscribed machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_tiny_base(out_dir: str | Path, recipe: TinyBaseRecipe = TinyBaseRecipe()) -> Path:
    """Pretrain and write the tiny base, its datasets and accuracies to `out_dir` (overwrites)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tokenizer = build_char_tokenizer()
    config = tiny_config(
        "llama", tokenizer, hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
        num_heads=recipe.num_heads, num_kv_heads=recipe.num_heads,
        intermediate_size=recipe.intermediate_size, max_position_embeddings=128,
    )
    logger.info("tiny base: pretraining %s for %d steps into %s", "/".join(recipe.tasks), recipe.steps, out_dir)
    with _single_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _pretrain(model, tokenizer, recipe)
        train_seconds = time.monotonic() - started
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        write_task_datasets(out_dir / "data", recipe.tasks, recipe.data_seed)
        accuracy = _score_tasks(model, tokenizer, recipe)
    total_seconds = time.monotonic() - started
    (out_dir / ACCURACY_FILE).write_text(json.dumps(accuracy, indent=2) + "\n")
    record = {"fingerprint": recipe.fingerprint(), "recipe": dataclasses.asdict(recipe),
              "train_seconds": round(train_seconds, 1), "build_seconds": round(total_seconds, 1),
              "parameters": sum(p.numel() for p in model.parameters())}
    (out_dir / RECIPE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    logger.info("tiny base: built in %.0fs; greedy test accuracy %s", total_seconds, accuracy)
    return out_dir


def _score_tasks(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast,
                 recipe: TinyBaseRecipe) -> dict[str, float]:
    accuracy = {}
    for name in recipe.tasks:
        test = split_task(name, recipe.data_seed).test[: recipe.eval_rows]
        accuracy[name] = round(evaluate_accuracy(model, tokenizer, test), 4)
    return accuracy


def read_base_accuracy(out_dir: str | Path) -> dict[str, float]:
    """Per-task greedy test accuracy recorded by the build."""
    return json.loads((Path(out_dir) / ACCURACY_FILE).read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="Directory of the tiny base (cached).")
    parser.add_argument("--force", action="store_true", help="Rebuild even if a build of this recipe exists.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = ensure_tiny_base(args.out, force=args.force)
    print(json.dumps({"path": str(out), "base_accuracy": read_base_accuracy(out)}))


if __name__ == "__main__":
    main()
