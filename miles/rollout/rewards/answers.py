"""Answer extraction and comparison shared by the built-in rewards.

Pure string functions: the last `\\boxed{...}` of a text (nested braces allowed), the
final number of a text, numeric parsing of "1,000", "$12", "50%", "3/4" or
"\\frac{3}{4}", and SQuAD-style text normalization.
"""

from __future__ import annotations

import math
import re
import string

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC_RE = re.compile(r"^\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_REL_TOL = 1e-6


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), or None when there is none
    or its braces never close."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def parse_number(text: str) -> float | None:
    """The number a short answer denotes, or None when it is not (only) a number."""
    cleaned = text.strip().strip("$").strip()
    cleaned = cleaned.replace("\\!", "").replace("\\,", "").replace("\\%", "%")
    cleaned = cleaned.rstrip(".").rstrip("%").strip()
    frac = _FRAC_RE.match(cleaned)
    if frac:
        return _divide(frac.group(1), frac.group(2))
    cleaned = cleaned.replace(",", "")
    if "/" in cleaned:
        numerator, _, denominator = cleaned.partition("/")
        return _divide(numerator, denominator)
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _divide(numerator: str, denominator: str) -> float | None:
    try:
        num, den = float(numerator), float(denominator)
    except ValueError:
        return None
    return None if den == 0 else num / den


def extract_final_number(text: str) -> float | None:
    """The last number written in `text` ("The answer is 1,200." -> 1200.0)."""
    matches = _NUMBER_RE.findall(text)
    return parse_number(matches[-1]) if matches else None


def numbers_equal(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=_REL_TOL)


def normalize_text(text: str) -> str:
    """Lower-case, drop punctuation and English articles, collapse whitespace."""
    lowered = text.lower()
    no_punct = "".join(ch for ch in lowered if ch not in string.punctuation)
    return " ".join(_ARTICLES_RE.sub(" ", no_punct).split())
