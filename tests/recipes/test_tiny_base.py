"""The tiny base: deterministic builds, the recipe-keyed cache, its outputs, and (slow)
the real cached base's partial accuracy on every task."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from miles.recipes import tiny_base
from miles.recipes.tasks import Example, read_examples, split_task
from miles.recipes.tiny_base import (
    TinyBaseRecipe,
    ensure_tiny_base,
    is_built,
    read_base_accuracy,
)
from miles.recipes.tiny_model import build_char_tokenizer

# Seconds to build: one small layer, a fixed few steps (no target), a few scored rows.
SMALL = TinyBaseRecipe(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, target_accuracy=None,
                       max_steps=12, batch_size=32, warmup_steps=4, eval_rows=20)


def llama_parameters(recipe: TinyBaseRecipe, vocab: int) -> int:
    """A Llama's parameter count from its shape, by hand: embeddings and an untied LM head,
    per layer q/k/v/o (as many KV heads as heads), gate/up/down and two RMSNorms, a final norm."""
    h, f = recipe.hidden_size, recipe.intermediate_size
    return 2 * vocab * h + recipe.num_layers * (4 * h * h + 3 * h * f + 2 * h) + h


@torch.no_grad()
def greedy_accuracy_by_hand(model_dir, rows: list[Example], max_new_tokens: int = 8) -> float:
    """Greedy accuracy computed without `miles.recipes.tasks`: one row at a time, argmax
    tokens until EOS, the text before a newline read as an integer and compared with the label."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    correct = 0
    for row in rows:
        ids = tokenizer(row.text, add_special_tokens=False)["input_ids"]
        new: list[int] = []
        while len(new) < max_new_tokens:
            token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
        answer = tokenizer.decode(new, skip_special_tokens=True).split("\n", 1)[0].strip()
        correct += answer.removeprefix("-").isdigit() and int(answer) == int(row.label)
    return correct / len(rows)


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    return ensure_tiny_base(tmp_path_factory.mktemp("small") / "base", SMALL)


