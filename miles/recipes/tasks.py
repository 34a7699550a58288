"""Synthetic arithmetic skills of the tiny base model, their datasets, and greedy accuracy.

Each skill maps a prompt to a short numeric answer:

    add   "12+35="  -> "47"     two-digit operands (10..99)
    sub   "52-17="  -> "35"     two-digit operands, never negative
    mul   "123*4="  -> "492"    a three-digit number times one digit (2..9)

Every skill has a finite problem set, shuffled with a fixed seed and cut into three
disjoint splits: `test` (held out from everything), `train` (what adapters learn from
with RL; the base model never sees it either, so its train and test accuracy agree)
and `pretrain` (the rest, which the tiny base model is pretrained on). Rows are written
as jsonl `{"text": prompt, "label": answer}`, the default `input_key`/`label_key` of
adapters.

    rows = read_examples(".cache/tiny_base/data/add_test.jsonl")
    acc = evaluate_accuracy(model, tokenizer, rows, max_new_tokens=6, batch_size=256)
    acc = evaluate_adapter_dir(".cache/tiny_base", "runs/demo/adapters/add/checkpoints/step_40",
                               ".cache/tiny_base/data/add_test.jsonl", n=500)

`evaluate_accuracy` decodes greedily, cuts the answer at EOS or a newline and compares
it to the label numerically; it works on a plain Hugging Face model, a PEFT model, and
a model with the multi-LoRA page table (pass `slot=`).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles.rollout.rewards.answers import numbers_equal, parse_number


@dataclass(frozen=True)
class Example:
    """One problem: the prompt the model continues and the answer it should write."""

    text: str
    label: str

    def to_json(self) -> str:
        return json.dumps({"text": self.text, "label": self.label})


@dataclass(frozen=True)
class Task:
    """A skill: its complete problem set and how it is split."""

    name: str
    make_problems: Callable[[], list[Example]]
    """Every problem of the skill, in a fixed order."""
    test_size: int
    """Problems held out for evaluation (never trained on)."""
    train_size: int
    """Problems adapters train on (unseen by the base model); the rest is for pretraining."""


@dataclass(frozen=True)
class TaskSplit:
    """Disjoint splits of one task's problems."""

    pretrain: list[Example]
    train: list[Example]
    test: list[Example]


TWO_DIGITS = range(10, 100)


def _add_problems() -> list[Example]:
    return [Example(f"{a}+{b}=", str(a + b)) for a in TWO_DIGITS for b in TWO_DIGITS]


def _sub_problems() -> list[Example]:
    return [Example(f"{a}-{b}=", str(a - b)) for a in TWO_DIGITS for b in TWO_DIGITS if b <= a]


def _mul_problems() -> list[Example]:
    return [Example(f"{a}*{b}=", str(a * b)) for a in range(100, 1000) for b in range(2, 10)]


TASKS: dict[str, Task] = {
    "add": Task("add", _add_problems, test_size=500, train_size=2000),  # 8100 problems
    "sub": Task("sub", _sub_problems, test_size=500, train_size=1000),  # 4095 problems
    "mul": Task("mul", _mul_problems, test_size=500, train_size=2000),  # 7200 problems
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}: choose one of {sorted(TASKS)}") from None


def split_task(name: str, seed: int = 0) -> TaskSplit:
    """A seeded shuffle of all problems cut into test, train and pretrain, in that order."""
    task = get_task(name)
    problems = task.make_problems()
    random.Random(f"{seed}:{name}").shuffle(problems)
    end_train = task.test_size + task.train_size
    return TaskSplit(pretrain=problems[end_train:], train=problems[task.test_size:end_train],
                     test=problems[: task.test_size])


def write_examples(path: str | Path, rows: Sequence[Example]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(row.to_json() + "\n" for row in rows))
    return path


def read_examples(path: str | Path, *, input_key: str = "text", label_key: str = "label") -> list[Example]:
    """Rows of a jsonl dataset as examples (both keys must be present in every row)."""
    rows = []
    with open(path) as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if input_key not in record or label_key not in record:
                raise ValueError(f"{path}:{line_no}: a row needs keys {input_key!r} and {label_key!r}, "
                                 f"got {sorted(record)}")
            rows.append(Example(str(record[input_key]), str(record[label_key])))
    return rows


def write_task_datasets(data_dir: str | Path, names: Sequence[str], seed: int = 0) -> dict[str, tuple[Path, Path]]:
    """Write `{name}_train.jsonl` and `{name}_test.jsonl` per task; return their paths."""
    data_dir = Path(data_dir)
    paths = {}
    for name in names:
        split = split_task(name, seed)
        paths[name] = (
            write_examples(data_dir / f"{name}_train.jsonl", split.train),
            write_examples(data_dir / f"{name}_test.jsonl", split.test),
        )
    return paths


