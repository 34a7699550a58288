"""Run every benchmark and write docs/BENCHMARKS.md and docs/benchmarks.json.

    python scripts/bench/run_all.py [--models tiny,llama60m] [--only train_mixed,decode]
                                    [--before docs/benchmarks_before.json] [--quick]

Each script runs in its own process per model (see its docstring for what it
measures); its figures, the exact command, the machine and the date are collected into
`docs/benchmarks.json`, and `docs/BENCHMARKS.md` gets one table row per figure. With
`--before`, an earlier `benchmarks.json` adds a "before" column for the same figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPTS = ("train_mixed", "peft_vs_mixed", "memory", "decode")
NOT_COVERED = (
    "weight push time ÷ train step time, and bytes pushed ÷ LoRA bytes of the adapters that stepped",
    "POST /adapter_runs → ACTIVE, and → first optimizer step, in a running trainer",
    "loop overhead (snapshot + reconcile + push + guard + save) ÷ iteration",
    "control plane under load while training: requests/s, p50/p99, 5xx",
)


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "load_avg_1m_at_start": load}


def run_script(name: str, model: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [sys.executable, str(HERE / f"{name}.py"), "--model", model, "--json", str(out), *extra]
        shown = " ".join(["python", f"scripts/bench/{name}.py", "--model", model, *extra])
        print(f"$ {shown}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        payload = json.loads(out.read_text())
    for figure in payload["figures"]:
        figure["command"] = shown
    return payload


def fmt(value: float, unit: str) -> str:
    return f"{value:.1f} {unit}" if value >= 100 else f"{value:.3g} {unit}"


def markdown(results: dict, before: dict | None) -> str:
    m = results["machine"]
    before_by_key = {}
    if before:
        before_by_key = {(f["figure"], f["model"]): f for f in before["figures"]}
    lines = [
        "# Benchmarks",
        "",
        "Written by `python scripts/bench/run_all.py` (one script per figure in `scripts/bench/`; raw numbers in",
        "`docs/benchmarks.json`). Every figure is the ratio of two things measured in the same run, alternating,",
        f"median of the per-repetition ratios with min..max. Machine: {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']}, Python {m['python']}; each script runs with one torch thread unless given `--threads`. "
        f"Date: {results['date']}.",
        "",
    ]
    if results.get("shared_machine"):
        lines += ["The machine was shared with other jobs while these ran (load average "
                  f"{m['load_avg_1m_at_start']:.1f} at the start), so absolute times are noisy; the ratios",
                  "are of alternating runs and hold better.", ""]
    header = "| figure | model | ours | baseline | ratio (min..max) | target | met |"
    if before:
        header = "| figure | model | ours | baseline | ratio (min..max) | before | target | met |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for f in results["figures"]:
        ratio = f"**{f['ratio']:.2f}** ({f['ratio_min']:.2f}..{f['ratio_max']:.2f})"
        row = [f["figure"], f["model"], f"{f['ours_label']}: {fmt(f['ours_median'], f['unit'])}",
               f"{f['baseline_label']}: {fmt(f['baseline_median'], f['unit'])}", ratio]
        if before:
            old = before_by_key.get((f["figure"], f["model"]))
            row.append(f"{old['ratio']:.2f}" if old else "–")
        row += [f["target"], "yes" if f["met"] else "no"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Ratios are taken so that the target direction reads as written: `ours/baseline` for the",
              "train-step, memory and tokens/s figures, `baseline/ours` (PEFT time ÷ ours) for the PEFT training figure.",
              "", "## Commands", ""]
    for command in dict.fromkeys(f["command"] for f in results["figures"]):
        lines.append(f"    {command}")
    lines += ["", "## Not measured here", ""]
    lines += [f"- {item}" for item in NOT_COVERED]
    if results.get("notes"):
        lines += ["", "## Notes", "", results["notes"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,llama60m")
    parser.add_argument("--only", default=",".join(SCRIPTS), help="comma list of scripts to run")
    parser.add_argument("--quick", action="store_true", help="smoke run of every script (numbers meaningless)")
    parser.add_argument("--before", default=None, help="an earlier benchmarks.json to compare with")
    parser.add_argument("--out-dir", default=str(ROOT / "docs"))
    parser.add_argument("--shared-machine", action="store_true", help="say in the doc that other jobs shared the machine")
    parser.add_argument("--notes", default=None, help="a markdown file appended to the doc as notes")
    parser.add_argument("--script-args", action="append", default=[], metavar="MODEL:SCRIPT=ARGS",
                        help="extra arguments for one script on one model (model '*' for all), e.g. "
                             "'llama60m:memory=--peft-processes 2'; repeatable")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="run nothing: write the doc (and JSON) from an earlier run's benchmarks.json")
    args = parser.parse_args()
    out = Path(args.out_dir)
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if args.render:
        results = json.loads(Path(args.render).read_text())
        if args.notes:
            results["notes"] = Path(args.notes).read_text()
        out.mkdir(parents=True, exist_ok=True)
        (out / "benchmarks.json").write_text(json.dumps(results, indent=1))
        (out / "BENCHMARKS.md").write_text(markdown(results, before))
        print(f"wrote {out / 'BENCHMARKS.md'}")
        return
    extra = ["--quick"] if args.quick else []
    results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": machine(), "shared_machine": args.shared_machine, "figures": []}
    per_script: dict[tuple[str, str], list[str]] = {}
    for item in args.script_args:
        target, _, script_args = item.partition("=")
        model, _, name = target.partition(":")
        per_script.setdefault((model, name), []).extend(shlex.split(script_args))
    for model in args.models.split(","):
        for name in args.only.split(","):
            more = per_script.get(("*", name), []) + per_script.get((model, name), [])
            results["figures"] += run_script(name, model, extra + more)["figures"]
    if args.notes:
        results["notes"] = Path(args.notes).read_text()
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=1))
    (out / "BENCHMARKS.md").write_text(markdown(results, before))
    print(f"wrote {out / 'BENCHMARKS.md'} and {out / 'benchmarks.json'}")


if __name__ == "__main__":
    main()