def test_same_recipe_gives_identical_weights(small_build, tmp_path):
    again = ensure_tiny_base(tmp_path / "again", SMALL)
    first, second = load_file(small_build / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert read_base_accuracy(small_build) == read_base_accuracy(again)
    # ... and training moved them: a different seed gives different weights.
    other = ensure_tiny_base(tmp_path / "other", dataclasses.replace(SMALL, seed=1))
    assert not torch.equal(load_file(other / "model.safetensors")["lm_head.weight"], first["lm_head.weight"])


def test_cache_is_reused_and_rebuilt_only_when_the_recipe_changes(small_build, monkeypatch):
    builds = []
    real_build = tiny_base.build_tiny_base
    monkeypatch.setattr(tiny_base, "build_tiny_base",
                        lambda out, recipe, **kw: builds.append(recipe) or real_build(out, recipe, **kw))
    stamp = (small_build / "recipe.json").stat().st_mtime_ns

    assert ensure_tiny_base(small_build, SMALL) == small_build
    assert builds == [] and (small_build / "recipe.json").stat().st_mtime_ns == stamp

    changed = dataclasses.replace(SMALL, max_steps=SMALL.max_steps + 1)
    assert not is_built(small_build, changed)
    ensure_tiny_base(small_build, changed)
    assert builds == [changed] and is_built(small_build, changed) and not is_built(small_build, SMALL)
    ensure_tiny_base(small_build, changed, force=True)
    assert len(builds) == 2
    ensure_tiny_base(small_build, SMALL)  # leave the module's build as it was
    assert len(builds) == 3


def test_a_directory_that_is_not_a_build_is_never_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a tiny base build"):
        ensure_tiny_base(tmp_path, SMALL)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_a_build_is_an_offline_hf_model_with_its_tokenizer_and_datasets(small_build):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(small_build, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(small_build, local_files_only=True)
    assert model.config.hidden_size == SMALL.hidden_size and model.config.num_hidden_layers == SMALL.num_layers
    assert tokenizer("12+35=", add_special_tokens=False)["input_ids"] == build_char_tokenizer()("12+35=")["input_ids"]
    assert model.config.eos_token_id == tokenizer.eos_token_id
    for name in SMALL.tasks:
        split = split_task(name, SMALL.data_seed)
        assert read_examples(small_build / "data" / f"{name}_train.jsonl") == split.train
        assert read_examples(small_build / "data" / f"{name}_test.jsonl") == split.test
    record = json.loads((small_build / "recipe.json").read_text())
    assert record["fingerprint"] == SMALL.fingerprint()
    assert record["parameters"] == llama_parameters(SMALL, len(tokenizer))
    # The recorded accuracy is the saved model's on the saved test split's first eval_rows.
    accuracy = read_base_accuracy(small_build)
    assert set(accuracy) == set(SMALL.tasks)
    for name in SMALL.tasks:
        rows = read_examples(small_build / "data" / f"{name}_test.jsonl")[: SMALL.eval_rows]
        assert accuracy[name] == pytest.approx(greedy_accuracy_by_hand(small_build, rows), abs=1e-4), name


def test_pretraining_scores_only_the_answer_and_eos():
    tok = build_char_tokenizer()
    rows = [Example("1+2=", "3"), Example("12+35=", "47")]
    ids, labels = tiny_base._encode_examples(tok, rows)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids.tolist() == [enc("1+2=3") + [eos, pad, pad, pad], enc("12+35=47") + [eos]]
    assert labels.tolist() == [[-100] * 4 + enc("3") + [eos] + [-100] * 3, [-100] * 6 + enc("47") + [eos]]


def test_bad_recipes_say_what_to_fix():
    with pytest.raises(ValueError, match="one weight per task"):
        TinyBaseRecipe(tasks=("add", "sub"), task_weights=(1.0,))
    with pytest.raises(ValueError, match="must all be > 0"):
        TinyBaseRecipe(max_steps=0)
    with pytest.raises(ValueError, match="target_accuracy must be in"):
        TinyBaseRecipe(target_accuracy=1.5)


def test_a_skill_is_drawn_by_its_distance_below_the_target_and_never_dropped():
    recipe = TinyBaseRecipe(tasks=("add", "sub", "mul"), task_weights=(1.0, 2.0, 1.0), target_accuracy=0.4,
                            floor_weight=0.1)
    weights = tiny_base._mixture(recipe, {"add": 0.0, "sub": 0.2, "mul": 0.9})
    assert weights == pytest.approx([1.0, 2.0 * 0.5, 1.0 * 0.1])
    assert tiny_base._mixture(dataclasses.replace(recipe, target_accuracy=None), {}) == [1.0, 2.0, 1.0]


def test_a_target_out_of_reach_fails_the_build_naming_the_skills(tmp_path):
    unreachable = dataclasses.replace(SMALL, target_accuracy=0.9, max_steps=3, probe_rows=8)
    with pytest.raises(tiny_base.BaseNotReachedError, match=r"\['add', 'mul', 'sub'\] are below the target"):
        ensure_tiny_base(tmp_path / "base", unreachable)
    assert not is_built(tmp_path / "base", unreachable)


@pytest.mark.slow
def test_the_cached_base_is_partially_accurate_on_every_task(tiny_base_dir):
    accuracy = read_base_accuracy(tiny_base_dir)
    assert is_built(tiny_base_dir, TinyBaseRecipe())
    assert set(accuracy) == set(TinyBaseRecipe().tasks)
    low, high = tiny_base.ACCURACY_BAND
    for name, value in accuracy.items():
        assert low <= value <= high, f"{name}: base accuracy {value} is outside the recipe's band {low}-{high}"
    # The recorded number is the saved model's greedy accuracy on the saved test split, counted
    # here by hand (4.7 s for the 500 rows of one task).
    rows = read_examples(tiny_base_dir / "data" / "add_test.jsonl")
    assert greedy_accuracy_by_hand(tiny_base_dir, rows) == pytest.approx(accuracy["add"], abs=1e-4)
    record = json.loads((tiny_base_dir / "recipe.json").read_text())
    assert record["parameters"] == llama_parameters(TinyBaseRecipe(), len(build_char_tokenizer()))
