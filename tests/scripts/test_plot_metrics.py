"""plot_metrics turns a run's per-adapter records into reward and response-length curves
and one PNG."""

from __future__ import annotations

from pathlib import Path

from miles.utils.tracking import MetricsLogger, read_metrics
from tests.helpers.project_scripts import load_script


def write_run(run_dir: Path) -> None:
    logger = MetricsLogger(run_dir)
    for step, (a, b) in enumerate([(0.1, 0.5), (0.3, 0.4), (0.6, 0.2)], start=1):
        logger.log_adapter("a", {"raw_reward_mean": a, "response_len_mean": 10.0 - step}, step=step)
        logger.log_adapter("perf", {"raw_reward_mean": b, "response_len_mean": 4.0}, step=step)  # like the loop's
    logger.log_loop({"perf/train_time": 1.0, "perf/raw_reward_mean": 9.0}, rollout_id=0)
    logger.close()


def test_curves_per_metric_and_adapter_on_each_adapters_step(tmp_path):
    write_run(tmp_path)
    module = load_script("plot_metrics.py")
    records = read_metrics(tmp_path / "metrics.jsonl")
    panels = module.curves(records)
    assert panels == {
        "raw_reward_mean": {"a": [(1, 0.1), (2, 0.3), (3, 0.6)], "perf": [(1, 0.5), (2, 0.4), (3, 0.2)]},
        "response_len_mean": {"a": [(1, 9.0), (2, 8.0), (3, 7.0)], "perf": [(1, 4.0), (2, 4.0), (3, 4.0)]},
    }
    assert module.curves(records, ("raw_reward_mean", "not_logged")) == {"raw_reward_mean": panels["raw_reward_mean"]}


def test_run_dir_to_png(tmp_path, capsys):
    write_run(tmp_path / "run")
    module = load_script("plot_metrics.py")
    assert module.main([str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "a, perf: raw_reward_mean, response_len_mean" in capsys.readouterr().out
    out = tmp_path / "elsewhere" / "r.png"
    metrics_file = str(tmp_path / "run" / "metrics.jsonl")
    assert module.main([metrics_file, "--out", str(out), "--metrics", "raw_reward_mean"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_to_draw_is_an_error(tmp_path, capsys):
    module = load_script("plot_metrics.py")
    assert module.main([str(tmp_path)]) == 1
    assert "no metrics file" in capsys.readouterr().err
    MetricsLogger(tmp_path).close()
    (tmp_path / "metrics.jsonl").write_text('{"kind": "loop", "rollout_id": 0, "time": 0, "metrics": {}}\n')
    assert module.main([str(tmp_path)]) == 1
    assert "no adapter records" in capsys.readouterr().err
