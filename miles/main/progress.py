"""What the trainer shows a person while it runs, and the table it ends with.

One line per trained batch (adapters in it, their steps and rewards, stage times),
metrics fanned out through `MetricsLogger` (a loop record per rollout, an adapter record
per adapter in the batch), and at exit a per-adapter table: reward of the first and last
batches, steps taken, and the latest checkpoint. Steps ("step 29/30": the adapter's step
and the step its registration ends at) are read from the snapshot the driver hands in;
nothing is counted here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from miles.backends.torch.checkpoint import latest_checkpoint
from miles.main.adapter_sync import TrainedBatch
from miles.utils.tracking import MetricsLogger
from miles.utils.types import MultiLoRASnapshot, RolloutBatch

logger = logging.getLogger(__name__)


@dataclass
class AdapterProgress:
    name: str
    registration_id: str
    save_dir: str | None
    final_step: int | None
    """Step at which this registration retires by itself (its start step + num_step)."""
    step: int = 0
    rewards: list[float] = field(default_factory=list)
    """Mean reward of each batch it had groups in (all its registrations)."""


class RunProgress:
    def __init__(self, metrics: MetricsLogger) -> None:
        self.metrics = metrics
        self.adapters: dict[str, AdapterProgress] = {}
        self._last_idle_log = 0.0
        self._start = time.monotonic()

    def declare(self, snapshot: MultiLoRASnapshot) -> None:
        """Follow the snapshot: new adapters, re-registrations (new num_step, save), steps."""
        for name, run in snapshot.live.items():
            entry = self.adapters.get(name)
            save_dir = None if run.config.save is None else str(run.config.save)
            if entry is None:
                entry = self.adapters[name] = AdapterProgress(name, run.registration_id, save_dir, run.final_step)
                logger.info("Adapter %r in slot %d (save: %s)", name, run.slot, save_dir)
            elif entry.registration_id != run.registration_id:
                logger.info("Adapter %r registered again in slot %d (save: %s)", name, run.slot, save_dir)
            entry.registration_id, entry.save_dir, entry.final_step = run.registration_id, save_dir, run.final_step
            entry.step = run.step

    def idle(self, poll_s: float) -> None:
        now = time.monotonic()
        if now - self._last_idle_log >= 60.0:
            logger.info("No adapters registered; waiting (polling every %.1fs). "
                        "Register one with POST /adapter_runs.", poll_s)
            self._last_idle_log = now

    def record(self, rollout_id: int, rollout: RolloutBatch, trained: TrainedBatch,
               snapshot: MultiLoRASnapshot, perf: dict[str, float]) -> None:
        """Log one trained batch; `snapshot` is the one taken after the commit."""
        self.declare(snapshot)
        names = set(rollout.per_adapter) | set(trained.result.adapters) | set(trained.steps)
        for name in sorted(names):
            entry = self.adapters.get(name)
            if entry is None:
                continue
            metrics: dict[str, float] = {}
            stats = rollout.per_adapter.get(name)
            if stats is not None:
                metrics.update(stats.to_metrics())
                if stats.raw_reward_mean is not None and stats.groups > 0:
                    entry.rewards.append(stats.raw_reward_mean)
            if name in trained.result.adapters:
                metrics.update(trained.result.adapters[name].to_metrics())
            if name in trained.steps:
                metrics.update(trained.steps[name].to_metrics())
            self.metrics.log_adapter(name, metrics, step=entry.step)
        loop = {**rollout.stats.to_metrics(), "perf/train_samples": float(trained.result.samples), **perf}
        self.metrics.log_loop(loop, rollout_id=rollout_id)
        logger.info("rollout %d | %s | %s", rollout_id, self._adapters_line(rollout),
                    " ".join(f"{k.removeprefix('perf/').removesuffix('_time')}={v:.2f}s" for k, v in perf.items()))

    def _adapters_line(self, rollout: RolloutBatch) -> str:
        parts = []
        for name, groups in sorted(rollout.groups_per_adapter.items()):
            entry = self.adapters.get(name)
            if entry is None:
                continue
            total = "" if entry.final_step is None else f"/{entry.final_step}"
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
