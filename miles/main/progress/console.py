"""What the trainer shows a person: the live table on a terminal, plain log lines
otherwise, and the per-adapter table it ends with.

`make_view` picks `LiveTableView` (a rich table redrawn in place, log lines scrolling above
it) or `PlainView` (one log line per trained batch); `table_rows`, `batch_line` and
`clients_line` say what they show, `summary_rows` and `print_summary` the end-of-run table.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from miles.main.progress.metrics import AdapterProgress
from miles.utils.types import AdapterKind, RolloutBatch

logger = logging.getLogger(__package__)

SUMMARY_HEADER = ("adapter", "kind", "reward start", "reward end", "loss start", "loss end", "steps", "checkpoint")


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


def table_rows(adapters: Iterable[AdapterProgress], now: float) -> list[AdapterRow]:
    """The live table: one row per adapter, by name."""
    rows = []
    for entry in sorted(adapters, key=lambda e: e.name):
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


def batch_line(adapters: dict[str, AdapterProgress], rollout_id: int, rollout: RolloutBatch,
               perf: dict[str, float]) -> str:
    """One trained batch: each adapter's step, groups and latest reward, and the stage times."""
    parts = []
    for name, groups in sorted(rollout.groups_per_adapter.items()):
        entry = adapters.get(name)
        if entry is None:
            continue
        total = "" if entry.final_step is None else f"/{entry.final_step}"
        reward = f" reward={entry.rewards[-1]:.3f}" if entry.rewards else ""
        parts.append(f"{name}: step {entry.step}{total} groups={groups}{reward}")
    return f"rollout {rollout_id} | {'; '.join(parts) or 'no groups'} | {_times(perf)}"


def clients_line(stepped: list[AdapterProgress], perf: dict[str, float]) -> str:
    """The client-driven adapters that stepped in an iteration, with their latest loss."""
    parts = []
    for entry in sorted(stepped, key=lambda e: e.name):
        loss = f" loss:sum={entry.losses[-1]:.3f}" if entry.losses else ""
        parts.append(f"{entry.name}: step {entry.step}{loss}")
    times = _times(perf)
    return f"clients | {'; '.join(parts)}" + (f" | {times}" if times else "")


def summary_rows(adapters: Iterable[AdapterProgress],
                 latest_checkpoint: Callable[[str], Path | None] | None = None) -> list[tuple[str, ...]]:
    """The end-of-run table (`SUMMARY_HEADER`): per adapter, the reward and loss of its first and
    last steps, its steps and its latest checkpoint (`TrainingBackend.latest_checkpoint`; None:
    not shown)."""
    rows: list[tuple[str, ...]] = []
    for entry in sorted(adapters, key=lambda e: e.name):
        if entry.kind is AdapterKind.CLIENT:
            checkpoint = entry.resume_from or "-"
        else:
            found = latest_checkpoint(entry.save_dir) if entry.save_dir and latest_checkpoint else None
            checkpoint = str(found or "-")
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


def print_summary(rows: list[tuple[str, ...]], elapsed: float, metrics_path: object) -> None:
    """Print the end-of-run table (nothing without rows)."""
    if not rows:
        return
    widths = [max(len(r[i]) for r in [SUMMARY_HEADER, *rows]) for i in range(len(SUMMARY_HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [SUMMARY_HEADER, *rows]]
    print(f"\nPer-adapter summary ({elapsed:.0f}s; metrics: {metrics_path})")
    print("\n".join(lines), flush=True)


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
