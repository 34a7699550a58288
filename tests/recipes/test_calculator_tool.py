"""The calculator-tool adapter learns on the tiny base: warm start, then GRPO through the
recipe's own generate function, loss mask and reward (scripts/calculator_check.py)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from miles.recipes import calculator_tool as calc
from miles.recipes.tiny_base import ensure_tiny_base

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / ".cache" / "tiny_base"


def _check_module():
    spec = importlib.util.spec_from_file_location("calculator_check", ROOT / "scripts" / "calculator_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_splits_are_disjoint_and_cover_every_product():
    train, test = calc.split_rows(0)
    assert len(test) == calc.TEST_ROWS and len(train) + len(test) == 90 * 90
    assert not {r["text"] for r in train} & {r["text"] for r in test}
    assert all(r["label"] == calc.calculator(r["text"].rstrip("=")) for r in test)


def test_warm_start_trains_only_the_model_turns():
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_base(BASE))
    ids_BL, mask_BT = _check_module().warm_start_batch(tokenizer, [{"text": "47*36=", "label": "1692"}])
    targets = tokenizer.convert_ids_to_tokens(ids_BL[0, 1:].tolist())
    trained = "".join(t for t, m in zip(targets, mask_BT[0].tolist()) if m).replace("</s>", "$")
    assert trained == "<calc>47*36</calc>1692$"


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_rl_raises_the_held_out_success_rate_over_the_warm_start():
    torch.set_num_threads(1)
    args = argparse.Namespace(base=str(BASE), seed=0, warm_steps=100, warm_until=0.25, warm_check_every=1,
                              warm_max_steps=400, probe_rows=48, warm_lr=2e-3, batch_size=32, rl_steps=60,
                              rl_lr=3e-4, temperature=0.3, prompts=8, n=8, eval_rows=200)
    result = await _check_module().run(args)
    assert result["fresh"] == 0.0  # the base never writes a tool call by itself
    assert 0.1 < result["warm"] < 0.8  # a warm start that leaves room to learn (the probe stops it at 0.25)
    # The warm start is probed after every step: the tool format is learnt within a few steps,
    # and probed every 5 one CPU's base build overshot to 0.755 with no room left (RL: 0.605).
    # measured: 0.535 -> 0.730 (150 warm-start steps, one base build); 0.280 -> 0.465 (another);
    # warm 0.430 after 156 steps, probed every step (the build that overshot)
    assert result["rl"] >= result["warm"] + 0.10
