"""The data-parallel group of torch train actors, driven from the trainer's event loop.

`TrainGroup` lives in the driver process and owns N `TorchTrainActor` Ray actors (one
per DP rank, torch.distributed over gloo on CPU or nccl on GPU). One driver iteration
calls, in this order (DESIGN §1):

    group = TrainGroup(TrainGroupConfig.from_config(cfg), controller)
    await group.start()
    await group.reconcile_adapters()       # retire, clean up, load (resume) adapters
    pushed = await group.update_weights()  # stale adapters -> every weight receiver
    await group.train(rollout_id, rollout)
    await group.save_model(rollout_id)     # per-adapter `step % save_interval == 0`
    ...
    await group.save_all(); await group.shutdown()

`controller` is the controller actor handle; this class calls its `snapshot`,
`retire_adapters`, `free_slot` and `set_adapter_step`. Weight receivers (the engine
actors) expose `load_lora(lora_name, version, peft_config, tensors)`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from miles.backends.torch.actor import AdapterSpec, TorchTrainActor, TrainActorConfig
from miles.backends.torch.checkpoint import latest_checkpoint
from miles.backends.torch.loss import grpo_advantages
from miles.utils.arguments import MilesConfig
from miles.utils.types import MultiLoRASnapshot, RolloutBatch, engine_lora_name

logger = logging.getLogger(__name__)


class WeightReceiver(Protocol):
    """What a weight push targets (an engine actor handle in production).

    Called as `receiver.load_lora.remote(lora_name, version, peft_config, tensors_ref)`;
    Ray resolves the top-level ObjectRef, so the receiver gets the `{PEFT name: tensor}`
    dict (rank-sliced LoRA tensors only, never base weights).
    """

    def load_lora(self, lora_name: str, version: int, peft_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any: ...


@dataclass(frozen=True)
class TrainGroupConfig:
    actor: TrainActorConfig
    n_workers: int = 1
    """Data-parallel ranks (`--actor-num-workers`)."""
    save_interval: int | None = None
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    master_host: str = "127.0.0.1"
    """Rendezvous host of the process group (all ranks on this node)."""

    def __post_init__(self) -> None:
        if self.n_workers <= 0:
            raise ValueError(f"--actor-num-workers must be > 0, got {self.n_workers}")

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> TrainGroupConfig:
        actor = TrainActorConfig.from_config(cfg)
        return cls(
            actor=actor, n_workers=cfg.actor_num_workers, save_interval=cfg.save_interval,
            num_gpus_per_worker=1.0 if actor.device == "cuda" else 0.0,
        )


@dataclass
class _Entry:
    spec: AdapterSpec
    step: int
    saved_step: int
    """Step of the last checkpoint written or loaded (no second save at the same step)."""
    stale: bool = True
    """Engines do not serve the current weights yet (newly loaded or stepped since the last push)."""


@dataclass(frozen=True)
class ReconcileResult:
    retired: list[str] = field(default_factory=list)
    """Adapters the controller moved from RETIRING to CLEANUP."""
    cleaned: list[str] = field(default_factory=list)
    """Adapters whose slot was cleared (and freed on the controller)."""
    loaded: list[str] = field(default_factory=list)
    resumed: dict[str, int] = field(default_factory=dict)
    """Loaded adapters that resumed from a checkpoint, with their step."""


def split_prompt_groups(group_sizes: Sequence[int], n_ranks: int) -> list[list[int]]:
    """Sample indices of each rank: prompt group i goes to rank i % n_ranks, whole.

    Any split gives the same update (samples enter with weight 1 and gradients are
    summed over ranks); whole groups keep a rank's samples ordered like the batch.
    """
    parts: list[list[int]] = [[] for _ in range(n_ranks)]
    start = 0
    for i, size in enumerate(group_sizes):
        parts[i % n_ranks].extend(range(start, start + size))
        start += size
    return parts


class TrainGroup:
    def __init__(self, config: TrainGroupConfig, controller: Any) -> None:
        self.config = config
        self.controller = controller
        self._actors: list[Any] = []
        self._receivers: list[Any] = []
        self._adapters: dict[str, _Entry] = {}

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    @property
    def loaded_adapters(self) -> dict[str, int]:
        """Loaded adapters and their slots."""
        return {name: entry.spec.slot for name, entry in self._adapters.items()}

    def adapter_step(self, name: str) -> int:
        return self._adapters[name].step

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return await asyncio.gather(*(getattr(actor, method).remote(*args) for actor in self._actors))

    async def start(self) -> None:
        """Create the N rank actors and join them in one process group."""
        import ray

        if self._actors:
            raise RuntimeError("TrainGroup.start() was already called")
        remote_cls = ray.remote(TorchTrainActor).options(
            num_cpus=self.config.num_cpus_per_worker, num_gpus=self.config.num_gpus_per_worker
        )
        n = self.config.n_workers
        self._actors = [remote_cls.remote(self.config.actor, rank, n) for rank in range(n)]
        await self._all("ready")
        if n > 1:
            address = await self._actors[0].master_address.remote(self.config.master_host)
            await self._all("init_process_group", address)
        logger.info("Started %d torch train rank(s)", n)

    def set_weight_receivers(self, handles: Sequence[Any]) -> None:
        self._receivers = list(handles)

    # ---- reconcile -------------------------------------------------------------------

    async def reconcile_adapters(self) -> ReconcileResult:
        """Retire, clean up and load so the trainer holds exactly the live adapters."""
        retired = await self.controller.retire_adapters.remote()
        snapshot: MultiLoRASnapshot = await self.controller.snapshot.remote()
        cleaned = await self._cleanup_gone(snapshot)
        loaded, resumed = await self._load_new(snapshot)
        return ReconcileResult(retired=list(retired), cleaned=cleaned, loaded=loaded, resumed=resumed)

    async def _cleanup_gone(self, snapshot: MultiLoRASnapshot) -> list[str]:
        live = snapshot.live
        cleaned = []
        for name in sorted(self._adapters):
            run = live.get(name)
            if run is not None and run.registration_id == self._adapters[name].spec.registration_id:
                continue
            await self._cleanup(name)
            if name in snapshot.cleanup:
                await self.controller.free_slot.remote(name)
            cleaned.append(name)
        for name in sorted(snapshot.cleanup - set(cleaned)):
            await self.controller.free_slot.remote(name)  # never loaded here: nothing to save
            cleaned.append(name)
        return cleaned

    async def _cleanup(self, name: str) -> None:
        """Final checkpoint, then empty the slot on every rank (weights, moments, grads, schedule)."""
        await self._save(name)
        await self._all("cleanup_adapter", name)
        del self._adapters[name]
        logger.info("Adapter '%s' cleaned up", name)

    async def _load_new(self, snapshot: MultiLoRASnapshot) -> tuple[list[str], dict[str, int]]:
        loaded, resumed = [], {}
        for name, run in sorted(snapshot.live.items()):
            spec = AdapterSpec.from_run(run)
            if name in self._adapters:
                await self._refresh_num_step(name, spec.num_step)
                continue
            checkpoint = latest_checkpoint(spec.save_dir) if spec.save_dir else None
            steps = await self._all("load_adapter", spec, None if checkpoint is None else str(checkpoint))
            step = steps[0]
            if checkpoint is not None:
                await self.controller.set_adapter_step.remote(name, step)
                resumed[name] = step
                logger.info("Adapter '%s' resumed from %s (step %d)", name, checkpoint, step)
            self._adapters[name] = _Entry(spec=spec, step=step, saved_step=step)
            loaded.append(name)
        return loaded, resumed

    async def _refresh_num_step(self, name: str, num_step: int | None) -> None:
        entry = self._adapters[name]
        if num_step != entry.spec.num_step:
            await self._all("set_num_step", name, num_step)
            entry.spec = replace(entry.spec, num_step=num_step)

    # ---- weight push -----------------------------------------------------------------

    async def update_weights(self) -> list[str]:
        """Push the stale adapters to every receiver; returns the names pushed.

        Rank 0 exports each adapter once; its result sits in the object store once and
        every receiver reads it from there. The version sent is the adapter's current
        slot version + 1, i.e. what `record_weight_update` will make it.
        """
        stale = sorted(name for name, entry in self._adapters.items() if entry.stale)
        if not stale:
            return []
        live = (await self.controller.snapshot.remote()).live
        names = [name for name in stale if name in live]
        calls = []
        if self._receivers:
            for name in names:
                tensors_ref = self._actors[0].export_adapter.remote(name)
                peft_config = await self._actors[0].peft_config.remote(name)
                lora_name, version = engine_lora_name(live[name].slot), live[name].version + 1
                calls += [r.load_lora.remote(lora_name, version, peft_config, tensors_ref) for r in self._receivers]
        await asyncio.gather(*calls)
        for name in names:
            self._adapters[name].stale = False
        return names

    # ---- training --------------------------------------------------------------------

    async def train(self, rollout_id: int, rollout: RolloutBatch) -> dict[str, float]:
        """Advantages over whole groups, split groups over ranks, backward, step `step_names`."""
        samples = rollout.samples
        if not samples:
            return {}
        missing = sorted({s.adapter for s in samples} - set(self._adapters))
        if missing:
            raise RuntimeError(f"rollout {rollout_id} has samples of adapters not loaded on the trainer: {missing}; "
                               "reconcile_adapters must run before generation")
        advantages = grpo_advantages(torch.tensor([s.reward for s in samples]), rollout.prompt_group_sizes).tolist()
        counts: dict[str, int] = {}
        for sample in samples:
            counts[sample.adapter] = counts.get(sample.adapter, 0) + 1
        parts = split_prompt_groups(rollout.prompt_group_sizes, len(self._actors))
        per_rank = await asyncio.gather(*(
            actor.train.remote([samples[i] for i in part], [advantages[i] for i in part], counts)
            for actor, part in zip(self._actors, parts)
        ))
        step_names = sorted(set(rollout.step_names))
        stepped = (await self._all("step_adapters", step_names))[0] if step_names else {}
        for name, stats in stepped.items():
            self._adapters[name].step = int(stats["step"])
            self._adapters[name].stale = True
        return _metrics(per_rank, stepped, len(samples))

    # ---- checkpoints -------------------------------------------------------------------

    async def save_model(self, rollout_id: int, data_positions: dict[str, dict[str, Any]] | None = None) -> list[str]:
        """Save every adapter whose step is a positive multiple of `save_interval` (once per step).

        `data_positions` (adapter -> where its data stream is) goes into `trainer_state.json`.
        """
        interval = self.config.save_interval
        if interval is None:
            return []
        due = [name for name, e in sorted(self._adapters.items()) if e.step > 0 and e.step % interval == 0]
        positions = data_positions or {}
        return [name for name in due if await self._save(name, positions.get(name))]

    async def save_all(self, data_positions: dict[str, dict[str, Any]] | None = None) -> list[str]:
        """Shutdown save of every loaded adapter that stepped since its last checkpoint."""
        positions = data_positions or {}
        return [name for name in sorted(self._adapters) if await self._save(name, positions.get(name))]

    async def _save(self, name: str, data_position: dict[str, Any] | None = None) -> bool:
        entry = self._adapters[name]
        if entry.step == entry.saved_step or entry.step == 0:
            return False
        if entry.spec.save_dir is None:
            logger.warning("Adapter '%s' has no save directory; its step %d is not saved", name, entry.step)
            return False
        path = await self._actors[0].save_adapter.remote(name, data_position)
        entry.saved_step = entry.step
        logger.info("Adapter '%s' saved at step %d to %s", name, entry.step, path)
        return True

    async def shutdown(self) -> None:
        import ray

        if not self._actors:
            return
        await self._all("shutdown")
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []


def _metrics(per_rank: list[dict[str, dict[str, float]]], stepped: dict[str, dict[str, float]], n_samples: int) -> dict[str, float]:
    totals: dict[str, dict[str, float]] = {}
    for rank_stats in per_rank:
        for name, stats in rank_stats.items():
            into = totals.setdefault(name, {})
            for key, value in stats.items():
                into[key] = into.get(key, 0.0) + value
    out: dict[str, float] = {"perf/train_samples": float(n_samples)}
    for name, t in sorted(totals.items()):
        n = max(t["samples"], 1.0)
        out[f"{name}/loss"] = t["loss_sum"] / n
        out[f"{name}/clip_fraction"] = t["clipped_tokens"] / max(t["tokens"], 1.0)
        out[f"{name}/kl"] = t["kl_sum"] / n
        out[f"{name}/tis_weight"] = t["tis_sum"] / n
        out[f"{name}/train_samples"] = t["samples"]
    for name, s in sorted(stepped.items()):
        out[f"{name}/grad_norm"] = s["grad_norm"]
        out[f"{name}/lr"] = s["lr"]
        out[f"{name}/step"] = s["step"]
    return out
