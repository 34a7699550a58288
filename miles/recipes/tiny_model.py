"""Tiny random causal LMs with a character-level tokenizer, made locally in seconds.

Tests and demos need a real Hugging Face model directory without downloading one:

    python -m miles.recipes.tiny_model --out /tmp/tiny --arch llama --seed 0

writes a two-layer Llama (or Qwen2) with random weights and its own tokenizer via
`save_pretrained`; `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`
load it offline. The same seed gives the same weights.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
DEFAULT_CHARS = string.digits + "+-*=/ " + string.ascii_letters + ".,:;!?()[]{}'\"_%#<>@&|^~$\\`\n"

# Renders "role: content" lines; the generation prompt opens the assistant's line.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

Arch = Literal["llama", "qwen2"]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest shift."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return mapping


def build_char_tokenizer(chars: str | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer with one id per character and the special tokens `<pad> <s> </s> <unk>`.

    Ids 0-3 are the special tokens, then the (ASCII) characters in the given order.
    No special token is added by `encode`. The vocabulary is spelled in the byte-level
    alphabet with a merge-free BPE, so the tokenizer gives the same ids whether it is
    reloaded as itself or, as transformers does for Qwen2 configs, as a byte-level
    BPE tokenizer.
    """
    chars = DEFAULT_CHARS if chars is None else chars
    non_ascii = sorted({ch for ch in chars if ord(ch) > 127})
    if non_ascii:
        raise ValueError(f"character tokenizer takes ASCII characters only, got {non_ascii}")
    alphabet = _byte_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(alphabet[ord(ch)], len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(
    arch: Arch,
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
) -> LlamaConfig | Qwen2Config:
    """The model config of a tiny `arch` model sized for `tokenizer`."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown arch {arch!r}: use 'llama' or 'qwen2'")


def write_tiny_model(
    out: str | Path,
    *,
    arch: Arch = "llama",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    chars: str | None = None,
) -> Path:
    """Write a tiny random `arch` causal LM and its tokenizer to `out`; return `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(chars)
    config = tiny_config(
        arch,
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
    )
    # Seed a private RNG stream so making a model leaves the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="Directory to write the model to.")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args(argv)
    path = write_tiny_model(
        args.out, arch=args.arch, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers
    )
    print(path)


if __name__ == "__main__":
    main()
