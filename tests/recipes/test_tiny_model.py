"""Tiny random models and the character tokenizer: offline, deterministic, loadable.

    .venv/bin/pytest -q tests/utils/test_tiny_model.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.recipes.tiny_model import build_char_tokenizer, write_tiny_model

TEXT = "Q: 12+3*4 = ?\nA: (16) ok, done!"


def test_char_tokenizer_one_id_per_char_and_round_trip(tmp_path):
    tokenizer = build_char_tokenizer()
    ids = tokenizer.encode("12+3=")
    assert len(ids) == 5 and len(set(ids[:2])) == 2 and min(ids) >= 4
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    special_tokens = [tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token]
    assert special_tokens == ["<pad>", "<s>", "</s>", "<unk>"]
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<s>", "</s>", "<unk>"]) == [0, 1, 2, 3]
    assert tokenizer.encode("</s>") == [tokenizer.eos_token_id]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "user: 1+1\nassistant: "
    with pytest.raises(ValueError, match="ASCII"):
        build_char_tokenizer("abcé")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_loads_offline_with_its_tokenizer(tmp_path, arch, tiny_model_dir, tiny_qwen2_dir):
    path = tiny_model_dir if arch == "llama" else tiny_qwen2_dir
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch and model.config.vocab_size == len(tokenizer)
    ids = tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT) and tokenizer.decode(ids) == TEXT
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits
    assert out.shape == (1, len(TEXT), len(tokenizer)) and torch.isfinite(out).all()
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_same_seed_same_weights(tmp_path):
    write_tiny_model(tmp_path / "a", seed=7)
    write_tiny_model(tmp_path / "b", seed=7)
    write_tiny_model(tmp_path / "c", seed=8)
    a, b, c = (load_file(str(tmp_path / n / "model.safetensors")) for n in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_cli_writes_a_model(tmp_path):
    out = tmp_path / "cli"
    subprocess.run([sys.executable, "-m", "miles.recipes.tiny_model", "--out", str(out), "--arch", "qwen2",
                    "--seed", "3"], check=True, capture_output=True)
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
