"""The trainer's progress over a run: `RunProgress` follows the snapshots, writes the
metrics records, feeds the view and tells the controller each adapter's latest numbers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.main.client_commands import ClientModelReport
from miles.main.progress.console import (
    AdapterRow,
    PlainView,
    ProgressView,
    batch_line,
    clients_line,
    print_summary,
    summary_rows,
    table_rows,
)
from miles.main.progress.metrics import AdapterProgress, SampleRate, batch_composition
from miles.main.rollout_dump import RolloutDump
from miles.main.train_step import TrainedBatch
from miles.utils.tracking import MetricsLogger
from miles.utils.types import AdapterGauges, AdapterKind, AdapterState, MultiLoRASnapshot, RolloutBatch

logger = logging.getLogger(__package__)


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
        self.view.show(self.rows(), batch_line(self.adapters, rollout_id, rollout, perf))
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
        self.view.show(self.rows(), clients_line(stepped, perf or {}) if stepped else None)
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
        return table_rows(self.adapters.values(), self.clock())

    def close(self) -> None:
        """Stop the live view (idempotent); the summary prints after it."""
        self.view.close()
        self.view = PlainView()

    def summary_rows(self) -> list[tuple[str, ...]]:
        return summary_rows(self.adapters.values(), self.latest_checkpoint)

    def print_summary(self) -> None:
        self.close()
        rows = self.summary_rows()
        if rows:
            print_summary(rows, self.clock() - self._start, self.metrics.path)
