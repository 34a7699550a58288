"""Run every benchmark and write docs/BENCHMARKS.md and docs/benchmarks.json.

    python scripts/bench/run_all.py [--models tiny,llama60m] [--only train_mixed,decode]
                                    [--before docs/benchmarks_before.json] [--quick] [--merge]

Each script runs in its own process per model (see its docstring for what it
measures); its figures, the exact command, the machine and the date are collected into
`docs/benchmarks.json`, and `docs/BENCHMARKS.md` gets one table row per figure. With
`--before`, an earlier `benchmarks.json` adds a "before" column for the same figures.
With `--merge`, the figures of this run replace those of the same script and model in
the existing `benchmarks.json` (all those of the same command, and those of the same
name from another command) and every other figure is kept as it was (its date too),
so one script can be rerun without rerunning the rest.

Scripts run on the models they support (`SCRIPT_MODELS`; the others on every model):
`trainer_service` starts a real trainer with a model's demo settings, so it runs on
`tiny` and `smollm2` only. `tinker_vs_skyrl` (ours against SkyRL's Tinker server) is not in
the default list: it needs a virtualenv of SkyRL (6.7 GB), so it runs only when named, e.g.
`--only tinker_vs_skyrl --models tiny-random --merge
--script-args 'tiny-random:tinker_vs_skyrl=--skyrl-venv PATH'`. `control_plane_scale` (the
control plane with 10 to 10,000 registrations in its registry; no model, so it runs once,
under `tiny`) takes several minutes on 2 cores, so it too runs only when named:
`--only control_plane_scale --models tiny --merge`. `dashboard_cost` (the demo trainer with the
dashboard open in Chromium, then closed, alternating) needs Chromium and runs only when named:
`--only dashboard_cost --models tiny --merge`. `push_throughput` (the weight push against a
loopback TCP copy; it starts a train rank and two engine fleets) runs only when named too:
`--only push_throughput --models llama60m --merge`.
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
SCRIPTS = ("train_mixed", "peft_vs_mixed", "memory", "decode", "trainer_service")
SCRIPT_MODELS = {"trainer_service": ("tiny", "smollm2"), "control_plane_scale": ("tiny",), "dashboard_cost": ("tiny",)}


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
        met = f["met"]
        row += [f["target"] if f["target"] != "report" else "–", "–" if met is None else "yes" if met else "no"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Ratios are taken so that the target direction reads as written: `ours/baseline` for the",
              "train-step, memory and tokens/s figures, `baseline/ours` (PEFT time ÷ ours) "
              "for the PEFT training figure.",
              "", "## Commands", ""]
    for command in dict.fromkeys(f["command"] for f in results["figures"]):
        lines.append(f"    {command}")
    models = sorted(set(results.get("models", [])) | {f["model"] for f in results["figures"]})
    missing = [f"{name}.py on {model}" for name in SCRIPTS for model in models
               if model in SCRIPT_MODELS.get(name, (model,))
               and not any(f["command"].split()[1] == f"scripts/bench/{name}.py" and f["model"] == model
                           for f in results["figures"])]
    if missing:
        lines += ["", "## Not measured here", ""]
        lines += [f"- scripts/bench/{item}" for item in missing]
    if results.get("notes") or results.get("script_notes"):
        lines += ["", "## Notes", ""]
    if results.get("notes"):
        lines += [results["notes"].rstrip()]
    for name, text in sorted(results.get("script_notes", {}).items()):
        lines += ["", f"### scripts/bench/{name}.py", "", text]
    return "\n".join(lines) + "\n"


def script_notes(items: list[str]) -> dict[str, str]:
    notes = {}
    for item in items:
        name, _, path = item.partition("=")
        notes[name] = Path(path).read_text().strip()
    return notes


def script_of(figure: dict) -> str:
    return figure["command"].split()[1]


def merge(old: dict, new: dict) -> dict:
    """`old` with the figures of `new` in place of those of the same script and model (new
    ones after the rest), and `new`'s notes per script in place of the old ones; the date
    line names this run's date for its scripts. An old figure of such a script and model
    is kept if another command produced it and this run has no figure of its name (e.g. the
    `--recompute` figures when only the plain run is rerun)."""
    replaced = {(script_of(f), f["model"]) for f in new["figures"]}
    commands = {(f["command"], f["model"]) for f in new["figures"]}
    names = {(f["figure"], f["model"]) for f in new["figures"]}

    def superseded(f: dict) -> bool:
        return (script_of(f), f["model"]) in replaced and (
            (f["command"], f["model"]) in commands or (f["figure"], f["model"]) in names)

    stamp = {"date": new["date"], "load_avg_1m_at_start": new["machine"]["load_avg_1m_at_start"]}
    figures = [f for f in old["figures"] if not superseded(f)]
    figures += [{**f, **stamp} for f in new["figures"]]
    scripts = ", ".join(sorted({Path(s).stem for s, _ in replaced}))
    dates = [d for d in old["date"].split(" / ") if not d.endswith(f"({scripts})")]
    return {**old, "figures": figures, "date": " / ".join([*dates, f"{new['date']} ({scripts})"]),
            "models": sorted(set(old.get("models", [])) | set(new.get("models", []))),
            "script_notes": {**old.get("script_notes", {}), **new.get("script_notes", {})}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,llama60m")
    parser.add_argument("--only", default=",".join(SCRIPTS), help="comma list of scripts to run")
    parser.add_argument("--quick", action="store_true", help="smoke run of every script (numbers meaningless)")
    parser.add_argument("--before", default=None, help="an earlier benchmarks.json to compare with")
    parser.add_argument("--out-dir", default=str(ROOT / "docs"))
    parser.add_argument("--shared-machine", action="store_true",
                        help="say in the doc that other jobs shared the machine")
    parser.add_argument("--notes", default=None, help="a markdown file appended to the doc as notes")
    parser.add_argument("--script-args", action="append", default=[], metavar="MODEL:SCRIPT=ARGS",
                        help="extra arguments for one script on one model (model '*' for all), e.g. "
                             "'llama60m:memory=--peft-processes 2'; repeatable")
    parser.add_argument("--script-notes", action="append", default=[], metavar="SCRIPT=FILE",
                        help="a markdown file of notes on one script's figures (kept per script by --merge)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the figures of the existing benchmarks.json that this run does not produce")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="run nothing: write the doc (and JSON) from an earlier run's benchmarks.json")
    args = parser.parse_args()
    out = Path(args.out_dir)
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if args.render:
        results = json.loads(Path(args.render).read_text())
        if args.notes:
            results["notes"] = Path(args.notes).read_text()
        results["script_notes"] = {**results.get("script_notes", {}), **script_notes(args.script_notes)}
        out.mkdir(parents=True, exist_ok=True)
        (out / "benchmarks.json").write_text(json.dumps(results, indent=1))
        (out / "BENCHMARKS.md").write_text(markdown(results, before))
        print(f"wrote {out / 'BENCHMARKS.md'}")
        return
    extra = ["--quick"] if args.quick else []
    results = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": machine(), "shared_machine": args.shared_machine, "figures": []}
    per_script: dict[tuple[str, str], list[str]] = {}
    for item in args.script_args:
        target, _, script_args = item.partition("=")
        model, _, name = target.partition(":")
        per_script.setdefault((model, name), []).extend(shlex.split(script_args))
    results["models"] = args.models.split(",")
    for model in results["models"]:
        for name in args.only.split(","):
            if model not in SCRIPT_MODELS.get(name, (model,)):
                continue
            more = per_script.get(("*", name), []) + per_script.get((model, name), [])
            results["figures"] += run_script(name, model, extra + more)["figures"]
    if args.notes:
        results["notes"] = Path(args.notes).read_text()
    results["script_notes"] = script_notes(args.script_notes)
    if args.merge and (out / "benchmarks.json").exists():
        results = merge(json.loads((out / "benchmarks.json").read_text()), results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=1))
    (out / "BENCHMARKS.md").write_text(markdown(results, before))
    print(f"wrote {out / 'BENCHMARKS.md'} and {out / 'benchmarks.json'}")


if __name__ == "__main__":
    main()
