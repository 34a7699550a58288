"""Draw each adapter's reward and response-length curves from a run to one PNG.

    python scripts/plot_metrics.py runs/demo                  # writes runs/demo/curves.png
    python scripts/plot_metrics.py runs/demo/metrics.jsonl --out docs/demo_rewards.png

One panel per metric (default: `raw_reward_mean` and `response_len_mean`), one line per
adapter, each against the adapter's own optimizer step (its adapter records in
`metrics.jsonl`, one per step). Needs matplotlib (in the `dev` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles.utils.tracking import adapter_series, read_metrics

DEFAULT_METRICS = ("raw_reward_mean", "response_len_mean")
TITLES = {"raw_reward_mean": "mean reward", "response_len_mean": "mean response length (tokens)"}


def metrics_path(run: Path) -> Path:
    """A run directory's metrics.jsonl, or the file itself."""
    return run / "metrics.jsonl" if run.is_dir() else run


def curves(records: list[dict], metrics: tuple[str, ...] = DEFAULT_METRICS) -> dict[str, dict[str, list]]:
    """metric -> adapter -> [(step, value)]; metrics no adapter record holds are left out."""
    out = {metric: adapter_series(records, metric) for metric in metrics}
    return {metric: series for metric, series in out.items() if series}


def plot(panels: dict[str, dict[str, list]], out: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (metric, series) in zip(axes[:, 0], panels.items()):
        for adapter, points in sorted(series.items()):
            steps, values = zip(*points)
            ax.plot(steps, values, marker=".", label=adapter)
        ax.set_ylabel(TITLES.get(metric, metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("adapter step")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="run directory (or its metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: curves.png beside the metrics)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS),
                        help="per-adapter metrics to draw, one panel each")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    path = metrics_path(args.run)
    if not path.is_file():
        print(f"no metrics file at {path}", file=sys.stderr)
        return 1
    panels = curves(read_metrics(path), tuple(args.metrics))
    if not panels:
        print(f"no adapter records with {', '.join(args.metrics)} in {path}", file=sys.stderr)
        return 1
    out = args.out or path.with_name("curves.png")
    plot(panels, out, args.title)
    adapters = sorted({name for series in panels.values() for name in series})
    print(f"wrote {out} ({', '.join(adapters)}: {', '.join(panels)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
