"""plot_metrics turns per-adapter reward records into curves and a PNG."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.utils.tracking import MetricsLogger, read_metrics

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot_metrics.py"


def load_script():
    spec = importlib.util.spec_from_file_location("plot_metrics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_curves_and_png(tmp_path):
    logger = MetricsLogger(tmp_path)
    for step, (a, b) in enumerate([(0.1, 0.5), (0.3, 0.4), (0.6, 0.2)]):
        logger.log_adapter("a", {"raw_reward_mean": a}, step=step)
        logger.log_adapter("perf", {"raw_reward_mean": b}, step=step)  # named like the loop's metrics
    logger.log_loop({"perf/train_time": 1.0, "perf/raw_reward_mean": 9.0}, rollout_id=0)
    logger.close()
    module = load_script()
    curves = module.reward_curves(read_metrics(tmp_path / "metrics.jsonl"))
    assert curves == {"a": [(0, 0.1), (1, 0.3), (2, 0.6)], "perf": [(0, 0.5), (1, 0.4), (2, 0.2)]}
    out = tmp_path / "r.png"
    assert module.main([str(tmp_path / "metrics.jsonl"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
