"""A two-turn calculator-tool task: the model asks the tool, reads its output, answers.

A worked example of a custom generate function (`miles.rollout.generate`) on the tiny
base's character vocabulary. A conversation is one sample:

    prompt      "47*36="
    model       "<calc>47*36</calc>"          loss mask 1 (the model's tokens)
    tool        "<result>1692</result>"        loss mask 0 (environment output)
    model       "1692\\n"                       loss mask 1

The model turn that asks stops on the stop string `</calc>`; the tool evaluates
`a op b` (`+`, `-`, `*` of integers) and answers `<result>…</result>` (or
`<result>error</result>`); the second model turn writes the answer. A model that
answers without asking ends the conversation after one turn. The reward is 1.0 when
the number written after the tool's output (or the whole response without a call)
equals the label.

    python -m miles.main.train_multi_lora_async ... \\
        --custom-generate-function-path miles.recipes.calculator_tool.generate \\
        --custom-rm-path miles.recipes.calculator_tool.reward
    # or per adapter, in its YAML:
    #   custom_generate_function_path: miles.recipes.calculator_tool.generate
    #   custom_rm_path: miles.recipes.calculator_tool.reward

    python -m miles.recipes.calculator_tool --out data/calc_train.jsonl --n 2000 [--split test]

writes `{"text": "47*36=", "label": "1692"}` rows (two-digit products, which the tiny
base cannot do in its head; `split_rows` holds 500 of the 8,100 out for testing).

The tiny base never writes `<calc>` by itself (it was pretrained to write digits after
`=`), so an adapter starts with a short supervised warm start on this format and then
learns with RL; `scripts/calculator_check.py` does both in one process and prints the
held-out success rate (`solved`: the tool asked the problem's expression and the final
answer is right) before and after RL.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from typing import Any

from miles.rollout.generate import FINISH_STATUS, GenerateFnInput
from miles.rollout.rewards.answers import extract_final_number, numbers_equal, parse_number
from miles.utils.types import Sample, SampleStatus

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_TOOL_CALLS = 1
"""Tool calls per conversation: two model turns at most."""
_EXPRESSION = re.compile(r"^\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*$")


def calculator(expression: str) -> str:
    """The tool: `a op b` of integers, else "error".

    >>> calculator("47*36"), calculator("12 - 30"), calculator("2**99")
    ('1692', '-18', 'error')
    """
    match = _EXPRESSION.match(expression)
    if match is None:
        return "error"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def tool_call(text: str) -> str | None:
    """The expression of a turn that ends with `<calc>…</calc>`, else None."""
    if not text.endswith(CALL_CLOSE) or CALL_OPEN not in text:
        return None
    return text[text.rindex(CALL_OPEN) + len(CALL_OPEN) : -len(CALL_CLOSE)]


async def generate(input: GenerateFnInput) -> Sample:
    """Model turn, tool output (masked out), model turn; stops at the first aborted turn."""
    sample, engine, tokenizer = input.sample, input.engine, input.tokenizer
    stops = input.sampling_params.get("stop") or []
    params = {**input.sampling_params, "stop": [*([stops] if isinstance(stops, str) else stops), CALL_CLOSE]}
    response_ids: list[int] = []
    loss_mask: list[int] = []
    log_probs: list[float] = []
    for turn in range(MAX_TOOL_CALLS + 1):
        out = await engine.generate(sample.prompt_ids + response_ids, params)
        status = FINISH_STATUS[out.meta_info.finish_reason.type]
        if status is SampleStatus.ABORTED:
            sample.status = SampleStatus.ABORTED
            return sample
        # The ids include a matched stop string (as SGLang's do); the text does not.
        response_ids += out.output_ids
        loss_mask += [1] * len(out.output_ids)
        log_probs += [float(lp) for lp, _, _ in (out.meta_info.output_token_logprobs or [])][: len(out.output_ids)]
        log_probs += [0.0] * (len(loss_mask) - len(log_probs))
        sample.status = status
        expression = tool_call(tokenizer.decode(out.output_ids))
        if expression is None or turn == MAX_TOOL_CALLS or status is not SampleStatus.COMPLETED:
            break
        observation = tokenizer.encode(f"{RESULT_OPEN}{calculator(expression)}{RESULT_CLOSE}",
                                       add_special_tokens=False)
        response_ids += observation
        loss_mask += [0] * len(observation)
        log_probs += [0.0] * len(observation)
    sample.tokens = sample.prompt_ids + response_ids
    sample.response_length = len(response_ids)
    sample.response = tokenizer.decode(response_ids, skip_special_tokens=True)
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = log_probs
    return sample


def final_answer(response: str) -> str:
    """The part of a response after the tool's output (all of it when there was no call)."""
    return response.rsplit(RESULT_CLOSE, 1)[-1]


def reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """1.0 when the number after the tool's output equals the label.

    >>> s = Sample("calc", 0, 0, 0, "47*36=", "1692", {}, [], response="<calc>47*36</calc><result>1692</result>1692")
    >>> reward(None, s), reward(None, Sample("calc", 0, 0, 0, "47*36=", "1692", {}, [], response="<calc>47*36</calc>"))
    (1.0, 0.0)
    """
    if sample.label is None:
        return 0.0
    answer = extract_final_number(final_answer(sample.response))
    return 1.0 if numbers_equal(answer, parse_number(sample.label)) else 0.0


def solved(sample: Sample) -> bool:
    """The tool was asked the problem's own expression and the final answer is right.

    >>> s = Sample("calc", 0, 0, 0, "47*36=", "1692", {}, [], response="<calc>47*36</calc><result>1692</result>1692")
    >>> solved(s), solved(Sample("calc", 0, 0, 0, "47*36=", "1692", {}, [], response="1692"))
    (True, False)
    """
    head = sample.response.split(RESULT_OPEN, 1)[0]
    return tool_call(head) == sample.prompt.rstrip("=") and reward(None, sample) == 1.0


TEST_ROWS = 500


def split_rows(seed: int = 0) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """All two-digit products, shuffled with `seed`: (train, test), the first TEST_ROWS held out."""
    rows = [{"text": f"{a}*{b}=", "label": str(a * b)} for a in range(10, 100) for b in range(10, 100)]
    random.Random(f"calc:{seed}").shuffle(rows)
    return rows[TEST_ROWS:], rows[:TEST_ROWS]


def make_rows(n: int, seed: int = 0, split: str = "train") -> list[dict[str, str]]:
    """The first n rows of a split of `split_rows(seed)`."""
    train, test = split_rows(seed)
    return (train if split == "train" else test)[:n]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a calculator-tool dataset (jsonl).")
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=("train", "test"), default="train")
    args = parser.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = make_rows(args.n, args.seed, args.split)
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
