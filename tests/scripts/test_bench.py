"""Every benchmark script runs (--quick, tiny base) and run_all writes the doc and the JSON.

Smoke only: the numbers of a quick run mean nothing, so no timing thresholds are checked;
the checks a script makes of itself are (trainer_service: bytes pushed = LoRA bytes of
the adapters that stepped, no 5xx under load, no leaked slot; it exits 1 otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.project_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("train_mixed", "peft_vs_mixed", "memory", "decode", "trainer_service")


@pytest.mark.timeout(900)
def test_run_all_quick_writes_every_figure(tmp_path):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "run_all.py"), "--quick", "--models", "tiny",
         "--out-dir", str(tmp_path),
         "--script-args", "tiny:memory=--peft-processes 1 --recompute-granularity selective",
         "--script-args", "tiny:train_mixed=--recompute", "--script-args", "tiny:decode=--torch-decode"],
        check=True, cwd=ROOT, env=env, timeout=900,
    )
    results = json.loads((tmp_path / "benchmarks.json").read_text())
    figures = results["figures"]
    commands = {f["command"].split()[1] for f in figures}
    assert commands == {f"scripts/bench/{name}.py" for name in SCRIPTS}
    # train K=8, its train call and its optimizer step each ÷ K=1's, train with recompute ÷ without,
    # PEFT loop, memory, decode vs base, decode with the row-wise kernel vs the torch paths, decode
    # vs PEFT; trainer_service: push ÷ train, bytes pushed ÷ stepped, loop overhead, POST -> ACTIVE,
    # POST -> first step, 5xx under load, iteration during the load ÷ before
    assert len(figures) == 9 + 7
    for f in figures:
        assert f["model"] == "tiny" and f["reps"] >= 1
        assert f["baseline_median"] > 0 and f["ratio_min"] <= f["ratio"] <= f["ratio_max"]
        if f["target"] != "== 0":
            assert f["ours_median"] > 0 and f["ratio"] > 0
    by_target = {f["target"]: f for f in figures if f["command"].startswith("python scripts/bench/trainer_service.py")}
    assert by_target["== 1"]["met"] and by_target["== 1"]["ratio"] == 1.0  # bytes pushed = LoRA bytes stepped
    assert by_target["== 0"]["met"] and by_target["== 0"]["params"]["server_errors"] == 0
    doc = (tmp_path / "BENCHMARKS.md").read_text()
    table_rows = [line for line in doc.splitlines() if line.startswith("| ") and "tiny" in line]
    assert len(table_rows) == len(figures)
    assert "--quick" in doc and results["machine"]["cores"] >= 1


def test_lora_bytes_from_the_config_match_the_exported_slot(tiny_model_dir):
    """trainer_service's denominator (LoRA bytes from config.json) is what a slot of the
    model holds once every linear of its decoder is wrapped."""
    lora_nbytes = load_script("bench/trainer_service.py").lora_nbytes
    from transformers import AutoModelForCausalLM

    from miles.lora import inject_multi_lora
    from miles.lora.slots import get_slot_weights, init_slot

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    inject_multi_lora(model, n_slots=2, max_rank=8, target_modules="all-linear")
    init_slot(model, 1, rank=4, alpha=8.0, generator=torch.Generator().manual_seed(0))
    exported = sum(t.numel() * t.element_size() for t in get_slot_weights(model, 1).values())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert lora_nbytes(config, 4) == exported


def test_merge_replaces_one_scripts_figures_and_keeps_the_rest():
    run_all = load_script("bench/run_all.py")
    markdown, merge = run_all.markdown, run_all.merge

    def figure(script, model, ratio, target="<= 1.0", met=True):
        return {"figure": f"{script} figure", "model": model, "ours_label": "ours", "baseline_label": "base",
                "ours_median": ratio, "baseline_median": 1.0, "unit": "s", "ratio": ratio, "ratio_min": ratio,
                "ratio_max": ratio, "target": target, "met": met,
                "command": f"python scripts/bench/{script}.py --model {model}"}

    machine = {"cpu": "cpu", "cores": 2, "torch": "t", "python": "p", "load_avg_1m_at_start": 1.0}
    old = {"date": "D0", "machine": machine, "figures": [figure("decode", "tiny", 0.5),
                                                         figure("trainer_service", "tiny", 9.0)],
           "notes": "old notes", "script_notes": {"decode": "decode notes"}}
    new = {"date": "D1", "machine": {**machine, "load_avg_1m_at_start": 3.0}, "models": ["tiny"],
           "figures": [figure("trainer_service", "tiny", 0.2), figure("trainer_service", "tiny", 1.5, "report", None)],
           "script_notes": {"trainer_service": "service notes"}}
    merged = merge(old, new)
    assert [(f["command"].split()[1], f["ratio"]) for f in merged["figures"]] == [
        ("scripts/bench/decode.py", 0.5), ("scripts/bench/trainer_service.py", 0.2),
        ("scripts/bench/trainer_service.py", 1.5)]
    assert merged["figures"][1]["date"] == "D1" and merged["figures"][1]["load_avg_1m_at_start"] == 3.0
    assert "date" not in merged["figures"][0]
    assert merged["date"] == "D0 / D1 (trainer_service)"
    assert merged["notes"] == "old notes"
    assert merged["script_notes"] == {"decode": "decode notes", "trainer_service": "service notes"}
    again = merge(merged, {**new, "date": "D2"})  # a rerun replaces its own date, not the others'
    assert again["date"] == "D0 / D2 (trainer_service)" and len(again["figures"]) == 3
    # A figure of the same script from another command is kept unless this run has its name.
    other = {**figure("decode", "tiny", 0.7), "figure": "decode other figure",
             "command": "python scripts/bench/decode.py --model tiny --torch-decode"}
    same_name = {**figure("decode", "tiny", 0.6), "command": "python scripts/bench/decode.py --model tiny --reps 3"}
    kept = merge({**old, "figures": [*old["figures"], other, same_name]},
                 {**new, "figures": [figure("decode", "tiny", 0.8)]})
    assert sorted((f["figure"], f["ratio"]) for f in kept["figures"]) == [
        ("decode figure", 0.8), ("decode other figure", 0.7), ("trainer_service figure", 9.0)]
    doc = markdown(merged, None)
    rows = [line for line in doc.splitlines() if line.startswith("| trainer_service")]
    assert rows[0].endswith("| <= 1.0 | yes |") and rows[1].endswith("| – | – |")
    assert "### scripts/bench/trainer_service.py" in doc and "service notes" in doc


@pytest.mark.timeout(120)
def test_control_plane_scale_quick_writes_its_figures(tmp_path):
    """control_plane_scale.py --quick (not in run_all's default list: its full run takes
    minutes): every latency, write-through and snapshot figure, each side measured."""
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "control_plane_scale.py"), "--quick",
                    "--json", str(out)], check=True, cwd=ROOT, timeout=120)
    figures = json.loads(out.read_text())["figures"]
    names = [f["figure"] for f in figures]
    # p99 of POST, status, a page of the list, the whole list, metrics; write-through after a
    # change, a registration, a release; the snapshot
    assert len(figures) == 5 + 3 + 1
    assert any("GET /adapter_runs?limit=" in n for n in names)
    assert names[0].startswith("control plane p99 latency of POST /adapter_runs")
    assert any("POST /adapter_runs" in n for n in names) and names[-1].startswith("driver snapshot")
    for f in figures:
        assert f["ours_median"] > 0 and f["baseline_median"] > 0 and f["ratio_min"] <= f["ratio"] <= f["ratio_max"]
    snapshot = figures[-1]["params"]["bytes"]
    assert snapshot["64"] > snapshot["8"] > 0


def test_push_throughput_loopback_copies_every_byte_over_one_connection():
    """push_throughput's baseline: each copy sends exactly `n` bytes and waits for the answer,
    repeatedly over the one kept connection (its full run needs engines: not in the quick suite)."""
    LoopbackCopy = load_script("bench/push_throughput.py").LoopbackCopy

    loopback = LoopbackCopy(3 << 20)
    try:
        assert len(loopback.payload) == 3 << 20 and loopback.client.getpeername()[0] == "127.0.0.1"
        for _ in range(3):
            loopback.copy()
    finally:
        loopback.close()
    assert not loopback._thread.is_alive()  # the server saw the connection close after the last copy
