"""Multiple-choice reward with Miles' `gpqa` semantics.

The correct option comes from `metadata["correct_letter"]`, else a one-letter label, else
an integer label (0 -> "A"), else the choice (`metadata["choices"]`) whose text equals the
label. The chosen option is read from the response after any `</think>`: "answer is C",
"option: C", "C is correct", "final answer: C", else the last standalone valid capital
letter. Valid letters: `metadata["valid_letters"]`, else one per choice, else A-H. When no
letter can be compared, the response scores 1.0 if it contains the correct option's text
(or `correct_answer` / `answer_text` from the metadata, or the label).

    >>> from miles.utils.types import Sample
    >>> gpqa_reward(None, Sample("a", 0, 0, 0, "q", "C", {}, [], response="The answer is C."))
    1.0
"""

from __future__ import annotations

import re
import string
from typing import Any

from miles.utils.types import Sample

DEFAULT_LETTERS = tuple(string.ascii_uppercase[:8])
_LETTER_PATTERNS = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
    re.compile(r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
)
_STANDALONE_LETTER = re.compile(r"\b([A-Z])\b")


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def _plain(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def chosen_letter(response: str, valid: tuple[str, ...]) -> str | None:
    """The option letter the response commits to, or None."""
    text = _after_thinking(response)
    for pattern in _LETTER_PATTERNS:
        match = pattern.search(text)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(_STANDALONE_LETTER.findall(text)):
        if letter in valid:
            return letter
    return None


def gpqa_reward(args: Any, sample: Sample) -> float:
    """1.0 when the response picks the correct option (see the module docstring)."""
    response, label, metadata = sample.response, sample.label, sample.metadata or {}
    if not response:
        return 0.0
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        choices = list(choices.values())
    elif choices is not None:
        choices = list(choices)
    if metadata.get("valid_letters"):
        valid = tuple(str(letter).upper() for letter in metadata["valid_letters"])
    elif choices:
        valid = tuple(string.ascii_uppercase[: len(choices)])
    else:
        valid = DEFAULT_LETTERS

    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in valid and not correct:
            correct = label_text.upper()
    elif isinstance(label, (int, float)) and 0 <= int(label) < len(valid):
        correct = valid[int(label)]
    answer_text = metadata.get("correct_answer")
    if not correct and choices and label_text:
        for i, choice in enumerate(choices):
            if _plain(str(choice)) == _plain(label_text):
                correct, answer_text = valid[i], answer_text or choice
                break

    picked = chosen_letter(response, valid)
    if picked and correct:
        return float(picked == correct)

    targets = []
    if correct and choices and correct in valid and valid.index(correct) < len(choices):
        targets.append(str(choices[valid.index(correct)]))
    targets += [str(v) for v in (answer_text, metadata.get("answer_text")) if v]
    if label_text:
        targets.append(label_text)
    plain_response = _plain(_after_thinking(response))
    if any(_plain(t) and _plain(t) in plain_response for t in targets):
        return 1.0
    if picked and not correct and label_text:
        return float(picked == label_text.upper())
    return 0.0
