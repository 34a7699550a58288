"""Is a model's final answer mathematically the same as the label?

`answers_equivalent(answer, label)` asks the maintained `math-verify` package (LaTeX and
plain expressions parsed to sympy, compared symbolically and numerically), after a
whitespace-insensitive string match:

    >>> answers_equivalent("\\\\frac{2}{4}", "0.5"), answers_equivalent("x(x+2)", "x^2+2x")
    (True, True)
    >>> answers_equivalent("13", "12")
    False

math-verify bounds its own work with SIGALRM, which only works on the main thread; on any
other thread (an event loop of a Ray actor, a worker thread) the bound is off, since
setting the alarm there would raise and score every answer 0.
"""

from __future__ import annotations

import threading

from math_verify import parse, verify

MATH_VERIFY_TIMEOUT_S = 5
"""Per parse and per comparison, on the main thread."""


def _timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(expression: str) -> list:
    # \boxed{} marks the whole string as the answer: math-verify extracts it as one expression
    return parse("\\boxed{" + expression + "}", parsing_timeout=_timeout())


def answers_equivalent(answer: str, label: str) -> bool:
    """True when `answer` and `label` (bare answers, not whole solutions) denote the same value."""
    if "".join(answer.split()) == "".join(label.split()):
        return True
    gold, target = _parse(label), _parse(answer)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=_timeout()))
