"""Adapter checkpoints: a PEFT directory plus the optimizer and schedule state to resume.

Layout under an adapter's save directory:

    {save}/checkpoints/step_{N}/
        adapter_model.safetensors  adapter_config.json   # PEFT, loadable as is
        optimizer.safetensors                             # this adapter's AdamW moments
        optimizer.json  scheduler.json  trainer_state.json
        accumulated_grad.safetensors                      # only mid-window, see below

A checkpoint written while the adapter is part way through a step's window (some of its
`rollout_batch_size` groups trained, no step yet) also holds the gradient of those groups,
summed over the data-parallel ranks and not yet scaled, keyed like the moments; its
`trainer_state.json` says how many groups and samples it covers. A resume puts it back
and the registry's count with it, so the next step is the one an uninterrupted run takes.

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
ACCUMULATED_GRAD = "accumulated_grad.safetensors"
PENDING_GRAD = "pending_grad.safetensors"
"""A client-driven model paged out of its slot: the gradient of its forward_backward calls not
yet stepped (a client's own `save_state` never writes it)."""
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
    accumulated_groups: int = 0
    """Prompt groups trained toward step `step + 1` whose gradient `accumulated_grad.safetensors`
    holds (0: none, the file is absent). They lie before `data_position`."""
    accumulated_samples: int = 0
    """The samples of those groups (what the gradient is summed over)."""

    def __post_init__(self) -> None:
        if self.accumulated_groups < 0 or self.accumulated_samples < 0 or \
                (self.accumulated_groups == 0) != (self.accumulated_samples == 0):
            raise ValueError(f"accumulated groups and samples must both be 0 or both > 0, got "
                             f"{self.accumulated_groups} groups, {self.accumulated_samples} samples")


@dataclass
class OptimizerState:
    """One adapter's AdamW state, tensors keyed by LoRA parameter name (rank-sliced)."""

    exp_avg: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    step: int
    hyper: dict[str, Any] = field(default_factory=dict)
    """lr, weight_decay, betas, eps: recorded for inspection; the resumed run's config wins."""


@dataclass
class AccumulatedGrad:
    """An adapter's gradient toward its next step, summed over every rank and sample so far
    (not yet divided by the global batch size), with what it covers."""

    tensors: dict[str, Tensor]
    """By LoRA parameter name, rank-sliced (whole HF shapes, like `OptimizerState`'s moments)."""
    groups: int
    """Prompt groups it covers, as the registry counts them."""
    samples: int

    def __post_init__(self) -> None:
        if self.groups <= 0 or self.samples <= 0:
            raise ValueError("an accumulated gradient covers > 0 groups and samples, "
                             f"got {self.groups}, {self.samples}")


@dataclass
class Checkpoint:
    path: Path
    trainer_state: TrainerState
    optimizer: OptimizerState
    scheduler: dict[str, Any]
    accumulated_grad: AccumulatedGrad | None = None
    """The gradient of the groups trained since step `trainer_state.step`; None: none."""


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
    accumulated_grad: AccumulatedGrad | None = None,
) -> Path:
    """Write `{save_dir}/checkpoints/step_{step}` atomically (replacing one of that step).

    With `accumulated_grad`, `trainer_state` must record the same groups and samples."""
    return write_checkpoint_dir(checkpoints_root(save_dir) / f"step_{step}", write_adapter=write_adapter,
                                optimizer=optimizer, scheduler=scheduler, trainer_state=trainer_state,
                                accumulated_grad=accumulated_grad)


