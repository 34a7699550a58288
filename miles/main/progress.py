"""What the trainer shows a person while it runs, the metrics it records, and the table
it ends with.

- Metrics (`MetricsLogger`): one loop record per trained batch (`perf/...`: stage
  times, batch composition, the adapters the batch steps; and `batch`, each adapter's
  groups and samples in it, `batch_composition`) and ONE adapter record per optimizer
  step, stepped on the adapter's step. A server-driven adapter's: the rollout
  numbers of every batch that went into the step merged (`AdapterRolloutStats.merge`:
  Miles' `raw_reward_*`, `response_len_*`, `zero_std_*`, `truncated_ratio`,
  `avg/max_staleness`), the train numbers of those batches (sample-weighted `loss`, `kl`,
  ...), the step's `grad_norm` and `lr`, and `dynamic_filter/drop_{reason}`: groups the
  dynamic filter dropped since the adapter's previous step record. A client-driven
  adapter's (one per `optim_step`, `ClientWindow`): the metrics of its forward_backward
  calls since its previous step reduced as their names say (`loss:sum` summed), the datums,
  tokens and calls, the step's Adam settings and `grad_norm`, and its time in the trainer.
  Both kinds carry `perf/samples_per_s` once known: trained samples (a client's datums) per
  second over the adapter's latest `RATE_WINDOW` batches (`SampleRate`, the table's samples/s).
- With `--dump-details` (`RolloutDump`, given by the launcher): every trained batch is
  handed to the dump's writer thread, which writes each adapter's groups as JSON.
- On screen: attached to a terminal, a live table (adapter, kind, state, step/final step,
  reward and loss of the latest step, trained samples/s) redrawn each iteration, with log
  lines scrolling above it; otherwise one log line per trained batch, and one per
  iteration in which client-driven adapters stepped.
- To the controller (when given one): each adapter's latest step reward and buffered
  groups, or a client-driven adapter's latest step loss, which its Prometheus `/metrics`
  serves.
- At exit: per adapter, the reward and loss of the first and last steps, steps taken, and
  the latest checkpoint.

Steps ("step 29/30": the adapter's step and the step its registration ends at) are read
from the snapshots the driver hands in; the one exception is a client-driven adapter's
`optim_step` within an iteration, one past the step the iteration's snapshot showed (the
next snapshot agrees: completing that step is what steps it in the registry).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from miles.backends.base import AdapterTrainStats
from miles.main.client_commands import ClientCall, ClientModelReport, ClientStepTaken, reduce_metrics
from miles.main.rollout_dump import RolloutDump
from miles.main.train_step import TrainedBatch
from miles.utils.tracking import MetricsLogger
from miles.utils.types import (
    AdapterGauges,
    AdapterKind,
    AdapterRolloutStats,
    AdapterState,
    MultiLoRASnapshot,
    RolloutBatch,
)

logger = logging.getLogger(__name__)

RATE_WINDOW = 8
"""Trained batches an adapter's samples/s is measured over."""


@dataclass
class SampleRate:
    """Samples trained per second over an adapter's latest `RATE_WINDOW` trained batches."""

    trained: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    """(time, samples) of its latest trained batches."""
    since: float = 0.0
    """Start of the window `trained` covers."""

    def add(self, now: float, samples: int) -> None:
        if len(self.trained) == self.trained.maxlen:
            self.since = self.trained[0][0]
        self.trained.append((now, samples))

    def per_s(self, now: float) -> float | None:
        if not self.trained or now <= self.since:
            return None
        return sum(n for _, n in self.trained) / (now - self.since)


@dataclass
class StepWindow:
    """What an adapter's batches since its last optimizer step add up to (its next step record)."""

    rollout: AdapterRolloutStats | None = None
    """Rollout numbers of the batches since its last step."""
    train: list[AdapterTrainStats] = field(default_factory=list)
    """Train numbers of the batches since its last step."""
    batches: int = 0
    """Batches since its last step."""
    filter_drops_logged: dict[str, int] = field(default_factory=dict)
    """The producer's cumulative dynamic-filter drops per reason at its last step record."""

    def add(self, stats: AdapterRolloutStats, train: AdapterTrainStats | None) -> None:
        self.rollout = stats if self.rollout is None else self.rollout.merge(stats)
        self.batches += 1 if stats.groups else 0
        if train is not None:
            self.train.append(train)

    def close(self) -> dict[str, float]:
        """The step record's numbers; starts the next step's window."""
        metrics: dict[str, float] = {"perf/step_batches": float(self.batches)}
        if self.rollout is not None:
            metrics.update(self.rollout.to_metrics())
            drops = self.rollout.generation.filtered_by_reason
            for reason, total in drops.items():
                metrics[f"dynamic_filter/drop_{reason}"] = float(total - self.filter_drops_logged.get(reason, 0))
            self.filter_drops_logged = dict(drops)
        metrics.update(_merge_train(self.train))
        self.drop()
        return metrics

    def drop(self) -> None:
        """Forget the batches since the last step (the drop counts' baseline stays)."""
        self.rollout, self.train, self.batches = None, [], 0


