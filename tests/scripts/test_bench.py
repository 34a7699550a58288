"""Every benchmark script runs (--quick, tiny base) and run_all writes the doc and the JSON.

Smoke only: the numbers of a quick run mean nothing, so no thresholds are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("train_mixed", "peft_vs_mixed", "memory", "decode")


@pytest.mark.timeout(900)
def test_run_all_quick_writes_every_figure(tmp_path):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "run_all.py"), "--quick", "--models", "tiny",
         "--out-dir", str(tmp_path), "--script-args", "tiny:memory=--peft-processes 1"],
        check=True, cwd=ROOT, env=env, timeout=900,
    )
    results = json.loads((tmp_path / "benchmarks.json").read_text())
    figures = results["figures"]
    commands = {f["command"].split()[1] for f in figures}
    assert commands == {f"scripts/bench/{name}.py" for name in SCRIPTS}
    assert len(figures) == 5  # train K=8, PEFT loop, memory, decode vs base, decode vs PEFT
    for f in figures:
        assert f["model"] == "tiny" and f["reps"] == 1
        assert f["ours_median"] > 0 and f["baseline_median"] > 0 and f["ratio"] > 0
        assert f["ratio_min"] <= f["ratio"] <= f["ratio_max"]
    doc = (tmp_path / "BENCHMARKS.md").read_text()
    table_rows = [line for line in doc.splitlines() if line.startswith("| ") and "tiny" in line]
    assert len(table_rows) == len(figures)
    assert "--quick" in doc and results["machine"]["cores"] >= 1
