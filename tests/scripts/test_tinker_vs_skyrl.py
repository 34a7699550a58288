"""tinker_vs_skyrl.py's rounds and figures, with drivers that answer fixed numbers (no server,
no SDK): cases alternate, the warm-up round is left out, every ratio is taken within a round,
the 2x target sits on the K = 8 training figure only, and a short sample is reported."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.project_scripts import load_script

tinker_vs_skyrl = load_script("bench/tinker_vs_skyrl.py")
Case, figures, measure = tinker_vs_skyrl.Case, tinker_vs_skyrl.figures, tinker_vs_skyrl.measure

ARGS = SimpleNamespace(steps=2, sample_calls=3, num_samples=4, max_tokens=8, reps=3, timeout=5.0,
                       model="tiny-random")


class FixedDriver:
    """Answers every request in `seconds_per_token[kind]` per token; logs what it was asked."""

    def __init__(self, name: str, seconds_per_token: dict[str, float], log: list[tuple[str, ...]],
                 short_by: int = 0) -> None:
        self.name = name
        self.seconds_per_token = seconds_per_token
        self.log = log
        self.short_by = short_by

    def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        kind, k = payload["op"], payload["k"]
        self.log.append((self.name, payload["mode"], kind, str(k)))
        if kind == "train":
            tokens = k * payload["steps"] * 4 * 128
            return {"seconds": tokens * self.seconds_per_token[kind], "tokens": tokens,
                    "step_seconds": [0.1] * k * payload["steps"]}
        tokens = k * payload["calls"] * ARGS.num_samples * ARGS.max_tokens - self.short_by
        return {"seconds": tokens * self.seconds_per_token[kind], "tokens": tokens}


def run(ks: list[int], short_by: int = 0):
    log: list[tuple[str, ...]] = []
    ours = FixedDriver("ours", {"train": 1e-4, "sample": 1e-3}, log)
    skyrl = FixedDriver("skyrl", {"train": 4e-4, "sample": 8e-4}, log, short_by=short_by)
    cases = {"ours": Case("ours", ours), "ours_sequential": Case("ours_sequential", ours, "sequential"),
             "skyrl": Case("skyrl", skyrl)}
    return measure(cases, ks, ARGS), log


def test_rounds_alternate_and_the_warm_up_is_not_counted() -> None:
    measured, log = run([1, 8])
    per_round = len(log) // (ARGS.reps + 1)
    rounds = [log[i * per_round:(i + 1) * per_round] for i in range(ARGS.reps + 1)]
    # The first timed round in order, the next reversed, and so on; K = 1 has no one-at-a-time case.
    train_k8 = [entry[:2] for entry in rounds[1] if entry[2:] == ("train", "8")]
    assert train_k8 == [("ours", "concurrent"), ("ours", "sequential"), ("skyrl", "concurrent")]
    assert [entry[:2] for entry in rounds[2] if entry[2:] == ("train", "8")] == list(reversed(train_k8))
    assert not any(entry[1] == "sequential" and entry[3] == "1" for entry in log)
    assert all(len(values) == ARGS.reps for values in measured.rates.values())
    assert measured.rates[("train", 8, "ours")] == pytest.approx([1e4] * ARGS.reps)
    assert measured.short_samples == []


def test_figures_take_ratios_within_a_round_and_the_target_at_k8_only() -> None:
    measured, _ = run([1, 8])
    figs = {f.figure: f for f in figures(measured, [1, 8], ARGS, {}, with_038=False)}
    train8 = figs["Tinker training tokens/s, 8 clients: ours ÷ SkyRL 0.3.0 (SDK 0.24.1 on both)"]
    assert train8.ratio == pytest.approx(4.0) and train8.target == ">= 2.0" and train8.met
    sample8 = figs["Tinker sampling tokens/s, 8 clients: ours ÷ SkyRL 0.3.0 (SDK 0.24.1 on both)"]
    assert sample8.ratio == pytest.approx(0.8) and sample8.met is None
    assert [f.target for f in figs.values() if f.target != "report"] == [">= 2.0"]
    assert len(figs) == 2 + 4  # K = 1: vs SkyRL; K = 8: vs SkyRL and at once vs one at a time


def test_a_sample_shorter_than_asked_is_reported() -> None:
    measured, _ = run([1], short_by=1)
    assert measured.short_samples == ["skyrl at K=1 generated 95 tokens, not 96"] * ARGS.reps
