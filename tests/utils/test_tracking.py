"""Metrics reach metrics.jsonl as typed records; adapter names never meet loop metrics."""

from __future__ import annotations

import math

import pytest

from miles.utils.tracking import MetricsLogger, StageTimer, adapter_metric_name, adapter_series, read_metrics


def test_stage_timer_accumulates_and_resets():
    readings = iter([10.0, 11.0, 20.0, 22.5, 30.0, 30.25])  # start and end of each stage below
    timer = StageTimer(clock=lambda: next(readings))
    with timer("train"):
        pass
    with timer("train"):
        pass
    with timer("save"):
        pass
    assert timer.pop_metrics() == {"perf/train_time": 3.5, "perf/save_time": 0.25}
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
    assert adapter_series(records, "train_time") == {"perf": [(1, 99.0)], "rollout": [(1, 99.0)],
                                                     "adapters": [(1, 99.0)]}
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

    def define_metric(self, name, **kwargs):
        self.calls.append(("define_metric", {"name": name, **kwargs}))

    def log(self, data):
        self.calls.append(("log", data))


class FakeSummaryWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, global_step):
        self.scalars.append((tag, value, global_step))

    def close(self):
        pass


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


def test_wandb_plots_each_adapter_against_its_own_step_and_tensorboard_matches_the_jsonl(tmp_path, monkeypatch):
    import sys

    fake, writer = FakeWandb(), FakeSummaryWriter()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(MetricsLogger, "_open_tensorboard", lambda self: writer)
    logger = MetricsLogger(tmp_path, use_wandb=True)
    logger.log_loop({"perf/train_time": 1.0, "perf/rollout/queue_length": 4.0}, rollout_id=0)
    # Adapters named like the loop's namespaces, with names one and two segments deep.
    logger.log_adapter("perf", {"raw_reward_mean": 0.5, "perf/queue_length": 3.0}, step=2)
    logger.log_adapter("perf", {"raw_reward_mean": 0.7, "dynamic_filter/drop_zero_std_0.0": 1.0}, step=3)
    logger.log_adapter("rollout", {"raw_reward_mean": 0.1}, step=1)
    logger.log_loop({"perf/train_time": 2.0}, rollout_id=1)
    logger.close()

    defined = [(c["name"], c.get("step_metric")) for kind, c in fake.calls if kind == "define_metric"]
    assert defined == [
        ("rollout_id", None), ("perf/*", "rollout_id"), ("perf/rollout/queue_length", "rollout_id"),
        ("adapters/perf/step", None), ("adapters/perf/*", "adapters/perf/step"),
        ("adapters/perf/perf/queue_length", "adapters/perf/step"),
        ("adapters/perf/dynamic_filter/drop_zero_std_0.0", "adapters/perf/step"),
        ("adapters/rollout/step", None), ("adapters/rollout/*", "adapters/rollout/step"),
    ]
    logged = [data for kind, data in fake.calls if kind == "log"]
    assert logged == [
        {"perf/train_time": 1.0, "perf/rollout/queue_length": 4.0, "rollout_id": 0},
        {"adapters/perf/raw_reward_mean": 0.5, "adapters/perf/perf/queue_length": 3.0, "adapters/perf/step": 2},
        {"adapters/perf/raw_reward_mean": 0.7, "adapters/perf/dynamic_filter/drop_zero_std_0.0": 1.0,
         "adapters/perf/step": 3},
        {"adapters/rollout/raw_reward_mean": 0.1, "adapters/rollout/step": 1},
        {"perf/train_time": 2.0, "rollout_id": 1},
    ]
    # TensorBoard carries exactly what the JSONL holds, under the flat names, on the same steps.
    from_jsonl = []
    for record in read_metrics(tmp_path / "metrics.jsonl"):
        if record["kind"] == "loop":
            from_jsonl += [(k, v, record["rollout_id"]) for k, v in record["metrics"].items()]
        else:
            from_jsonl += [(adapter_metric_name(record["adapter"], k), v, record["step"])
                           for k, v in record["metrics"].items()]
    assert writer.scalars == from_jsonl and len(from_jsonl) == 8


def test_miles_naming_plots_each_adapter_under_its_name_against_its_step(tmp_path, monkeypatch):
    """`--metrics-naming miles`: Miles' `{name}/{metric}` against `{name}/step` (its dashboards
    read them); the JSONL records are the same as with our names."""
    import sys

    from miles.utils.arguments import parse_args

    fake, writer = FakeWandb(), FakeSummaryWriter()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(MetricsLogger, "_open_tensorboard", lambda self: writer)
    logger = MetricsLogger.from_config(parse_args(["--use-wandb", "--run-dir", str(tmp_path),
                                                   "--metrics-naming", "miles"]))
    logger.log_adapter("gsm8k", {"raw_reward_mean": 0.5, "log_probs": -1.25}, step=4)
    logger.close()
    defined = [(c["name"], c.get("step_metric")) for kind, c in fake.calls if kind == "define_metric"]
    assert defined == [("gsm8k/step", None), ("gsm8k/*", "gsm8k/step")]
    assert [data for kind, data in fake.calls if kind == "log"] == [
        {"gsm8k/raw_reward_mean": 0.5, "gsm8k/log_probs": -1.25, "gsm8k/step": 4}]
    assert writer.scalars == [("gsm8k/raw_reward_mean", 0.5, 4), ("gsm8k/log_probs", -1.25, 4)]
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert (record["adapter"], record["step"], record["metrics"]) == ("gsm8k", 4, {"raw_reward_mean": 0.5,
                                                                                  "log_probs": -1.25})
    assert parse_args([]).metrics_naming == "ours"
    with pytest.raises(ValueError, match="metrics naming must be one of"):
        MetricsLogger(tmp_path, naming="wandb")
