"""Metrics and stage timing for the drivers.

Two kinds of record, never mixed, so no adapter name can land on a loop metric:
- loop records (`MetricsLogger.log_loop`): the loop's own metrics (`perf/...`), one per
  rollout, stepped on the rollout id;
- adapter records (`MetricsLogger.log_adapter`): one adapter's metrics, stepped on that
  adapter's own step; the adapter is a field of the record, not part of a name.

`{run_dir}/metrics.jsonl` (always) holds one JSON object per record:

    {"kind": "loop", "rollout_id": 7, "time": ..., "metrics": {"perf/train_time": 1.2},
     "batch": {"a": {"groups": 2, "samples": 8}}}
    {"kind": "adapter", "adapter": "perf", "adapter_kind": "server", "step": 3, "time": ...,
     "metrics": {"raw_reward_mean": 0.5, "perf/samples_per_s": 12.5}}

`time` is Unix seconds. A loop record's `batch` is the trained batch's composition: its
prompt groups and samples per adapter (only in metrics.jsonl: adapter names never become
scalar names). `adapter_kind` says who drives the adapter: `server` (RL on its dataset) or
`client` (a Tinker model, whose records carry its forward_backward metrics and Adam
settings instead). An adapter record's `perf/samples_per_s` is the adapter's trained
samples (a client's datums) per second over its latest batches, when known.

TensorBoard (when installed) and W&B (`--use-wandb`) need flat names: loop metrics keep
theirs (W&B plots `perf/*` against `rollout_id`), adapter metrics become
`adapters/{adapter}/{metric}`, which W&B plots against `adapters/{adapter}/step`
(`define_metric`) and TensorBoard against the adapter's step. A loop metric may not
start with `adapters/`, so an adapter called `perf` (or anything) never meets them.
`--metrics-naming miles` names them as Miles does instead, `{adapter}/{metric}` against
`{adapter}/step`, so dashboards built for Miles read them (an adapter named like a loop
namespace, `perf`, then shares it, as in Miles). `metrics.jsonl` is the same either way.

`StageTimer` names and times each stage of a loop iteration:

    timer = StageTimer()
    with timer("generate"):
        rollout = await manager.generate.remote(rollout_id)
    logger.log_loop(timer.pop_metrics(), rollout_id=rollout_id)   # {"perf/generate_time": 1.23}
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles.utils.types import AdapterKind

logger = logging.getLogger(__name__)

ADAPTER_NAMESPACE = "adapters/"
METRICS_NAMINGS = ("ours", "miles")
"""Flat names of adapter metrics start with it; loop metrics never do."""

LOOP_STEP_KEY = "rollout_id"
"""W&B step metric of the loop's records."""


