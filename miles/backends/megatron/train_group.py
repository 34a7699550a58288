"""The Megatron training backend: DP x TP ranks as Ray actors behind the contract.

`MegatronTrainGroup` implements `miles.backends.base.TrainingBackend` like the torch
`TrainGroup` it extends: it lives in the driver and owns `n_workers *
tensor_model_parallel_size` `MegatronTrainActor` ranks in one process group (gloo on CPU,
nccl on GPU). Global rank r is TP rank `r % tp` of DP replica `r // tp` (megatron-core's
default order). Prompt groups are split whole over the replicas; every TP rank of a
replica gets the same samples. Exports and saves gather over the TP group of replica 0
and come from global rank 0.

    group = MegatronTrainGroup(MegatronGroupConfig.from_config(cfg))   # --train-backend megatron
    await group.start()
    await group.load_adapter(spec); await group.train(rollout_id, batch); await group.step_adapters(names)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles.backends.base import LoraExport, SaveRequest
from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor
from miles.backends.torch.train_group import TrainGroup, TrainGroupConfig, split_prompt_groups
from miles.utils.arguments import MilesConfig
from miles.utils.types import RolloutBatch


@dataclass(frozen=True)
class MegatronGroupConfig(TrainGroupConfig):
    """`TrainGroupConfig` whose `n_workers` are data-parallel replicas (`--actor-num-workers`)
    of `tensor_model_parallel_size` ranks each; GPUs and CPUs are per rank."""

    actor: MegatronActorConfig

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.actor.tensor_model_parallel_size <= 0:
            raise ValueError(f"--tensor-model-parallel-size must be > 0, got {self.actor.tensor_model_parallel_size}")

    @property
    def tp_size(self) -> int:
        return self.actor.tensor_model_parallel_size

    @property
    def world_size(self) -> int:
        return self.n_workers * self.tp_size

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> MegatronGroupConfig:
        actor = MegatronActorConfig.from_config(cfg)
        return cls(actor=actor, n_workers=cfg.actor_num_workers,
                   num_cpus_per_worker=float(cfg.actor_num_cpus_per_worker),
                   num_gpus_per_worker=1.0 if actor.device == "cuda" else 0.0, actor_path=cfg.train_actor_path)


class MegatronTrainGroup(TrainGroup):
    """The Megatron `TrainingBackend`: DP x TP `MegatronTrainActor` ranks driven as one.

    Started, placed (one bundle per rank) and joined at rank 0's node address by
    `TrainGroup.start`; what differs is the rank actor, how samples are dealt (per DP
    replica) and the TP gathers of exports and saves."""

    actor_class = MegatronTrainActor
    config: MegatronGroupConfig  # type: ignore[assignment]

    def _layout(self) -> str:
        return (f"{self.config.world_size} Megatron rank(s): {self.config.n_workers} data-parallel x "
                f"{self.config.tp_size} tensor-parallel")

    def _rank_parts(self, batch: RolloutBatch) -> list[list[int]]:
        """Prompt groups split whole over the DP replicas; every TP rank of a replica gets the
        replica's share (they score the same samples, and only TP rank 0 reports loss sums)."""
        replica_parts = split_prompt_groups(batch.prompt_group_sizes, self.config.n_workers)
        return [replica_parts[rank // self.config.tp_size] for rank in range(len(self._actors))]

    def _replicas(self) -> list[int]:
        """Global rank r is in DP replica r // tp: its TP ranks train the same client datums."""
        return [rank // self.config.tp_size for rank in range(len(self._actors))]

    async def export_adapter(self, name: str) -> LoraExport:
        """Every rank takes part in the TP gather; rank 0's whole tensors stay in the object store."""
        return await self._export_from_rank_0(name, *(actor.export_adapter.remote(name) for actor in self._actors[1:]))

    async def save_client_state(self, name: str, directory: str, *, pending: bool = False) -> Path:
        """Every rank takes part in the TP gathers; rank 0 writes (with `pending`, also the
        gradient not yet stepped, summed over DP and TP)."""
        import ray

        grad = ray.put(await self._pending_grad(name)) if pending else None  # one copy for every rank
        return Path((await self._all("save_client_state", name, directory, grad))[0])

    async def save_adapter(self, request: SaveRequest) -> Path:
        """Every rank takes part in the gathers (gradient over DP and TP, weights over TP); rank 0 writes."""
        import ray

        accumulated = await self._accumulated_grad(request)
        ref = None if accumulated is None else ray.put(accumulated)  # one copy for every rank
        paths = await self._all("save_adapter", request.name, request.step, request.data_position, ref)
        return Path(paths[0])
