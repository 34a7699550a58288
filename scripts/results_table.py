"""A markdown table of held-out accuracy from one or more runs of `scripts/eval_adapters.py --json`.

    python scripts/results_table.py runs/demo/eval.json
    python scripts/results_table.py run1.json run2.json run3.json --update docs/REAL_MODEL.md --block demo-real-results

One row per model (the base, then each adapter), one column per task; an adapter's own
task is in bold with its gain over the base. With several runs each cell is the mean
and the range. `--update FILE --block NAME` rewrites the text between the lines
`<!-- NAME:begin -->` and `<!-- NAME:end -->` of FILE, so the numbers in the docs are the
runs' own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean


def _cell(values: list[float], gain: list[float] | None) -> str:
    text = f"{mean(values):.1%}"
    if len(values) > 1:
        text += f" ({min(values):.1%}-{max(values):.1%})"
    if gain is not None:
        low, high = min(gain), max(gain)
        span = f"{low * 100:+.1f}" if len(gain) == 1 else f"{low * 100:+.1f} to {high * 100:+.1f}"
        text = f"**{text}** ({span} points)"
    return text


def render(runs: list[dict]) -> str:
    """The table of `runs` (each an eval_adapters JSON); every run must score the same models and tasks."""
    first = runs[0]["accuracy"]
    if any(r["accuracy"].keys() != first.keys() for r in runs):
        raise ValueError("the runs scored different models; give runs of one config")
    tasks = list(first["base"])
    lines = [f"| model | {' | '.join(tasks)} |", "|---|" + "---|" * len(tasks)]
    for model in first:
        cells = []
        for task in tasks:
            values = [r["accuracy"][model][task] for r in runs if task in r["accuracy"][model]]
            gain = [r["accuracy"][model][task] - r["accuracy"]["base"][task] for r in runs] if model == task else None
            cells.append(_cell(values, gain) if values else "-")
        label = "base" if model == "base" else f"adapter `{model}`"
        steps = sorted({r["steps"].get(model) for r in runs} - {None})
        if steps:
            label += f" ({'/'.join(map(str, steps))} steps)"
        lines.append(f"| {label} | {' | '.join(cells)} |")
    n = {r.get("n") for r in runs}
    lines.append("")
    rows = "all the" if n == {None} else "the first " + "/".join(map(str, sorted(n)))
    lines.append(f"Greedy accuracy on {rows} held-out rows of each task, {len(runs)} run{'s' * (len(runs) > 1)};"
                 " bold: the adapter's own task, with its gain over the base.")
    return "\n".join(lines)


def update_block(path: Path, block: str, text: str) -> None:
    begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    content = path.read_text()
    if content.count(begin) != 1 or content.count(end) != 1 or content.index(begin) > content.index(end):
        raise ValueError(f"{path} needs exactly one {begin} line followed by one {end} line")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="eval_adapters.py --json files")
    parser.add_argument("--update", type=Path, default=None, help="a markdown file to rewrite a block of")
    parser.add_argument("--block", default="demo-results", help="the block's name in that file")
    args = parser.parse_args(argv)
    text = render([json.loads(p.read_text()) for p in args.runs])
    print(text)
    if args.update is not None:
        update_block(args.update, args.block, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
