"""Adapter checkpoints: a PEFT directory plus the optimizer and schedule state to resume.

Layout under an adapter's save directory:

    {save}/checkpoints/step_{N}/
        adapter_model.safetensors  adapter_config.json   # PEFT, loadable as is
        optimizer.safetensors                             # this adapter's AdamW moments
        optimizer.json  scheduler.json  trainer_state.json

A checkpoint is written into a temporary directory next to its final place and
renamed into place, so `latest_checkpoint` never sees a partial one. Nothing is
pickled: tensors are safetensors, scalars JSON.

    path = write_checkpoint(save, 3, write_adapter=..., optimizer=..., scheduler=..., trainer_state=...)
    latest_checkpoint(save)  # -> {save}/checkpoints/step_3
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from miles.utils.types import DataPosition

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_SCALARS = "optimizer.json"
SCHEDULER = "scheduler.json"
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
COMPLETE_MARKERS = (TRAINER_STATE, OPTIMIZER_TENSORS, OPTIMIZER_SCALARS, SCHEDULER, *PEFT_FILES)


@dataclass(frozen=True)
class TrainerState:
    """`trainer_state.json`: who the checkpoint belongs to and how far it got."""

    name: str
    step: int
    registration_id: str
    rank: int
    alpha: float
    data_position: DataPosition | None = None
    """Where the adapter's dataset continues (None: not recorded; a resume starts it over)."""


@dataclass
class OptimizerState:
    """One adapter's AdamW state, tensors keyed by LoRA parameter name (rank-sliced)."""

    exp_avg: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    step: int
    hyper: dict[str, Any] = field(default_factory=dict)
    """lr, weight_decay, betas, eps: recorded for inspection; the resumed run's config wins."""


@dataclass
class Checkpoint:
    path: Path
    trainer_state: TrainerState
    optimizer: OptimizerState
    scheduler: dict[str, Any]


def checkpoints_root(save_dir: str | Path) -> Path:
    return Path(save_dir) / "checkpoints"


def write_checkpoint(
    save_dir: str | Path,
    step: int,
    *,
    write_adapter: Callable[[Path], object],
    optimizer: OptimizerState,
    scheduler: dict[str, Any],
    trainer_state: TrainerState,
) -> Path:
    """Write `{save_dir}/checkpoints/step_{step}` atomically (replacing one of that step)."""
    root = checkpoints_root(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}-{uuid.uuid4().hex}"
    try:
        write_adapter(tmp)  # creates `tmp` (a PEFT writer places its directory itself)
        missing = [name for name in PEFT_FILES if not (tmp / name).is_file()]
        if missing:
            raise RuntimeError(f"the adapter writer did not produce {missing} in {tmp}")
        tensors = {f"exp_avg.{k}": v.contiguous() for k, v in optimizer.exp_avg.items()}
        tensors.update({f"exp_avg_sq.{k}": v.contiguous() for k, v in optimizer.exp_avg_sq.items()})
        save_file(tensors, str(tmp / OPTIMIZER_TENSORS))
        _write_json(tmp / OPTIMIZER_SCALARS, {"step": optimizer.step, "hyper": optimizer.hyper})
        _write_json(tmp / SCHEDULER, scheduler)
        _write_json(tmp / TRAINER_STATE, asdict(trainer_state))
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The complete `step_N` directory with the highest N, or None."""
    root = checkpoints_root(save_dir)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if not match or not child.is_dir():
            continue
        if not all((child / name).is_file() for name in COMPLETE_MARKERS):
            continue
        step = int(match.group(1))
        if best is None or step > best[0]:
            best = (step, child)
    return best[1] if best else None


def read_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    missing = [name for name in COMPLETE_MARKERS if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a complete checkpoint: missing {missing}")
    tensors = load_file(str(path / OPTIMIZER_TENSORS))
    scalars = _read_json(path / OPTIMIZER_SCALARS)
    optimizer = OptimizerState(
        exp_avg={k.removeprefix("exp_avg."): v for k, v in tensors.items() if k.startswith("exp_avg.")},
        exp_avg_sq={k.removeprefix("exp_avg_sq."): v for k, v in tensors.items() if k.startswith("exp_avg_sq.")},
        step=int(scalars["step"]),
        hyper=scalars.get("hyper", {}),
    )
    return Checkpoint(
        path=path,
        trainer_state=_trainer_state(_read_json(path / TRAINER_STATE)),
        optimizer=optimizer,
        scheduler=_read_json(path / SCHEDULER),
    )


def _trainer_state(raw: dict[str, Any]) -> TrainerState:
    position = raw.pop("data_position", None)
    return TrainerState(**raw, data_position=None if position is None else DataPosition.from_dict(position))


def _replace_dir(tmp: Path, final: Path) -> None:
    # A directory cannot be renamed over a non-empty one: move the old one aside first,
    # so at every moment either the old or the new complete checkpoint is in place.
    trash = None
    if final.exists():
        trash = final.with_name(f".old-{final.name}-{uuid.uuid4().hex}")
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash)


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
