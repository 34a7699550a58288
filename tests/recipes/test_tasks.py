"""Task datasets and greedy evaluation: splits, labels, answer matching, and accuracy on
models whose outputs are known (a scripted model, a PEFT model and the page table)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from miles.recipes.tasks import (
    TASKS,
    Example,
    answer_is_correct,
    evaluate_accuracy,
    evaluate_adapter_dir,
    greedy_answers,
    read_examples,
    split_task,
    write_task_datasets,
)
from miles.recipes.tiny_model import build_char_tokenizer


def _solve(prompt: str) -> int:
    assert prompt.endswith("=")
    for op, fn in (("+", int.__add__), ("-", int.__sub__), ("*", int.__mul__)):
        if op in prompt:
            a, b = prompt[:-1].split(op)
            return fn(int(a), int(b))
    raise AssertionError(prompt)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_disjoint_complete_and_correctly_labelled(name):
    task = TASKS[name]
    split = split_task(name, seed=0)
    everything = task.make_problems()
    assert len(split.test) == task.test_size and len(split.train) == task.train_size
    assert len(split.pretrain) == len(everything) - task.test_size - task.train_size > 0
    prompts = [{r.text for r in part} for part in (split.pretrain, split.train, split.test)]
    assert not (prompts[0] & prompts[1]) and not (prompts[0] & prompts[2]) and not (prompts[1] & prompts[2])
    assert set().union(*prompts) == {r.text for r in everything}
    for row in split.pretrain + split.train + split.test:
        assert int(row.label) == _solve(row.text) >= 0


def test_splits_depend_only_on_the_seed():
    assert split_task("add", seed=0) == split_task("add", seed=0)
    assert split_task("add", seed=0).test != split_task("add", seed=1).test


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        split_task("div")


def test_datasets_round_trip_through_jsonl(tmp_path):
    paths = write_task_datasets(tmp_path, ["sub", "mul"], seed=3)
    for name, (train_path, test_path) in paths.items():
        assert train_path.name == f"{name}_train.jsonl" and test_path.name == f"{name}_test.jsonl"
        split = split_task(name, seed=3)
        assert read_examples(train_path) == split.train
        assert read_examples(test_path) == split.test
        first = json.loads(test_path.read_text().splitlines()[0])
        assert first == {"text": split.test[0].text, "label": split.test[0].label}


def test_read_examples_names_missing_keys(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "1+1=", "label": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: a row needs keys 'text' and 'label'"):
        read_examples(path)


@pytest.mark.parametrize(
    ("answer", "label", "correct"),
    [("47", "47", True), ("047", "47", True), ("47.0", "47", True), (" 47 ", "47", True),
     ("48", "47", False), ("4712", "47", False), ("", "47", False), ("-5", "-5", True),
     ("abc", "abc", True), ("abd", "abc", False)],
)
def test_answer_is_correct(answer, label, correct):
    assert answer_is_correct(answer, label) is correct


class ScriptedLM(nn.Module):
    """Emits, after each known prompt, a fixed continuation one character at a time."""

    def __init__(self, tokenizer, continuations: dict[str, list[int]]):
        super().__init__()
        self.tokenizer = tokenizer
        self.by_prompt = {tuple(tokenizer(p, add_special_tokens=False)["input_ids"]): ids
                          for p, ids in continuations.items()}
        self.anchor = nn.Parameter(torch.zeros(1))
        self.calls = 0

    def forward(self, input_ids):
        self.calls += 1
        logits = torch.zeros(*input_ids.shape, len(self.tokenizer))
        for row, ids in enumerate(input_ids.tolist()):
            prompt = next(p for p in self.by_prompt if tuple(ids[: len(p)]) == p)
            emitted = len(ids) - len(prompt)
            script = self.by_prompt[prompt]
            logits[row, -1, script[emitted] if emitted < len(script) else self.tokenizer.pad_token_id] = 1.0
        return SimpleNamespace(logits=logits)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_evaluate_accuracy_on_a_scripted_model():
    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    rows = [
        Example("12+35=", "47"),   # right, then EOS
        Example("1+2=", "3"),      # right, then a newline and junk (cut at the newline)
        Example("52-17=", "35"),   # wrong digit
        Example("20+20=", "40"),   # right digits, but keeps writing without EOS
        Example("99*9=", "891"),   # right when 3 tokens are allowed, cut short with 2
        Example("7-7=", "0"),      # right as "00" (numeric comparison)
    ]
    scripts = {
        "12+35=": _ids(tok, "47") + [eos],
        "1+2=": _ids(tok, "3\n99"),
        "52-17=": _ids(tok, "36") + [eos],
        "20+20=": _ids(tok, "4000"),
        "99*9=": _ids(tok, "891") + [eos],
        "7-7=": _ids(tok, "00") + [eos, *_ids(tok, "5")],
    }
    model = ScriptedLM(tok, scripts)
    answers = greedy_answers(model, tok, [r.text for r in rows], max_new_tokens=3, batch_size=2)
    assert answers == ["47", "3", "36", "400", "891", "00"]
    assert evaluate_accuracy(model, tok, rows, max_new_tokens=3, batch_size=2) == pytest.approx(4 / 6)
    assert greedy_answers(model, tok, [r.text for r in rows], max_new_tokens=2) == ["47", "3", "36", "40", "89", "00"]
    assert evaluate_accuracy(model, tok, rows, max_new_tokens=2, batch_size=64) == pytest.approx(4 / 6)


def test_evaluation_stops_decoding_once_every_row_has_ended():
    tok = build_char_tokenizer()
    model = ScriptedLM(tok, {"1+1=": _ids(tok, "2") + [tok.eos_token_id]})
    assert evaluate_accuracy(model, tok, [Example("1+1=", "2")] * 3, max_new_tokens=8) == 1.0
    assert model.calls == 2  # "2", then EOS; no further steps
    assert model.training  # the caller's mode is restored


def test_evaluate_accuracy_rejects_bad_arguments():
    tok = build_char_tokenizer()
    model = ScriptedLM(tok, {})
    with pytest.raises(ValueError, match="at least one row"):
        evaluate_accuracy(model, tok, [])
    with pytest.raises(ValueError, match="must be > 0"):
        evaluate_accuracy(model, tok, [Example("1+1=", "2")], max_new_tokens=0)


def _random_peft_adapter(base_dir, out_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    # Non-zero B so the adapter changes the model's answers.
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=32, target_modules=targets, init_lora_weights=False))
    peft_model.save_pretrained(out_dir)
    return peft_model


def test_page_table_slot_answers_like_peft_and_slot_minus_one_like_the_base(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.lora import inject_multi_lora, load_peft_adapter

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [r.text for r in split_task("add").test[:24]] + [r.text for r in split_task("mul").test[:8]]
    peft_model = _random_peft_adapter(tiny_model_dir, tmp_path / "adapter")
    peft_answers = greedy_answers(peft_model, tok, prompts, max_new_tokens=4)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_answers = greedy_answers(base, tok, prompts, max_new_tokens=4)
    assert peft_answers != base_answers

    inject_multi_lora(base, n_slots=2, max_rank=8, target_modules="all-linear")
    load_peft_adapter(base, 1, tmp_path / "adapter")
    assert greedy_answers(base, tok, prompts, max_new_tokens=4, slot=1) == peft_answers
    assert greedy_answers(base, tok, prompts, max_new_tokens=4, slot=-1) == base_answers


def test_evaluate_adapter_dir_matches_in_memory_evaluation(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    peft_model = _random_peft_adapter(tiny_model_dir, tmp_path / "adapter")
    answers = greedy_answers(peft_model, tok, [r.text for r in split_task("add").test[:40]], max_new_tokens=8)
    # Label half the rows with what the adapter answers, so the expected accuracy is known.
    prompts = split_task("add").test[:40]
    rows = [Example(r.text, a if i % 2 == 0 and a.strip() else "-1") for i, (r, a) in enumerate(zip(prompts, answers))]
    expected = sum(answer_is_correct(a, r.label) for a, r in zip(answers, rows)) / len(rows)
    assert expected > 0
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(r.to_json() + "\n" for r in rows))
    assert evaluate_adapter_dir(tiny_model_dir, tmp_path / "adapter", data, n=None) == pytest.approx(expected)
    assert evaluate_adapter_dir(tiny_model_dir, tmp_path / "adapter", data, n=10) == pytest.approx(
        sum(answer_is_correct(a, r.label) for a, r in zip(answers[:10], rows[:10])) / 10
    )


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [("492", "492", 1.0), ("482", "492", 2 / 3), ("92", "492", 2 / 3), ("4920", "492", 0.0),
     ("492\n17", "492", 1.0), ("", "492", 0.0), ("1492", "492", 0.75)],
)
def test_digit_match_reward_gives_partial_credit_per_place(response, label, reward):
    from miles.rollout.rewards.registry import load_custom_reward
    from miles.utils.types import Sample

    fn = load_custom_reward("miles.recipes.tasks.digit_match_reward")
    assert fn(None, Sample("mul", 0, 0, 0, "123*4=", label, {}, [], response=response)) == pytest.approx(reward)
