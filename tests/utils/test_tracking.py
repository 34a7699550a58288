"""Metrics reach metrics.jsonl with the right keys and step keys; stages are timed."""

from __future__ import annotations

import math
import time

from miles.utils.tracking import MetricsLogger, StageTimer, read_metrics, split_adapter_metrics


def test_stage_timer_accumulates_and_resets():
    timer = StageTimer()
    with timer("train"):
        time.sleep(0.02)
    with timer("train"):
        time.sleep(0.02)
    with timer("save"):
        pass
    metrics = timer.pop_metrics()
    assert set(metrics) == {"perf/train_time", "perf/save_time"}
    assert metrics["perf/train_time"] >= 0.04
    assert metrics["perf/save_time"] < metrics["perf/train_time"]
    assert timer.pop_metrics() == {}


def test_logger_writes_adapter_step_keys_and_drops_non_finite(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log_adapter("add", {"reward_mean": 0.5, "add/grad_norm": 2.0, "bad": math.nan}, step=3)
    logger.log({"perf/train_time": 1.5, "note": "text"}, step=7)
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["add/step"] == 3
    assert records[0]["add/reward_mean"] == 0.5
    assert records[0]["add/grad_norm"] == 2.0
    assert "add/bad" not in records[0]
    assert records[1]["rollout_id"] == 7
    assert records[1]["perf/train_time"] == 1.5
    assert "note" not in records[1]


def test_split_adapter_metrics():
    per, rest = split_adapter_metrics({"a/x": 1.0, "b/y": 2.0, "perf/t": 3.0, "c/z": 4.0}, ["a", "b"])
    assert per == {"a": {"a/x": 1.0}, "b": {"b/y": 2.0}}
    assert rest == {"perf/t": 3.0, "c/z": 4.0}