def digit_match_reward(args: Any, sample: Any) -> float:
    """Partial credit: the share of digit places (aligned at the units) the answer gets right.

    A custom reward (`custom_rm_path: miles.recipes.tasks.digit_match_reward`); 1.0 only
    for the exact answer, so its optimum is the `exact` reward's.

    >>> from miles.utils.types import Sample
    >>> digit_match_reward(None, Sample("mul", 0, 0, 0, "123*4=", "492", {}, [], response="482"))
    0.6666666666666666
    >>> digit_match_reward(None, Sample("mul", 0, 0, 0, "123*4=", "492", {}, [], response="4920"))
    0.0
    """
    label = "" if sample.label is None else str(sample.label).strip()
    answer = sample.response.split("\n", 1)[0].strip()
    if not label or not answer:
        return 0.0
    hits = sum(a == b for a, b in zip(reversed(answer), reversed(label)))
    return hits / max(len(answer), len(label))


# --------------------------------------------------------------------------------------
# Greedy evaluation
# --------------------------------------------------------------------------------------


def answer_is_correct(answer: str, label: str) -> bool:
    """Numbers compare by value ("047" == "47.0"); anything else compares as stripped text."""
    expected = parse_number(label)
    if expected is None:
        return answer.strip() == label.strip()
    return numbers_equal(parse_number(answer), expected)


def _cut_answer(tokenizer: Any, new_ids: list[int]) -> str:
    if tokenizer.eos_token_id in new_ids:
        new_ids = new_ids[: new_ids.index(tokenizer.eos_token_id)]
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    return text.split("\n", 1)[0]


def _batches_by_length(prompt_ids: list[list[int]], batch_size: int) -> Iterator[list[int]]:
    """Indices of prompts in batches of equal token length, so no padding is ever needed."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, ids in enumerate(prompt_ids):
        by_length[len(ids)].append(index)
    for length in sorted(by_length):
        indices = by_length[length]
        for start in range(0, len(indices), batch_size):
            yield indices[start : start + batch_size]


@torch.no_grad()
def _greedy_batch(model: Any, input_ids_BT: torch.Tensor, eos_id: int, max_new_tokens: int,
                  slot: int | None) -> torch.Tensor:
    """Greedy continuation of equal-length prompts; returns only the new tokens [B, <=max_new]."""
    routing = nullcontext()
    if slot is not None:
        from miles.lora import use_slots

        routing = use_slots(model, [slot] * input_ids_BT.shape[0])
    sequence_BT = input_ids_BT
    finished_B = torch.zeros(input_ids_BT.shape[0], dtype=torch.bool, device=input_ids_BT.device)
    with routing:
        for _ in range(max_new_tokens):
            # Full re-encoding each step: prompts are a few tokens, so a KV cache would
            # only add ways to differ between plain, PEFT and page-table models.
            next_B = model(input_ids=sequence_BT).logits[:, -1, :].argmax(dim=-1)
            sequence_BT = torch.cat([sequence_BT, next_B[:, None]], dim=1)
            finished_B |= next_B == eos_id
            if bool(finished_B.all()):
                break
    return sequence_BT[:, input_ids_BT.shape[1]:]


def greedy_answers(
    model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int = 8,
    batch_size: int = 256, slot: int | None = None,
) -> list[str]:
    """The greedy answer to each prompt, cut at EOS or newline (prompt tokens get no BOS)."""
    if max_new_tokens <= 0 or batch_size <= 0:
        raise ValueError(f"max_new_tokens and batch_size must be > 0, got {max_new_tokens} and {batch_size}")
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if any(not ids for ids in prompt_ids):
        raise ValueError("every prompt must encode to at least one token; drop empty prompts")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    answers: list[str] = [""] * len(prompts)
    try:
        for indices in _batches_by_length(prompt_ids, batch_size):
            batch_BT = torch.tensor([prompt_ids[i] for i in indices], dtype=torch.long, device=device)
            new_BT = _greedy_batch(model, batch_BT, tokenizer.eos_token_id, max_new_tokens, slot)
            for i, new_ids in zip(indices, new_BT.tolist()):
                answers[i] = _cut_answer(tokenizer, new_ids)
    finally:
        model.train(was_training)
    return answers


def evaluate_accuracy(
    model: Any, tokenizer: Any, rows: Sequence[Example], *, max_new_tokens: int = 8,
    batch_size: int = 256, slot: int | None = None,
) -> float:
    """Fraction of rows whose greedy answer equals the label (see `answer_is_correct`).

    `slot` routes every sample through that row of a multi-LoRA page table (-1: base).
    """
    if not rows:
        raise ValueError("evaluate_accuracy needs at least one row")
    answers = greedy_answers(model, tokenizer, [r.text for r in rows], max_new_tokens=max_new_tokens,
                             batch_size=batch_size, slot=slot)
    return sum(answer_is_correct(a, r.label) for a, r in zip(answers, rows)) / len(rows)


def evaluate_adapter_dir(
    base_dir: str | Path, adapter_dir: str | Path | None, dataset_path: str | Path, n: int | None = None,
    *, max_new_tokens: int = 8,
) -> float:
    """Greedy accuracy of the base model (adapter_dir None) or base + a PEFT adapter on
    the first `n` rows of a jsonl dataset (all rows when n is None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_examples(dataset_path)[:n]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return evaluate_accuracy(model, tokenizer, rows, max_new_tokens=max_new_tokens)