@dataclass
class ClientWindow:
    """What a client-driven adapter's commands since its last `optim_step` add up to (its
    next step record)."""

    calls: list[ClientCall] = field(default_factory=list)
    """Its forward_backward calls since its last step."""
    seconds: float = 0.0
    """Its time in the trainer since its last step."""

    def add(self, report: ClientModelReport) -> None:
        self.calls.extend(report.calls)
        self.seconds += report.seconds

    def close(self, step: ClientStepTaken) -> dict[str, float]:
        """The step record's numbers; starts the next step's window."""
        adam = step.adam
        metrics = {
            **reduce_metrics(self.calls),
            "forward_backward_calls": float(len(self.calls)),
            "train_datums": float(sum(c.datums for c in self.calls)),
            "train_tokens": float(sum(c.tokens for c in self.calls)),
            "lr": adam.learning_rate if step.stats is None else step.stats.lr,
            "weight_decay": adam.weight_decay, "grad_clip_norm": adam.grad_clip_norm,
            "adam_beta1": adam.beta1, "adam_beta2": adam.beta2, "adam_eps": adam.eps,
            "perf/train_time": self.seconds,
        }
        if step.stats is not None:
            metrics["grad_norm"] = step.stats.grad_norm
        self.drop()
        return metrics

    def drop(self) -> None:
        self.calls, self.seconds = [], 0.0


@dataclass
class AdapterProgress:
    name: str
    registration_id: str
    save_dir: str | None
    final_step: int | None
    """Step at which this registration retires by itself (its start step + num_step)."""
    kind: AdapterKind = AdapterKind.SERVER
    state: AdapterState = AdapterState.PENDING
    step: int = 0
    rewards: list[float] = field(default_factory=list)
    """`raw_reward_mean` of each optimizer step (all its registrations)."""
    losses: list[float] = field(default_factory=list)
    """Each optimizer step's loss: the sample-weighted train `loss` of a server-driven adapter,
    the `loss:sum` of a client-driven one's forward_backward calls."""
    window: StepWindow = field(default_factory=StepWindow)
    client: ClientWindow = field(default_factory=ClientWindow)
    """A client-driven adapter's calls since its last step (`window` stays empty for it)."""
    resume_from: str | None = None
    """A client-driven adapter's latest saved (or loaded) checkpoint directory."""
    rate: SampleRate = field(default_factory=SampleRate)
    """Samples (a client-driven adapter's datums) trained per second."""


@dataclass(frozen=True)
class AdapterRow:
    """One line of the live table."""

    name: str
    kind: str
    state: str
    step: str
    """"12/30": its step and the step its registration ends at."""
    reward: str
    loss: str
    samples_per_s: str


class ProgressView(Protocol):
    def show(self, rows: list[AdapterRow], line: str | None) -> None:
        """Redraw with the current rows; `line` summarizes a trained batch (None: no new batch)."""

    def close(self) -> None: ...


class PlainView:
    """Not a terminal (a log file, CI): one log line per trained batch."""

    def show(self, rows: list[AdapterRow], line: str | None) -> None:
        if line is not None:
            logger.info("%s", line)

    def close(self) -> None:
        pass


