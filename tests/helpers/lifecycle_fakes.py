"""Small in-process stand-ins for the driver's components, so its loops run without Ray.

- `InProcessHandle(obj)`: `handle.method.remote(*args)` awaits `obj.method(*args)`, the
  way the driver calls a Ray actor handle.
- `InProcessController`: the controller actor's own class (registry included), in-process;
  no Ray, no HTTP, no router.
- `FakeBackend`: a `TrainingBackend` whose "weights" are one number per adapter (the
  samples it has stepped on) and whose "disk" is a dict shared across instances.
- `FakeRollout`: a rollout manager that generates whole groups for every sampleable
  adapter from a per-registration prompt cursor (the data position), records each batch
  with the controller as the collector does, and honours restored positions.
- `RecordingPusher`: the engines' side of pushes; records every pushed LoRA and unload.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.backends.base import (
    AdapterSpec,
    AdapterStepStats,
    AdapterTrainStats,
    LoadResult,
    LoraExport,
    SaveRequest,
    TrainResult,
)
from miles.controller.actor import ControllerConfig, MultiLoRAController
from miles.controller.http_server import HTTPServerConfig
from miles.main.engine_push import PushStats
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.types import (
    AdamStep,
    AdapterRolloutStats,
    ClientWork,
    DataPosition,
    DatumOutput,
    MultiLoRASnapshot,
    RolloutBatch,
    RolloutStats,
    Sample,
)
from miles.utils.types.lifecycle_ops import RecordBatch


class _Method:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    async def remote(self, *args: Any, **kwargs: Any) -> Any:
        out = self._fn(*args, **kwargs)
        return await out if inspect.isawaitable(out) else out


class InProcessHandle:
    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.target, name))


class InProcessController(MultiLoRAController):
    """The controller actor's own class, in-process: no Ray, and no HTTP (`start()` is never
    called). Tests read the registry through `.backend` (plain calls)."""

    def __init__(self, n_slots: int, **defaults: Any) -> None:
        super().__init__(ControllerConfig(n_slots=n_slots, defaults=AdapterDefaults(**defaults),
                                          server=HTTPServerConfig(port=0)))


@dataclass(frozen=True)
class SavedAdapter:
    weights: float
    data_position: DataPosition | None


@dataclass
class FakeBackend:
    """Implements `TrainingBackend`; a slot holds one adapter, checked on every call."""

    disk: dict[str, dict[int, SavedAdapter]] = field(default_factory=dict)
    """save_dir -> step -> what was saved (outlives a backend, like files do)."""
    slots: dict[int, str] = field(default_factory=dict)
    specs: dict[str, AdapterSpec] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    """Samples trained on since the adapter's last step (its retained gradient)."""
    calls: list[tuple[str, str]] = field(default_factory=list)
    client_calls: list[tuple[int, list[str]]] = field(default_factory=list)
    """(rollout id, the adapters of its client work in order) of every train call with client work."""
    client_disk: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    """directory -> (weights, pending count: only a page-out writes it)."""
    """Client `save_state` directory -> the weights saved there."""
    fail_train: bool = False
    fail_client: bool = False
    """When set, a train call that carries client work fails (a client's bad datum)."""
    train_gate: asyncio.Event | None = None
    """When set, `train` waits for it first (lets a test order concurrent work)."""
    training: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a train call starts."""

    async def start(self) -> None:
        self.calls.append(("start", ""))

    async def load_adapter(self, spec: AdapterSpec) -> LoadResult:
        assert spec.slot not in self.slots, f"slot {spec.slot} still holds {self.slots.get(spec.slot)}"
        assert spec.name not in self.specs
        self.calls.append(("load", spec.name))
        self.slots[spec.slot], self.specs[spec.name], self.pending[spec.name] = spec.name, spec, 0
        saved = self.disk.get(spec.save_dir or "", {})
        if not saved:
            self.weights[spec.name] = 0.0
            return LoadResult()
        step = max(saved)
        self.weights[spec.name] = saved[step].weights
        return LoadResult(checkpoint=_step_dir(spec.save_dir, step), step=step,
                          data_position=saved[step].data_position)

    async def cleanup_adapter(self, name: str) -> None:
        self.calls.append(("cleanup", name))
        spec = self.specs.pop(name)
        del self.slots[spec.slot], self.weights[name], self.pending[name]

    async def export_adapter(self, name: str) -> LoraExport:
        self.calls.append(("export", name))
        spec = self.specs[name]
        return LoraExport(peft_config={"r": spec.rank}, tensors={"w": self.weights[name]})

    async def fresh_export(self, spec: AdapterSpec) -> LoraExport | None:
        if self.disk.get(spec.save_dir or ""):
            return None  # `load_adapter` would resume it
        self.calls.append(("fresh_export", spec.name))
        return LoraExport(peft_config={"r": spec.rank}, tensors={"w": 0.0})

    def latest_checkpoint(self, save_dir: str | Path) -> Path | None:
        saved = self.disk.get(str(save_dir), {})
        return _step_dir(str(save_dir), max(saved)) if saved else None

    # Weights-update group: `RecordingPusher` takes exports as they are, so nothing is sent.
    async def update_group_endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    async def join_update_group(self, spec: Any) -> None:
        self.calls.append(("join_update_group", spec.group_name))

    async def leave_update_group(self, group_name: str | None = None) -> None:
        pass

    async def broadcast_adapter(self, export: LoraExport, group_names: Sequence[str], *,
                                bucketed: bool = False) -> dict[str, str]:
        return {}

    async def train(self, rollout_id: int, batch: RolloutBatch, client: Sequence[ClientWork] = ()) -> TrainResult:
        """A client datum's "logprob" of each position is minus its adapter's weights minus one,
        its loss the number of its tokens; a forward_backward adds its datums to the pending count."""
        self.calls.append(("train", str(rollout_id)))
        self.training.set()
        if self.train_gate is not None:
            await self.train_gate.wait()
        if self.fail_train or (self.fail_client and client):
            raise RuntimeError(f"training rollout {rollout_id} failed")
        counts: dict[str, int] = {}
        for sample in batch.samples:
            in_slot = self.slots.get(sample.slot)
            assert in_slot == sample.adapter, f"{sample.adapter} is not loaded in slot {sample.slot}"
            counts[sample.adapter] = counts.get(sample.adapter, 0) + 1
        outputs = []
        for work in client:
            assert self.slots.get(work.slot) == work.adapter, f"{work.adapter} is not loaded in slot {work.slot}"
            outputs.append([DatumOutput({"logprobs": [-self.weights[work.adapter] - 1.0] * len(d.tokens)},
                                        loss=float(len(d.tokens))) for d in work.datums])
            if work.backward:
                counts[work.adapter] = counts.get(work.adapter, 0) + len(work.datums)
        if client:
            self.client_calls.append((rollout_id, [w.adapter for w in client]))
        for name, n in counts.items():
            self.pending[name] += n
        stats = {name: AdapterTrainStats(samples=n, loss=0.5, clip_fraction=0.0, kl=0.0, tis_weight=1.0)
                 for name, n in counts.items() if name in {s.adapter for s in batch.samples}}
        return TrainResult(samples=len(batch.samples), adapters=stats, client=outputs)

    async def step_adapters(self, names: list[str], adam: dict[str, AdamStep] | None = None
                            ) -> dict[str, AdapterStepStats]:
        """A step adds the pending count to the weights (times a client's learning rate)."""
        out = {}
        for name in names:
            lr = adam[name].learning_rate if adam and name in adam else 0.1
            self.weights[name] += self.pending[name] * (lr if adam and name in adam else 1.0)
            out[name] = AdapterStepStats(grad_norm=float(self.pending[name]), lr=lr)
            self.pending[name] = 0
        return out

    async def save_client_state(self, name: str, directory: str, *, pending: bool = False) -> Path:
        self.calls.append(("save_client_state", name))
        self.client_disk[directory] = (self.weights[name], self.pending[name] if pending else None)
        return Path(directory)

    async def load_client_state(self, name: str, directory: str, *, optimizer: bool = True) -> None:
        self.calls.append(("load_client_state", name))
        weights, pending = self.client_disk[directory]
        self.weights[name], self.pending[name] = weights, (pending or 0) if optimizer else 0

    async def save_adapter(self, request: SaveRequest) -> Path:
        spec = self.specs[request.name]
        assert spec.save_dir is not None
        self.disk.setdefault(spec.save_dir, {})[request.step] = SavedAdapter(self.weights[request.name],
                                                                             request.data_position)
        return _step_dir(spec.save_dir, request.step)

    async def shutdown(self) -> None:
        self.calls.append(("shutdown", ""))


def _step_dir(save_dir: str | None, step: int) -> Path:
    return Path(str(save_dir)) / "checkpoints" / f"step_{step}"


@dataclass
class FakeRollout:
    """Generates a full batch of every sampleable adapter per call; prompt k of an
    adapter's stream is group index k (epoch 0), so a test can see where it continues."""

    controller: Any
    positions: dict[str, tuple[str, DataPosition]] = field(default_factory=dict)
    """name -> (registration id, next prompt)."""
    restores: list[tuple[str, str, DataPosition]] = field(default_factory=list)
    group_indices: dict[str, list[int]] = field(default_factory=dict)
    """Group indices generated per adapter, in order."""
    snapshots_given: int = 0

    async def generate(self, rollout_id: int, snapshot: MultiLoRASnapshot | None = None) -> RolloutBatch:
        if snapshot is None:
            snapshot = await self.controller.snapshot.remote()
        else:
            self.snapshots_given += 1
        samples, sizes, groups, stats = [], [], {}, {}
        for name, run in sorted(snapshot.sampleable.items(), key=lambda item: item[1].slot):
            registration, position = self.positions.get(name, (run.registration_id, DataPosition(0, 0)))
            if registration != run.registration_id:  # a new registration starts at the top
                position = DataPosition(0, 0)
            n_groups = run.config.rollout_batch_size - run.accumulated_groups
            for k in range(position.index, position.index + n_groups):
                group = [Sample(adapter=name, slot=run.slot, group_index=k, index=i, prompt=f"p{k}", label=None,
                                metadata={}, prompt_ids=[1, 2], response_ids=[3], reward=float(i))
                         for i in range(run.config.n_samples_per_prompt)]
                samples += group
                sizes.append(len(group))
                self.group_indices.setdefault(name, []).append(k)
            self.positions[name] = (run.registration_id, DataPosition(0, position.index + n_groups))
            groups[name] = n_groups
            mine = [s for s in samples if s.adapter == name]
            stats[name] = AdapterRolloutStats(groups=n_groups, rewards=tuple(s.reward for s in mine),
                                              response_lengths=tuple(s.response_length for s in mine))
        step_names = sorted(groups)
        await self.controller.apply.remote(RecordBatch(rollout_id, groups, step_names))
        return RolloutBatch(rollout_id=rollout_id, samples=samples, prompt_group_sizes=sizes,
                            groups_per_adapter=groups, step_names=step_names, per_adapter=stats,
                            stats=RolloutStats(batch_n_samples=len(samples)))

    def data_positions(self) -> dict[str, DataPosition]:
        return {name: position for name, (_, position) in self.positions.items()}

    def restore_data_position(self, name: str, registration_id: str, position: DataPosition) -> None:
        self.restores.append((name, registration_id, position))
        self.positions[name] = (registration_id, position)


@dataclass
class RecordingPusher:
    """Implements `weight_push.Pusher`: records what reaches the engines."""

    pushes: list[tuple[int, int, float]] = field(default_factory=list)
    """(slot, version, pushed weights) in push order."""
    unloads: list[int] = field(default_factory=list)

    async def push(self, pushes: Sequence[tuple[int, int, LoraExport]]) -> PushStats:
        for slot, version, export in pushes:
            self.pushes.append((slot, version, export.tensors["w"]))
        return PushStats(adapters=len(pushes), bytes=0, seconds=0.0)

    async def unload(self, slot: int) -> None:
        self.unloads.append(slot)
