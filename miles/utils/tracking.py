"""Metrics and stage timing for the drivers.

`MetricsLogger` writes every record to `{run_dir}/metrics.jsonl` (always), to
TensorBoard when it is installed, and to Weights & Biases with `--use-wandb`.
Per-adapter metrics use the key prefix `{adapter}/` and are stepped on the key
`{adapter}/step`; loop-wide ones use `perf/` and the rollout id.

`StageTimer` names and times each stage of a loop iteration:

    timer = StageTimer()
    with timer("generate"):
        rollout = await manager.generate.remote(rollout_id)
    logger.log(timer.pop_metrics(), step=rollout_id)   # {"perf/generate_time": 1.23}
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class StageTimer:
    """Accumulates wall time per named stage until `pop_metrics()`."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + time.perf_counter() - start

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
                 wandb_project: str | None = None, run_name: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._tb = self._open_tensorboard()
        self._wandb = self._open_wandb(wandb_project, run_name) if use_wandb else None

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def _open_wandb(self, project: str | None, run_name: str | None) -> Any:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("--use-wandb needs the wandb package: pip install wandb") from exc
        wandb.init(project=project or "miles-multi-lora", name=run_name, dir=str(self.run_dir))
        return wandb

    def log(self, metrics: dict[str, Any], *, step: int, step_key: str = "rollout_id") -> None:
        values = _clean(metrics)
        if not values:
            return
        record = {step_key: step, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log({**values, step_key: step})

    def log_adapter(self, adapter: str, metrics: dict[str, Any], *, step: int) -> None:
        """Metrics of one adapter, keyed `{adapter}/...` on the step key `{adapter}/step`."""
        prefixed = {k if k.startswith(f"{adapter}/") else f"{adapter}/{k}": v for k, v in metrics.items()}
        self.log(prefixed, step=step, step_key=f"{adapter}/step")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def split_adapter_metrics(metrics: dict[str, float], adapters: list[str]) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Split a flat metric dict into per-adapter dicts and the rest."""
    per_adapter: dict[str, dict[str, float]] = {name: {} for name in adapters}
    rest: dict[str, float] = {}
    for key, value in metrics.items():
        head, _, tail = key.partition("/")
        if tail and head in per_adapter:
            per_adapter[head][key] = value
        else:
            rest[key] = value
    return per_adapter, rest


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (for plots and end-of-run tables)."""
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]
