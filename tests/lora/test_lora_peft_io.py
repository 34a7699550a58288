"""PEFT directories in and out of slots: PEFT loads what we export, slots load what PEFT saves.

    .venv/bin/pytest -q tests/lora/test_lora_peft_io.py
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from miles.lora import (
    export_peft_adapter,
    get_slot_weights,
    init_slot,
    inject_multi_lora,
    load_peft_adapter,
    lora_modules,
    read_peft_dir,
    use_slots,
    write_peft_dir,
)
from miles.lora.peft_io import check_peft_config

ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base_model(request, tiny_model_dir, tiny_qwen2_dir):
    path = tiny_model_dir if request.param == "llama" else tiny_qwen2_dir
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def trained_looking_slot(model, slot: int, *, rank: int, alpha: float, seed: int) -> None:
    """A slot whose B is nonzero, as after training (a fresh B = 0 adapter is the base)."""
    gen = torch.Generator().manual_seed(seed)
    init_slot(model, slot, rank=rank, alpha=alpha, generator=gen)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B[slot, :, :rank].copy_(torch.randn(module.out_features, rank, generator=gen) * 0.1)


def test_exported_slot_loads_in_peft(base_model, tmp_path):
    model = copy.deepcopy(base_model)
    inject_multi_lora(model, n_slots=3, max_rank=8,
                      target_modules="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    trained_looking_slot(model, 1, rank=6, alpha=12.0, seed=3)
    trained_looking_slot(model, 2, rank=8, alpha=4.0, seed=4)
    out = export_peft_adapter(model, 1, tmp_path / "adapter", rank=6, alpha=12.0, target_modules="all-linear")
    config = json.loads((out / "adapter_config.json").read_text())
    assert ((config["r"], config["lora_alpha"], config["peft_type"], config["task_type"])
            == (6, 12.0, "LORA", "CAUSAL_LM"))
    tensors, _ = read_peft_dir(out)
    assert {t.shape[0] for k, t in tensors.items() if "lora_A" in k} == {6}

    peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model), out).eval()
    ids = torch.randint(4, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), use_slots(model, [1, 1]):
        ours = model(ids).logits
    with torch.no_grad():
        theirs = peft_model(ids).logits
        base = base_model(ids).logits
    assert (theirs - base).abs().max() > 1e-2
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_peft_saved_adapter_loads_into_slot(base_model, tmp_path):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        copy.deepcopy(base_model), LoraConfig(r=4, lora_alpha=7.0, target_modules=["q_proj", "v_proj", "down_proj"])
    ).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(tmp_path / "made_by_peft")

    model = copy.deepcopy(base_model)
    inject_multi_lora(model, n_slots=2, max_rank=8, target_modules="all-linear")
    assert load_peft_adapter(model, 1, tmp_path / "made_by_peft") == (4, 7.0)
    ids = torch.randint(4, 90, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), use_slots(model, [1, 1, 1]):
        ours = model(ids).logits
    with torch.no_grad():
        theirs = peft_model(ids).logits
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    # Layers the adapter does not target add nothing in that slot.
    for name, module in lora_modules(model).items():
        if name.endswith(("k_proj", "o_proj", "gate_proj", "up_proj")):
            assert module.lora_A[1].abs().sum() == 0 and module.lora_B[1].abs().sum() == 0


def test_load_rejects_what_does_not_fit(base_model, tmp_path):
    source = copy.deepcopy(base_model)
    inject_multi_lora(source, n_slots=1, max_rank=8, target_modules="all-linear")
    trained_looking_slot(source, 0, rank=8, alpha=8.0, seed=0)
    export_peft_adapter(source, 0, tmp_path / "r8")
    narrow = copy.deepcopy(base_model)
    inject_multi_lora(narrow, n_slots=1, max_rank=4, target_modules="all-linear")
    with pytest.raises(ValueError, match="exceeds the slot width"):
        load_peft_adapter(narrow, 0, tmp_path / "r8")
    attention_only = copy.deepcopy(base_model)
    inject_multi_lora(attention_only, n_slots=1, max_rank=8, target_modules="q_proj,v_proj")
    with pytest.raises(ValueError, match="not multi-LoRA layers"):
        load_peft_adapter(attention_only, 0, tmp_path / "r8")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_peft_adapter(attention_only, 0, tmp_path)


def test_write_replaces_directory_atomically(tmp_path):
    first = {"base_model.model.x.lora_A.weight": torch.ones(2, 3)}
    second = {"base_model.model.x.lora_A.weight": torch.zeros(1, 3)}
    write_peft_dir(tmp_path / "a", first, {"r": 2})
    write_peft_dir(tmp_path / "a", second, {"r": 1})
    tensors, config = read_peft_dir(tmp_path / "a")
    assert config == {"r": 1} and torch.equal(tensors["base_model.model.x.lora_A.weight"], torch.zeros(1, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary leftovers


def test_export_checks_rank_alpha_and_targets(base_model, tmp_path):
    model = copy.deepcopy(base_model)
    inject_multi_lora(model, n_slots=2, max_rank=8, target_modules="all-linear")
    trained_looking_slot(model, 0, rank=4, alpha=8.0, seed=1)
    with pytest.raises(ValueError, match="rank-4 adapter, not rank 5"):
        export_peft_adapter(model, 0, tmp_path / "x", rank=5)
    with pytest.raises(ValueError, match="alpha 8.0, not 9"):
        export_peft_adapter(model, 0, tmp_path / "x", alpha=9.0)
    with pytest.raises(ValueError, match="empty"):
        export_peft_adapter(model, 1, tmp_path / "x")
    out = export_peft_adapter(model, 0, tmp_path / "attn", target_modules=["q_proj", "v_proj"])
    tensors, config = read_peft_dir(out)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert len(tensors) == 2 * 2 * base_model.config.num_hidden_layers
    q_v_weights = ("q_proj.lora_A.weight", "q_proj.lora_B.weight", "v_proj.lora_A.weight", "v_proj.lora_B.weight")
    assert all(k.endswith(q_v_weights) for k in tensors)
    weights = get_slot_weights(model, 0)
    assert all(torch.equal(tensors[k], weights[k]) for k in tensors)
    # The exported subset loads back: the other layers of that slot are zero.
    load_peft_adapter(model, 1, out)
    for name, module in lora_modules(model).items():
        assert (module.lora_A[1].abs().sum() > 0) == name.endswith(("q_proj", "v_proj"))


def test_unsupported_peft_features_are_refused(base_model, tmp_path):
    model = copy.deepcopy(base_model)
    inject_multi_lora(model, n_slots=1, max_rank=8, target_modules="all-linear")
    trained_looking_slot(model, 0, rank=2, alpha=2.0, seed=0)
    out = export_peft_adapter(model, 0, tmp_path / "a")
    tensors, config = read_peft_dir(out)
    for key, value in (("use_dora", True), ("use_rslora", True), ("bias", "all"), ("peft_type", "IA3")):
        write_peft_dir(tmp_path / key, tensors, {**config, key: value})
        with pytest.raises(ValueError, match=str(tmp_path / key)):
            load_peft_adapter(model, 0, tmp_path / key)
    # A refused load leaves the slot as it was.
    assert all(torch.equal(v, tensors[k]) for k, v in get_slot_weights(model, 0).items())


def test_adapter_saved_by_peft_with_all_linear_loads_into_a_slot(tiny_model_dir, tmp_path):
    """PEFT's "all-linear" writes its own target list; such an adapter loads as is."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from miles.lora import inject_multi_lora, load_peft_adapter, use_slots

    torch.manual_seed(0)
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    )
    for name, param in reference.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    reference.save_pretrained(tmp_path / "peft_all_linear")

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    inject_multi_lora(model, n_slots=2, max_rank=4, target_modules="all-linear")
    assert load_peft_adapter(model, 1, tmp_path / "peft_all_linear") == (4, 8.0)
    ids = torch.tensor([[5, 9, 12, 7, 3]])
    with torch.no_grad(), use_slots(model, [1]):
        ours = model(ids).logits
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("config, message", [
    ({"peft_type": "PROMPT_TUNING", "r": 2, "lora_alpha": 4}, "only LORA adapters"),
    ({"use_dora": True, "r": 2, "lora_alpha": 4}, "DoRA is not supported"),
    ({"bias": "all", "r": 2, "lora_alpha": 4}, "bias='all' is not supported"),
    ({"target_modules": ["q_proj", "up_proj"], "r": 2, "lora_alpha": 4},
     r"targets \['up_proj'\] which are not multi-LoRA layers of this model "
     r"\(its LoRA layers: \['q_proj', 'v_proj'\]\)"),
    ({"target_modules": ["q_proj"]}, "lacks 'r' or 'lora_alpha'"),
    ({"target_modules": ["q_proj"], "r": 16, "lora_alpha": 4}, "adapter rank 16 exceeds the slot width max_rank=8"),
])
def test_one_validator_refuses_what_a_slot_cannot_hold(config, message):
    """Both backends load through `check_peft_config`: each error names the source and the fix."""
    def covers(target: str) -> bool:
        return target.rsplit(".", 1)[-1] in {"q_proj", "v_proj"}

    with pytest.raises(ValueError, match=f"^ckpt/step_1: .*{message}"):
        check_peft_config(config, "ckpt/step_1", covers=covers, lora_layers=["v_proj", "q_proj"], max_rank=8)
    fits = {"target_modules": ["model.layers.0.self_attn.q_proj", "v_proj"], "r": 8, "lora_alpha": 16}
    assert check_peft_config(fits, "ckpt/step_1", covers=covers, lora_layers=["q_proj"], max_rank=8) == (8, 16.0)
