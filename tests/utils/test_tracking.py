"""Metrics reach metrics.jsonl as typed records; adapter names never meet loop metrics."""

from __future__ import annotations

import math
import time

import pytest

from miles.utils.tracking import MetricsLogger, StageTimer, adapter_metric_name, adapter_series, read_metrics


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


def test_loop_and_adapter_records_are_separate_and_drop_non_finite(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log_adapter("add", {"reward_mean": 0.5, "grad_norm": 2.0, "bad": math.nan}, step=3)
    logger.log_loop({"perf/train_time": 1.5, "note": "text"}, rollout_id=7)
    logger.close()
    adapter, loop = read_metrics(tmp_path / "metrics.jsonl")
    assert adapter["kind"] == "adapter" and adapter["adapter"] == "add" and adapter["step"] == 3
    assert adapter["metrics"] == {"reward_mean": 0.5, "grad_norm": 2.0}
    assert loop["kind"] == "loop" and loop["rollout_id"] == 7
    assert loop["metrics"] == {"perf/train_time": 1.5}


def test_an_adapter_named_like_loop_metrics_cannot_collide_with_them(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log_loop({"perf/train_time": 1.0, "perf/rollout/queue_length": 4.0}, rollout_id=0)
    for name in ("perf", "rollout", "adapters"):
        logger.log_adapter(name, {"train_time": 99.0, "rollout/queue_length": 99.0}, step=1)
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    loop = [r for r in records if r["kind"] == "loop"]
    assert [r["metrics"] for r in loop] == [{"perf/train_time": 1.0, "perf/rollout/queue_length": 4.0}]
    assert adapter_series(records, "train_time") == {"perf": [(1, 99.0)], "rollout": [(1, 99.0)], "adapters": [(1, 99.0)]}
    # The flat names (TensorBoard, W&B) live under a namespace the loop may not use.
    assert adapter_metric_name("perf", "train_time") == "adapters/perf/train_time"
    with pytest.raises(ValueError, match="adapters/"):
        MetricsLogger(tmp_path / "other").log_loop({"adapters/perf/train_time": 1.0}, rollout_id=0)


class FakeWandb:
    """Records the calls the logger makes (no network, no wandb install needed)."""

    def __init__(self):
        self.calls = []
        self.util = type("util", (), {"generate_id": staticmethod(lambda: "abc123")})

    def login(self, **kwargs):
        self.calls.append(("login", kwargs))

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))

    def finish(self):
        self.calls.append(("finish", {}))


@pytest.mark.parametrize("extra, login, group", [
    ([], [], "RUN_ID_abc123"),
    (["--disable-wandb-random-suffix", "--wandb-key", "k"], [("login", {"key": "k"})], "RUN_ID"),
])
def test_wandb_flags_mean_what_they_mean_in_miles(tmp_path, monkeypatch, extra, login, group):
    import sys

    from miles.utils.arguments import parse_args

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = parse_args(["--use-wandb", "--wandb-project", "p", "--wandb-group", "RUN_ID", "--run-dir", str(tmp_path),
                      *extra])
    MetricsLogger.from_config(cfg)
    assert fake.calls == [*login, ("init", {"project": "p", "group": group, "name": group, "dir": str(tmp_path)})]