class LiveTableView:
    """A terminal: a rich table redrawn in place; log lines and prints scroll above it."""

    COLUMNS = ("adapter", "kind", "state", "step", "reward", "loss", "samples/s")

    def __init__(self, console: Any | None = None) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = console if console is not None else Console(stderr=True)
        self._live = Live(console=self.console, auto_refresh=False, redirect_stdout=True, redirect_stderr=True)
        self._line = ""
        """The latest trained batch's summary, shown under the table."""
        self._live.start()
        self._rerouted = self._route_logging_through_live()

    def _route_logging_through_live(self) -> list[tuple[logging.StreamHandler[Any], Any]]:
        """Log handlers write to the stream they were given, which the live display does not
        see; point those on the real stderr at the display's proxy while it runs."""
        if sys.stderr is sys.__stderr__:  # nothing redirected (not a terminal)
            return []
        rerouted = []
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stderr__:
                rerouted.append((handler, handler.setStream(sys.stderr)))
        return rerouted

    def show(self, rows: list[AdapterRow], line: str | None) -> None:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        self._line = line if line is not None else self._line
        table = Table(*self.COLUMNS, expand=False)
        for row in rows:
            table.add_row(row.name, row.kind, row.state, row.step, row.reward, row.loss, row.samples_per_s)
        self._live.update(Group(table, Text(self._line)), refresh=True)

    def close(self) -> None:
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted = []
        self._live.stop()


def make_view(stream: TextIO | None = None) -> ProgressView:
    """The live table on a terminal (stderr, not TERM=dumb), plain lines otherwise."""
    stream = sys.stderr if stream is None else stream
    if stream.isatty() and os.environ.get("TERM") != "dumb":
        return LiveTableView()
    return PlainView()


