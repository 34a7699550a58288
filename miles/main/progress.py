"""What the trainer shows a person while it runs, and the table it ends with.

One line per trained batch (adapters in it, their steps and rewards, stage times),
metrics fanned out through `MetricsLogger`, and at exit a per-adapter table: reward of
the first and last batches, steps taken, and the latest checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from miles.backends.torch.checkpoint import latest_checkpoint
from miles.utils.tracking import MetricsLogger, split_adapter_metrics
from miles.utils.types import MultiLoRASnapshot, RolloutBatch

logger = logging.getLogger(__name__)

REWARD_KEY = "raw_reward_mean"


@dataclass
class AdapterProgress:
    name: str
    save_dir: str | None
    num_step: int | None
    step: int = 0
    rewards: list[float] = field(default_factory=list)


class RunProgress:
    def __init__(self, metrics: MetricsLogger) -> None:
        self.metrics = metrics
        self.adapters: dict[str, AdapterProgress] = {}
        self._last_idle_log = 0.0
        self._start = time.monotonic()

    def declare(self, snapshot: MultiLoRASnapshot) -> None:
        """Start tracking adapters seen for the first time (or re-registered)."""
        for name, run in snapshot.live.items():
            known = self.adapters.get(name)
            if known is None or known.save_dir != str(run.config.save):
                self.adapters[name] = AdapterProgress(name, str(run.config.save), run.config.num_step)
                logger.info("Adapter %r in slot %d (save: %s)", name, run.slot, run.config.save)
            self.adapters[name].step = run.step

    def idle(self, poll_s: float) -> None:
        now = time.monotonic()
        if now - self._last_idle_log >= 60.0:
            logger.info("No adapters registered; waiting (polling every %.1fs). "
                        "Register one with POST /adapter_runs.", poll_s)
            self._last_idle_log = now

    def record(self, rollout_id: int, rollout: RolloutBatch, train_metrics: dict[str, float],
               stepped: list[str], perf: dict[str, float]) -> None:
        rollout_metrics = {f"{name}/{key}": value for name, stats in rollout.per_adapter.items()
                           for key, value in stats.to_metrics().items()}
        merged = {**rollout.stats.to_metrics(), **rollout_metrics, **train_metrics}
        for name in stepped:
            if name in self.adapters:
                self.adapters[name].step += 1
        per_adapter, shared = split_adapter_metrics(merged, list(self.adapters))
        for name, own in per_adapter.items():
            if not own:
                continue
            entry = self.adapters[name]
            reward = own.get(f"{name}/{REWARD_KEY}")
            if reward is not None and name in rollout.groups_per_adapter:
                entry.rewards.append(reward)
            self.metrics.log_adapter(name, own, step=entry.step)
        self.metrics.log({**shared, **perf}, step=rollout_id)
        logger.info("rollout %d | %s | %s", rollout_id, self._adapters_line(rollout),
                    " ".join(f"{k.removeprefix('perf/').removesuffix('_time')}={v:.2f}s" for k, v in perf.items()))

    def _adapters_line(self, rollout: RolloutBatch) -> str:
        parts = []
        for name, groups in sorted(rollout.groups_per_adapter.items()):
            entry = self.adapters.get(name)
            if entry is None:
                continue
            total = f"/{entry.num_step}" if entry.num_step else ""
            reward = f" reward={entry.rewards[-1]:.3f}" if entry.rewards else ""
            parts.append(f"{name}: step {entry.step}{total} groups={groups}{reward}")
        return "; ".join(parts) or "no groups"

    def summary_rows(self) -> list[tuple[str, str, str, str, str]]:
        rows = []
        for entry in sorted(self.adapters.values(), key=lambda e: e.name):
            rows.append((
                entry.name,
                _fmt(_mean_head(entry.rewards)),
                _fmt(_mean_tail(entry.rewards)),
                str(entry.step),
                str(latest_checkpoint(entry.save_dir) or "-") if entry.save_dir else "-",
            ))
        return rows

    def print_summary(self) -> None:
        rows = self.summary_rows()
        if not rows:
            return
        header = ("adapter", "reward start", "reward end", "steps", "checkpoint")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
        elapsed = time.monotonic() - self._start
        print(f"\nPer-adapter summary ({elapsed:.0f}s; metrics: {self.metrics.path})")
        print("\n".join(lines), flush=True)


def _window(values: list[float]) -> int:
    return max(1, min(5, len(values) // 4 or 1))


def _mean_head(values: list[float]) -> float | None:
    return sum(values[: _window(values)]) / _window(values) if values else None


def _mean_tail(values: list[float]) -> float | None:
    return sum(values[-_window(values):]) / _window(values) if values else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"

