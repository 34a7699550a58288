"""The tiny pretrained base model that the demo's adapters improve with RL.

    python -m miles.recipes.tiny_base --out .cache/tiny_base [--force]

pretrains, without downloading anything, a 0.68M-parameter Llama with the project's
character tokenizer on the synthetic skills of `miles.recipes.tasks`. Each skill trains
until every skill's greedy accuracy on its probe set (held-out rows of its pretrain
split) reaches `target_accuracy`; each batch draws a skill in proportion to its distance
below the target, so the skills arrive together. The base stops at a measured accuracy,
not at a step count: float rounding on another CPU changes when it stops, not where. The build is cached by the recipe's
fingerprint (`recipe.json`); `base_accuracy.json` holds the test-split accuracy.
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
ACCURACY_BAND = (0.25, 0.55)
"""Where the default recipe's test-split accuracy lands on any CPU: the probe target 0.30, less the
probe's sampling noise, plus what a skill past its target gains while the others catch up."""
PROBE_NEW_TOKENS = 5
"""The longest answer (four digits) and its EOS."""
# Bump when the build code changes in a way the recipe fields do not capture.
BUILD_VERSION = 2


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
    target_accuracy: float | None = 0.30
    """Probe accuracy every skill must reach before pretraining stops (RL has the rest to
    climb); None trains exactly `max_steps` (small builds in tests)."""
    probe_rows: int = 300
    """Rows per skill held out of the pretrain split to probe it."""
    probe_every: int = 10
    """Steps between probes: a skill overshoots its target by at most this many steps."""
    floor_weight: float = 0.1
    """A skill past its target is still drawn at this fraction of its recipe weight."""
    max_steps: int = 4000
    """A build that has not reached every target by then fails (it says which skills lag)."""
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
        if min(self.task_weights) <= 0 or min(self.max_steps, self.batch_size, self.probe_every, self.probe_rows) <= 0:
            raise ValueError("task weights, max_steps, batch_size, probe_every and probe_rows must all be > 0")
        if self.target_accuracy is not None and not 0.0 < self.target_accuracy < 1.0:
            raise ValueError(f"target_accuracy must be in (0, 1) or None, got {self.target_accuracy}")

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


def ensure_tiny_base(out_dir: str | Path, recipe: TinyBaseRecipe = TinyBaseRecipe(), *, force: bool = False,
                     threads: int = 1) -> Path:
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
        build_tiny_base(staging, recipe, threads=threads)
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


class BaseNotReachedError(RuntimeError):
    """Pretraining hit `max_steps` before every skill reached its target accuracy."""


def _mixture(recipe: TinyBaseRecipe, probe: dict[str, float]) -> list[float]:
    """Sampling weight of each skill: its recipe weight times its distance below the target,
    never under `floor_weight` of it, so a skill past its target keeps a little practice
    (without any it is forgotten within a few dozen steps)."""
    target = recipe.target_accuracy
    if target is None:
        return list(recipe.task_weights)
    return [w * max(recipe.floor_weight, (target - probe[name]) / target)
            for name, w in zip(recipe.tasks, recipe.task_weights)]


def _pretrain(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, recipe: TinyBaseRecipe) -> int:
    """Train until every skill's probe accuracy reaches the target; returns the steps taken."""
    splits = [split_task(name, recipe.data_seed).pretrain for name in recipe.tasks]
    probes = [split[: recipe.probe_rows] for split in splits]
    per_task = [_encode_examples(tokenizer, split[recipe.probe_rows:]) for split in splits]
    rng = random.Random(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay)
    start = last_report = time.monotonic()
    probe = dict.fromkeys(recipe.tasks, 0.0)
    next_probe = 1
    target = recipe.target_accuracy
    for step in range(1, recipe.max_steps + 1):
        if step == next_probe and target is not None:
            probe = {name: evaluate_accuracy(model, tokenizer, rows, max_new_tokens=PROBE_NEW_TOKENS)
                     for name, rows in zip(recipe.tasks, probes)}
            if min(probe.values()) >= target:
                logger.info("tiny base: every skill at its target after %d steps; probe %s", step - 1, probe)
                return step - 1
            # Far from every target, probe less often: early probes cost more than the steps between them.
            near = max(probe.values()) >= target / 2
            next_probe = step + recipe.probe_every * (1 if near else 5)
        model.train()
        picks = rng.choices(range(len(per_task)), weights=_mixture(recipe, probe), k=recipe.batch_size)
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
        if now - last_report >= 5.0:
            logger.info("tiny base: step %d  loss %.3f  probe %s  elapsed %.0fs", step, loss.item(),
                        {k: round(v, 3) for k, v in probe.items()}, now - start)
            last_report = now
    if target is None:
        return recipe.max_steps
    lagging = sorted(name for name in recipe.tasks if probe[name] < target)
    raise BaseNotReachedError(
        f"after {recipe.max_steps} steps {lagging} are below the target accuracy {target} "
        f"(probe {probe}); raise max_steps or lr, or lower target_accuracy")


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
def _threads(n: int) -> Iterator[None]:
    """Run on `n` threads (1 by default: bitwise repeatable on one machine, and immune to
    the slowdown that multi-threaded kernels suffer on a shared, oversubscribed one)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_tiny_base(out_dir: str | Path, recipe: TinyBaseRecipe = TinyBaseRecipe(), threads: int = 1) -> Path:
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
    logger.info("tiny base: pretraining %s to probe accuracy %.2f into %s", "/".join(recipe.tasks),
                recipe.target_accuracy, out_dir)
    with _threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        steps = _pretrain(model, tokenizer, recipe)
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
              "steps": steps, "train_seconds": round(train_seconds, 1), "build_seconds": round(total_seconds, 1),
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
    parser.add_argument("--seed", type=int, default=TinyBaseRecipe.seed, help="Initialisation and batch seed.")
    parser.add_argument("--threads", type=int, default=1,
                        help="Torch threads of the build (not part of the recipe: to check that numerics "
                             "do not move the outcome).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    recipe = dataclasses.replace(TinyBaseRecipe(), seed=args.seed)
    out = ensure_tiny_base(args.out, recipe, force=args.force, threads=args.threads)
    print(json.dumps({"path": str(out), "base_accuracy": read_base_accuracy(out)}))


if __name__ == "__main__":
    main()
