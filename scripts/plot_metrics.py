"""Draw per-adapter reward curves from a run's metrics.jsonl to a PNG.

    python scripts/plot_metrics.py runs/demo/metrics.jsonl --out runs/demo/rewards.png

Each adapter's `raw_reward_mean` (from its adapter records) is plotted against its own step.
Needs matplotlib (`pip install matplotlib`, included in the `dev` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles.utils.tracking import adapter_series, read_metrics


def reward_curves(records: list[dict], key: str = "raw_reward_mean") -> dict[str, list[tuple[float, float]]]:
    """adapter -> [(step, value)] of one per-adapter metric."""
    return adapter_series(records, key)


def plot(curves: dict[str, list[tuple[float, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for adapter, points in sorted(curves.items()):
        steps, rewards = zip(*points)
        ax.plot(steps, rewards, marker=".", label=adapter)
    ax.set_xlabel("adapter step")
    ax.set_ylabel("mean reward")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", type=Path, help="metrics.jsonl of a run")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: next to the metrics)")
    parser.add_argument("--key", default="raw_reward_mean", help="per-adapter metric to plot")
    args = parser.parse_args(argv)
    curves = reward_curves(read_metrics(args.metrics), args.key)
    if not curves:
        print(f"no adapter records with '{args.key}' in {args.metrics}", file=sys.stderr)
        return 1
    out = args.out or args.metrics.with_name(f"{args.key}.png")
    plot(curves, out)
    print(f"wrote {out} ({', '.join(sorted(curves))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