class StageTimer:
    """Accumulates wall time per named stage until `pop_metrics()`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + self._clock() - start

    def pop_metrics(self) -> dict[str, float]:
        metrics = {f"perf/{stage}_time": seconds for stage, seconds in self._seconds.items()}
        self._seconds.clear()
        return metrics


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    """Numbers only; NaN/inf dropped so the JSONL stays valid JSON."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class MetricsLogger:
    """Fan-out of metric records to JSONL, TensorBoard and (optionally) W&B."""

    def __init__(self, run_dir: Path | str, *, use_wandb: bool = False,
                 wandb_project: str | None = None, run_name: str | None = None, wandb_group: str | None = None,
                 wandb_key: str | None = None, wandb_random_suffix: bool = True, naming: str = "ours") -> None:
        if naming not in METRICS_NAMINGS:
            raise ValueError(f"metrics naming must be one of {METRICS_NAMINGS}, got {naming!r}")
        self.naming = naming
        """How adapter metrics are named in TensorBoard and W&B (`adapter_metric_name`)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._tb = self._open_tensorboard()
        self._wandb = (self._open_wandb(wandb_project, run_name, wandb_group, wandb_key, wandb_random_suffix)
                       if use_wandb else None)
        self._wandb_defined: set[str] = set()
        """Names (and globs) already given their step metric."""

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    @classmethod
    def from_config(cls, cfg: Any) -> MetricsLogger:
        """The logger of a run: `--use-wandb`, `--wandb-project`, `--wandb-group`, `--wandb-key`
        and `--disable-wandb-random-suffix` mean what they mean in Miles."""
        return cls(cfg.resolved_run_dir, use_wandb=cfg.use_wandb, wandb_project=cfg.wandb_project,
                   wandb_group=cfg.wandb_group, wandb_key=cfg.wandb_key,
                   wandb_random_suffix=not cfg.disable_wandb_random_suffix, naming=cfg.metrics_naming)

    def _open_wandb(self, project: str | None, run_name: str | None, group: str | None, key: str | None,
                    random_suffix: bool) -> Any:
        """As Miles: log in with the key if given; the group gets a random suffix unless
        disabled, and names the run when no run name is given."""
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("--use-wandb needs the wandb package: pip install wandb") from exc
        if key is not None:
            wandb.login(key=key)
        if group is not None and random_suffix:
            group = f"{group}_{wandb.util.generate_id()}"
        wandb.init(project=project or "miles-multi-lora", group=group, name=run_name or group, dir=str(self.run_dir))
        return wandb

    def log_loop(self, metrics: dict[str, Any], *, rollout_id: int,
                 batch: dict[str, dict[str, int]] | None = None) -> None:
        """The loop's own metrics of one rollout; `batch` (its composition, adapter ->
        {"groups", "samples"}) goes into metrics.jsonl only, never into a scalar's name."""
        values = _clean(metrics)
        clashing = sorted(k for k in values if k.startswith(ADAPTER_NAMESPACE))
        if clashing:
            raise ValueError(f"loop metrics may not start with {ADAPTER_NAMESPACE!r}: {clashing}")
        if not values:
            return
        record: dict[str, Any] = {"kind": "loop", "rollout_id": rollout_id, "time": time.time(), "metrics": values}
        if batch is not None:
            record["batch"] = batch
        self._write(record)
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=rollout_id)
        if self._wandb is not None:
            self._define_wandb_axis(LOOP_STEP_KEY, "perf/*", values)
            self._wandb.log({**values, LOOP_STEP_KEY: rollout_id})

    def log_adapter(self, adapter: str, metrics: dict[str, Any], *, step: int,
                    adapter_kind: AdapterKind = AdapterKind.SERVER) -> None:
        """One adapter's metrics (names without the adapter) at the adapter's step."""
        values = _clean(metrics)
        if not values:
            return
        self._write({"kind": "adapter", "adapter": adapter, "adapter_kind": adapter_kind.value, "step": step,
                     "time": time.time(), "metrics": values})
        flat = {adapter_metric_name(adapter, key, self.naming): value for key, value in values.items()}
        if self._tb is not None:
            for key, value in flat.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            step_key = adapter_metric_name(adapter, "step", self.naming)
            self._define_wandb_axis(step_key, adapter_metric_name(adapter, "*", self.naming), flat)
            self._wandb.log({**flat, step_key: step})

    def _define_wandb_axis(self, step_key: str, glob: str, flat: dict[str, float]) -> None:
        """Plot `glob` (and every name in `flat`) against `step_key`. A W&B glob's `*` spans
        one path segment, so names nested deeper than the glob are defined one by one."""
        if glob not in self._wandb_defined:
            self._wandb.define_metric(step_key)
            self._wandb.define_metric(glob, step_metric=step_key)
            self._wandb_defined.add(glob)
        depth = glob.count("/")
        for key in flat:
            if key.count("/") > depth and key not in self._wandb_defined:
                self._wandb.define_metric(key, step_metric=step_key)
                self._wandb_defined.add(key)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def adapter_metric_name(adapter: str, metric: str, naming: str = "ours") -> str:
    """The flat name of an adapter's metric (TensorBoard, W&B): `adapters/{adapter}/{metric}`,
    or Miles' `{adapter}/{metric}` with naming "miles"."""
    return f"{adapter}/{metric}" if naming == "miles" else f"{ADAPTER_NAMESPACE}{adapter}/{metric}"


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (for plots and end-of-run tables)."""
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def adapter_series(records: list[dict[str, Any]], metric: str) -> dict[str, list[tuple[int, float]]]:
    """adapter -> [(step, value)] of one adapter metric, from `read_metrics` records."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.get("kind") == "adapter" and metric in record["metrics"]:
            series.setdefault(record["adapter"], []).append((record["step"], record["metrics"][metric]))
    return series
