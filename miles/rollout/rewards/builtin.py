"""Built-in reward functions, selected by `rm_type`.

Every reward has the signature of a user reward, `fn(args, sample) -> float`, where
`args` is the frozen `MilesConfig` and `sample` a `Sample` (its `response` and `label`
are what the built-ins read). Labels and answers are plain strings; a missing label
(`label_key: null`) or an answer that cannot be parsed scores 0.0, never an exception.

Miles' names keep Miles' meaning: `math`, `deepscaler`, `gemma_math`, `dapo`
(`math_rewards.py`), `gpqa` (`choice.py`), `f1`, `remote_rm` (`remote.py`), `random`,
`deterministic_random`. Ours besides: `final_number` (the boxed answer, else the final
number of the response, equals the label numerically), `boxed_math`, `exact`,
`boxed_exact`, `boxed_f1`.

    >>> from miles.utils.types import Sample
    >>> s = Sample("a", 0, 0, 0, "2*6=?", "12", {}, [], response="So it is 12.0")
    >>> final_number_reward(None, s), math_reward(None, s), exact_reward(None, s)
    (1.0, 0.0, 0.0)
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from miles.rollout.rewards.answers import (
    extract_boxed,
    extract_final_number,
    normalize_text,
    numbers_equal,
    parse_number,
)
from miles.rollout.rewards.choice import gpqa_reward
from miles.rollout.rewards.math_rewards import dapo_reward, deepscaler_reward, gemma_math_reward, math_reward
from miles.rollout.rewards.remote import remote_rm
from miles.utils.types import Sample

RewardFn = Callable[[Any, Sample], Any]
"""`fn(args, sample) -> float`, or a coroutine function returning a float."""


def _label(sample: Sample) -> str | None:
    return None if sample.label is None else str(sample.label)


def _label_number(label: str) -> float | None:
    """A label is a number, a boxed answer, or text ending in one ("#### 72")."""
    boxed = extract_boxed(label)
    if boxed is not None:
        return parse_number(boxed)
    exact = parse_number(label)
    return exact if exact is not None else extract_final_number(label)


def _math_match(answer: str | None, label: str | None) -> float:
    if answer is None or label is None:
        return 0.0
    expected = _label_number(label)
    if expected is None:
        return float(normalize_text(answer) == normalize_text(label))
    return float(numbers_equal(parse_number(answer), expected))


def final_number_reward(args: Any, sample: Sample) -> float:
    """1.0 when the boxed answer, else the final number of the response, equals the label."""
    response = sample.response
    answer = extract_boxed(response)
    if answer is None:
        number = extract_final_number(response)
        answer = None if number is None else repr(number)
    return _math_match(answer, _label(sample))


def boxed_math_reward(args: Any, sample: Sample) -> float:
    """Like `final_number`, but only a `\\boxed{}` answer counts."""
    return _math_match(extract_boxed(sample.response), _label(sample))


def exact_reward(args: Any, sample: Sample) -> float:
    """1.0 when the stripped response equals the stripped label."""
    label = _label(sample)
    return float(label is not None and sample.response.strip() == label.strip())


def boxed_exact_reward(args: Any, sample: Sample) -> float:
    """1.0 when the stripped `\\boxed{}` content equals the stripped label."""
    label, boxed = _label(sample), extract_boxed(sample.response)
    return float(label is not None and boxed is not None and boxed.strip() == label.strip())


_YES_NO = ("yes", "no", "noanswer")


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style token F1 after lower-casing and dropping punctuation and articles.

    As Miles (HotpotQA's rule): a yes / no / noanswer on either side scores 0 unless both
    sides are the same; no common token (an empty side included) scores 0.
    """
    norm_pred, norm_ref = normalize_text(prediction), normalize_text(reference)
    if (norm_pred in _YES_NO or norm_ref in _YES_NO) and norm_pred != norm_ref:
        return 0.0
    pred, ref = norm_pred.split(), norm_ref.split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1_reward(args: Any, sample: Sample) -> float:
    """Token F1 between the response and the label."""
    label = _label(sample)
    return 0.0 if label is None else token_f1(sample.response, label)


def boxed_f1_reward(args: Any, sample: Sample) -> float:
    """Token F1 between the `\\boxed{}` content and the label."""
    label, boxed = _label(sample), extract_boxed(sample.response)
    return 0.0 if label is None or boxed is None else token_f1(boxed, label)


def random_reward(args: Any, sample: Sample) -> float:
    """0.0 or 1.0 at random (a baseline that learns nothing)."""
    return float(random.randint(0, 1))


def deterministic_random_reward(args: Any, sample: Sample) -> float:
    """0.0 or 1.0 from a hash of prompt and response: random-looking but repeatable."""
    digest = hashlib.sha256(f"{sample.prompt}\x00{sample.response}".encode()).digest()
    return float(digest[0] & 1)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "deepscaler": deepscaler_reward,
    "gemma_math": gemma_math_reward,
    "dapo": dapo_reward,
    "gpqa": gpqa_reward,
    "remote_rm": remote_rm,
    "final_number": final_number_reward,
    "boxed_math": boxed_math_reward,
    "exact": exact_reward,
    "boxed_exact": boxed_exact_reward,
    "f1": f1_reward,
    "boxed_f1": boxed_f1_reward,
    "random": random_reward,
    "deterministic_random": deterministic_random_reward,
}

THREADED_BUILTINS = frozenset({math_reward, deepscaler_reward, gemma_math_reward})
"""Built-ins that may run sympy for a while: called in a worker thread, off the event loop."""
