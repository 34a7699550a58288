"""Math rewards with Miles' names and semantics: `math`, `deepscaler`, `gemma_math`, `dapo`.

- `math`: the last `\\boxed{...}` of the response is the answer (none: 0); a label with a
  `\\boxed{}` is reduced to its content; 1.0 when the two are equivalent (`math-verify`).
- `deepscaler`: the same check on the text after the last `</think>` (or after the first
  `###Response`); a response with neither scores 0 (DeepScaleR's rule).
- `gemma_math`: the same check on the text after the last `<channel|>` (whole response
  when absent).
- `dapo`: the Minerva check of DAPO: the last `Answer: ...` line within the final 300
  characters, normalized, against the integer label; returns
  `{"score": 1.0 | -1.0, "acc": bool, "pred": str}` (select the reward with
  `--reward-key score`).

    >>> from miles.utils.types import Sample
    >>> s = Sample("a", 0, 0, 0, "q", "\\\\frac{1}{2}", {}, [], response="so \\\\boxed{0.5}")
    >>> math_reward(None, s)
    1.0
"""

from __future__ import annotations

import re
from typing import Any

from miles.rollout.rewards.answers import extract_boxed
from miles.rollout.rewards.equivalence import answers_equivalent
from miles.utils.types import Sample

DAPO_TAIL_CHARS = 300
"""DAPO grades only the end of a response (the longest MATH-500 answer is 159 characters)."""
_DAPO_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def boxed_answer_matches(solution: str, label: Any) -> float:
    """1.0 when the last boxed answer of `solution` is equivalent to `label` (boxed or bare)."""
    if label is None or str(label) == "":
        return 0.0
    truth = str(label)
    if "\\boxed" in truth:
        boxed = extract_boxed(truth)
        if boxed is None:
            return 0.0
        truth = boxed
    answer = extract_boxed(solution)
    if answer is None:
        return 0.0
    return float(answers_equivalent(answer, truth))


def math_reward(args: Any, sample: Sample) -> float:
    """Miles' `math`: the last `\\boxed{}` answer is equivalent to the label."""
    return boxed_answer_matches(sample.response, sample.label)


def deepscaler_reward(args: Any, sample: Sample) -> float:
    """Miles' `deepscaler`: the boxed answer after the reasoning (`</think>` or `###Response`)."""
    response = sample.response
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    return boxed_answer_matches(solution, sample.label)


def gemma_math_reward(args: Any, sample: Sample) -> float:
    """Miles' `gemma_math`: the boxed answer after the last `<channel|>`."""
    return boxed_answer_matches(sample.response.split("<channel|>")[-1], sample.label)


# Minerva's answer normalization (Lewkowycz et al. 2022, appendix D), as DAPO uses it.
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>",
)
_UNWRAP = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def minerva_normalize(answer: str) -> str:
    """The right-hand side of the last `=`, without units, TeX wrappers and thousands commas."""
    text = str(answer).split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for removed in _REMOVED:
        text = text.replace(removed, "")
    for pattern, replacement in _UNWRAP:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def _integer_label(label: str) -> str:
    normalized = minerva_normalize(label)
    try:
        return str(int(float(normalized)))
    except ValueError:
        # DAPO's labels are integers; another label is compared as normalized text
        return normalized


def dapo_reward(args: Any, sample: Sample) -> dict[str, Any]:
    """Miles' `dapo`: `{"score": 1.0 or -1.0, "acc": bool, "pred": str}`."""
    tail = sample.response[-DAPO_TAIL_CHARS:]
    matches = _DAPO_ANSWER_RE.findall(tail)
    pred = minerva_normalize(matches[-1] if matches else "[INVALID]")
    correct = sample.label is not None and pred == _integer_label(str(sample.label))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