class RunProgress:
    def __init__(self, metrics: MetricsLogger, *, view: ProgressView | None = None, controller: Any = None,
                 dump: RolloutDump | None = None, clock: Callable[[], float] = time.monotonic,
                 latest_checkpoint: Callable[[str], Path | None] | None = None) -> None:
        self.metrics = metrics
        self.view = view if view is not None else PlainView()
        self.controller = controller
        """Controller actor handle that takes `observe_rollout(gauges)`; None: not reported."""
        self.dump = dump
        """`--dump-details`: takes every trained batch (its owner closes it); None: no dump."""
        self.clock = clock
        self.latest_checkpoint = latest_checkpoint
        """Where an adapter's save directory resumes from (`TrainingBackend.latest_checkpoint`),
        shown in the summary; None: not shown."""
        self.adapters: dict[str, AdapterProgress] = {}
        self._last_idle_log = float("-inf")
        self._start = clock()

    def declare(self, snapshot: MultiLoRASnapshot) -> None:
        """Follow the snapshot: new adapters, re-registrations (new num_step, save), states, steps."""
        self._follow(snapshot)
        self.view.show(self.rows(), None)

    def _follow(self, snapshot: MultiLoRASnapshot) -> None:
        views = {AdapterState.PENDING: snapshot.pending, AdapterState.ACTIVE: snapshot.active,
                 AdapterState.RETIRING: snapshot.retiring}
        for state, runs in views.items():
            for name, run in runs.items():
                entry = self.adapters.get(name)
                save_dir = None if run.config.save is None else str(run.config.save)
                if entry is None:
                    entry = self.adapters[name] = AdapterProgress(name, run.registration_id, save_dir,
                                                                  run.final_step, rate=SampleRate(since=self.clock()))
                    logger.info("Adapter %r in slot %d (save: %s)", name, run.slot, save_dir)
                elif entry.registration_id != run.registration_id:
                    logger.info("Adapter %r registered again in slot %d (save: %s)", name, run.slot, save_dir)
                    entry.window.drop()  # a partial step of the previous registration is never logged
                entry.registration_id, entry.save_dir, entry.final_step = run.registration_id, save_dir, run.final_step
                entry.step, entry.state = run.step, state
        for name, client in snapshot.clients.items():
            entry = self.adapters.get(name)
            if entry is None:
                entry = self.adapters[name] = AdapterProgress(name, client.registration_id, None, None,
                                                              kind=AdapterKind.CLIENT,
                                                              rate=SampleRate(since=self.clock()))
                logger.info("Client-driven adapter %r (Tinker model %s) in slot %d", name, client.config.model_id,
                            client.slot)
            elif entry.registration_id != client.registration_id:
                entry.client.drop()
                entry.registration_id = client.registration_id
            entry.step, entry.state, entry.resume_from = client.step, client.state, client.resume_from
        for state, names in ((AdapterState.CLEANUP, snapshot.cleanup), (AdapterState.COMPLETED, snapshot.completed),
                             (AdapterState.FAILED, snapshot.failed)):
            for name in names:
                if name in self.adapters:
                    self.adapters[name].state = state

    def idle(self, poll_s: float) -> None:
        now = self.clock()
        if now - self._last_idle_log >= 60.0:
            logger.info("No adapters registered; waiting (polling every %.1fs). "
                        "Register one with POST /adapter_runs.", poll_s)
            self._last_idle_log = now

    async def record(self, rollout_id: int, rollout: RolloutBatch, trained: TrainedBatch,
                     snapshot: MultiLoRASnapshot, perf: dict[str, float]) -> None:
        """Account one trained batch; `snapshot` is the one taken after the commit."""
        self._follow(snapshot)
        now = self.clock()
        for name, stats in rollout.per_adapter.items():
            entry = self.adapters.get(name)
            if entry is None:
                continue
            train = trained.result.adapters.get(name)
            entry.window.add(stats, train)
            if train is not None:
                entry.rate.add(now, train.samples)
        for name, step in sorted(trained.steps.items()):
            entry = self.adapters.get(name)
            if entry is not None:
                metrics = {**self._step_metrics(entry), **step.to_metrics(), **self._rate_metrics(entry, now)}
                self.metrics.log_adapter(name, metrics, step=entry.step)
        loop = {**rollout.stats.to_metrics(), "perf/train_samples": float(trained.result.samples), **perf}
        self.metrics.log_loop(loop, rollout_id=rollout_id, batch=batch_composition(rollout))
        if self.dump is not None:
            self.dump.submit(rollout, snapshot)
        self.view.show(self.rows(), self._batch_line(rollout_id, rollout, perf))
        if self.controller is not None:
            await self.controller.observe_rollout.remote(self.gauges(rollout))

    @staticmethod
    def _rate_metrics(entry: AdapterProgress, now: float) -> dict[str, float]:
        rate = entry.rate.per_s(now)
        return {} if rate is None else {"perf/samples_per_s": rate}

    def _step_metrics(self, entry: AdapterProgress) -> dict[str, float]:
        """The adapter record of the step `entry` just took; starts the next step's accumulation."""
        rollout = entry.window.rollout
        if rollout is not None and rollout.raw_reward_mean is not None:
            entry.rewards.append(rollout.raw_reward_mean)
        metrics = entry.window.close()
        if "loss" in metrics:
            entry.losses.append(metrics["loss"])
        return metrics

    async def record_clients(self, reports: list[ClientModelReport], perf: dict[str, float] | None = None) -> None:
        """Account what client-driven adapters' commands came to (`ClientCommands.finish`): one
        adapter record per `optim_step` that ran. `perf`: the stage times of an iteration that
        ran client work alone (shown on its line; it has no loop record)."""
        now = self.clock()
        stepped: list[AdapterProgress] = []
        for report in reports:
            entry = self.adapters.get(report.model)
            if entry is None or entry.registration_id != report.registration_id:
                continue
            entry.client.add(report)
            datums = sum(call.datums for call in report.calls)
            if datums:
                entry.rate.add(now, datums)
            if report.step is None:
                continue
            entry.step += 1  # the registry stepped it when the step's future completed
            metrics = {**entry.client.close(report.step), **self._rate_metrics(entry, now)}
            if "loss:sum" in metrics:
                entry.losses.append(metrics["loss:sum"])
            self.metrics.log_adapter(entry.name, metrics, step=entry.step, adapter_kind=AdapterKind.CLIENT)
            stepped.append(entry)
        self.view.show(self.rows(), self._clients_line(stepped, perf or {}) if stepped else None)
        if self.controller is not None and stepped:
            await self.controller.observe_rollout.remote({
                entry.name: AdapterGauges(registration_id=entry.registration_id, raw_reward_mean=None,
                                          groups_buffered=None, client_loss=entry.losses[-1] if entry.losses else None)
                for entry in stepped})

    def gauges(self, rollout: RolloutBatch) -> dict[str, AdapterGauges]:
        """Each adapter's latest step reward and buffered groups (for the controller's `/metrics`)."""
        return {
            name: AdapterGauges(registration_id=entry.registration_id,
                                raw_reward_mean=entry.rewards[-1] if entry.rewards else None,
                                groups_buffered=stats.queue_length)
            for name, stats in rollout.per_adapter.items()
            if (entry := self.adapters.get(name)) is not None
        }

    def rows(self) -> list[AdapterRow]:
        now = self.clock()
        rows = []
        for entry in sorted(self.adapters.values(), key=lambda e: e.name):
            total = "" if entry.final_step is None else f"/{entry.final_step}"
            rate = entry.rate.per_s(now)
            rows.append(AdapterRow(
                name=entry.name,
                kind=entry.kind.value,
                state=entry.state.value.lower(),
                step=f"{entry.step}{total}",
                reward=_fmt(entry.rewards[-1] if entry.rewards else None),
                loss=_fmt(entry.losses[-1] if entry.losses else None),
                samples_per_s="-" if rate is None else f"{rate:.1f}",
            ))
        return rows

    def _batch_line(self, rollout_id: int, rollout: RolloutBatch, perf: dict[str, float]) -> str:
        parts = []
        for name, groups in sorted(rollout.groups_per_adapter.items()):
            entry = self.adapters.get(name)
            if entry is None:
                continue
            total = "" if entry.final_step is None else f"/{entry.final_step}"
            reward = f" reward={entry.rewards[-1]:.3f}" if entry.rewards else ""
            parts.append(f"{name}: step {entry.step}{total} groups={groups}{reward}")
        return f"rollout {rollout_id} | {'; '.join(parts) or 'no groups'} | {_times(perf)}"

    def _clients_line(self, stepped: list[AdapterProgress], perf: dict[str, float]) -> str:
        parts = []
        for entry in sorted(stepped, key=lambda e: e.name):
            loss = f" loss:sum={entry.losses[-1]:.3f}" if entry.losses else ""
            parts.append(f"{entry.name}: step {entry.step}{loss}")
        times = _times(perf)
        return f"clients | {'; '.join(parts)}" + (f" | {times}" if times else "")

    def close(self) -> None:
        """Stop the live view (idempotent); the summary prints after it."""
        self.view.close()
        self.view = PlainView()

    def summary_rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        for entry in sorted(self.adapters.values(), key=lambda e: e.name):
            if entry.kind is AdapterKind.CLIENT:
                checkpoint = entry.resume_from or "-"
            else:
                checkpoint = self._latest_checkpoint(entry.save_dir)
            rows.append((
                entry.name,
                entry.kind.value,
                _fmt(_mean_head(entry.rewards)),
                _fmt(_mean_tail(entry.rewards)),
                _fmt(_mean_head(entry.losses)),
                _fmt(_mean_tail(entry.losses)),
                str(entry.step),
                checkpoint,
            ))
        return rows

    def _latest_checkpoint(self, save_dir: str | None) -> str:
        if save_dir is None or self.latest_checkpoint is None:
            return "-"
        return str(self.latest_checkpoint(save_dir) or "-")

    def print_summary(self) -> None:
        self.close()
        rows = self.summary_rows()
        if not rows:
            return
        header = ("adapter", "kind", "reward start", "reward end", "loss start", "loss end", "steps", "checkpoint")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
        elapsed = self.clock() - self._start
        print(f"\nPer-adapter summary ({elapsed:.0f}s; metrics: {self.metrics.path})")
        print("\n".join(lines), flush=True)