def write_checkpoint_dir(
    final: str | Path,
    *,
    write_adapter: Callable[[Path], object],
    optimizer: OptimizerState,
    scheduler: dict[str, Any],
    trainer_state: TrainerState,
    accumulated_grad: AccumulatedGrad | None = None,
    pending_grad: dict[str, Tensor] | None = None,
) -> Path:
    """Write a checkpoint to the directory `final` atomically (replacing one there): what
    `write_checkpoint` writes under its step's name, and a client's `save_state` where it asks;
    with `pending_grad`, a client model's page-out (`PENDING_GRAD`)."""
    covered = (0, 0) if accumulated_grad is None else (accumulated_grad.groups, accumulated_grad.samples)
    if covered != (trainer_state.accumulated_groups, trainer_state.accumulated_samples):
        raise ValueError(f"the trainer state records {trainer_state.accumulated_groups} accumulated groups, "
                         f"{trainer_state.accumulated_samples} samples, but the gradient given covers {covered}")
    final = Path(final)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex}"
    try:
        write_adapter(tmp)  # creates `tmp` (a PEFT writer places its directory itself)
        missing = [name for name in PEFT_FILES if not (tmp / name).is_file()]
        if missing:
            raise RuntimeError(f"the adapter writer did not produce {missing} in {tmp}")
        tensors = {f"exp_avg.{k}": v.contiguous() for k, v in optimizer.exp_avg.items()}
        tensors.update({f"exp_avg_sq.{k}": v.contiguous() for k, v in optimizer.exp_avg_sq.items()})
        save_file(tensors, str(tmp / OPTIMIZER_TENSORS))
        if accumulated_grad is not None:
            save_file({k: v.contiguous() for k, v in accumulated_grad.tensors.items()}, str(tmp / ACCUMULATED_GRAD))
        if pending_grad is not None:
            save_file({k: v.contiguous() for k, v in pending_grad.items()}, str(tmp / PENDING_GRAD))
        _write_json(tmp / OPTIMIZER_SCALARS, {"step": optimizer.step, "hyper": optimizer.hyper})
        _write_json(tmp / SCHEDULER, scheduler)
        _write_json(tmp / TRAINER_STATE, asdict(trainer_state))
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_pending_grad(path: str | Path) -> dict[str, Tensor] | None:
    """The pending gradient a page-out wrote in the checkpoint `path`; None: it holds none."""
    file = Path(path) / PENDING_GRAD
    return load_file(str(file)) if file.is_file() else None


def _step_dirs(save_dir: str | Path) -> list[Path]:
    """The `step_N` directories under `save_dir`'s checkpoints, highest N first."""
    root = checkpoints_root(save_dir)
    if not root.is_dir():
        return []
    steps = [(int(match.group(1)), child) for child in root.iterdir()
             if (match := STEP_DIR.match(child.name)) and child.is_dir()]
    return [child for _, child in sorted(steps, reverse=True)]


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The complete `step_N` directory with the highest N, or None."""
    return next((child for child in _step_dirs(save_dir) if not _missing_files(child)), None)


MILES_SHARD = re.compile(r"^adapter_megatron_tp\d+_pp\d+(_ep\d+)?\.pt$")
"""A per-rank Megatron shard of a checkpoint written by Miles' multi-LoRA trainer."""


def latest_miles_checkpoint(save_dir: str | Path) -> Path | None:
    """The `step_N` directory with the highest N that Miles' multi-LoRA trainer wrote (its
    PEFT files beside its Megatron shards, none of our trainer state), or None. An adapter
    with no checkpoint of ours starts from its weights."""
    return next((child for child in _step_dirs(save_dir)
                 if all((child / name).is_file() for name in PEFT_FILES) and not (child / TRAINER_STATE).exists()
                 and any(MILES_SHARD.match(f.name) for f in child.iterdir())), None)


def checkpoint_step(path: Path) -> int:
    """N of a `step_N` directory."""
    match = STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a step_N checkpoint directory")
    return int(match.group(1))


def _missing_files(path: Path) -> list[str]:
    """The files a complete checkpoint at `path` has and it lacks (the gradient file when
    its trainer state counts accumulated groups)."""
    missing = [name for name in COMPLETE_MARKERS if not (path / name).is_file()]
    if missing:
        return missing
    try:
        groups = _read_json(path / TRAINER_STATE).get("accumulated_groups", 0)
    except (OSError, ValueError, AttributeError):
        return [TRAINER_STATE]
    return [ACCUMULATED_GRAD] if groups and not (path / ACCUMULATED_GRAD).is_file() else []


def read_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    missing = _missing_files(path)
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
    state = _trainer_state(_read_json(path / TRAINER_STATE))
    accumulated = None
    if state.accumulated_groups:
        accumulated = AccumulatedGrad(load_file(str(path / ACCUMULATED_GRAD)), groups=state.accumulated_groups,
                                      samples=state.accumulated_samples)
    return Checkpoint(path=path, trainer_state=state, optimizer=optimizer, scheduler=_read_json(path / SCHEDULER),
                      accumulated_grad=accumulated)


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