def batch_composition(rollout: RolloutBatch) -> dict[str, dict[str, int]]:
    """The loop record's `batch`: each adapter's prompt groups and samples in the batch."""
    samples = rollout.samples_per_adapter()
    return {name: {"groups": groups, "samples": samples.get(name, 0)}
            for name, groups in sorted(rollout.groups_per_adapter.items())}


def _merge_train(stats: list[AdapterTrainStats]) -> dict[str, float]:
    """Train numbers of one step's batches: per-sample means weighted by samples, samples added."""
    samples = sum(s.samples for s in stats)
    if samples == 0:
        return {}
    merged: dict[str, float] = {}
    for s in stats:
        for key, value in s.to_metrics().items():
            merged[key] = merged.get(key, 0.0) + value * s.samples / samples
    return {**merged, "train_samples": float(samples)}


def _times(perf: dict[str, float]) -> str:
    """`generate=1.50s train=0.25s`: the stage times among `perf`."""
    return " ".join(f"{k.removeprefix('perf/').removesuffix('_time')}={v:.2f}s" for k, v in perf.items()
                    if k.endswith("_time"))


def _window(values: list[float]) -> int:
    return max(1, min(5, len(values) // 4 or 1))


def _mean_head(values: list[float]) -> float | None:
    return sum(values[: _window(values)]) / _window(values) if values else None


def _mean_tail(values: list[float]) -> float | None:
    return sum(values[-_window(values):]) / _window(values) if values else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
