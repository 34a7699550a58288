"""The Megatron training backend: DP x TP ranks as Ray actors behind the contract.

`MegatronTrainGroup` implements `miles.backends.base.TrainingBackend` like the torch
`TrainGroup` it extends: it lives in the driver and owns `n_replicas *
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

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.backends.base import LoraExport, SaveRequest, TrainResult
from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor
from miles.backends.torch.train_group import TrainGroup, _adapter_stats, _rank_error, split_prompt_groups
from miles.utils.arguments import MilesConfig
from miles.utils.types import RolloutBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MegatronGroupConfig:
    actor: MegatronActorConfig
    n_replicas: int = 1
    """Data-parallel replicas (`--actor-num-workers`); each has `tensor_model_parallel_size` ranks."""
    num_cpus_per_rank: float = 1.0
    num_gpus_per_rank: float = 0.0
    master_host: str | None = None
    """Rendezvous host of the process group; None: rank 0's own choice (`master_address`)."""

    def __post_init__(self) -> None:
        if self.n_replicas <= 0:
            raise ValueError(f"--actor-num-workers must be > 0, got {self.n_replicas}")
        if self.actor.tensor_model_parallel_size <= 0:
            raise ValueError(f"--tensor-model-parallel-size must be > 0, got {self.actor.tensor_model_parallel_size}")

    @property
    def tp_size(self) -> int:
        return self.actor.tensor_model_parallel_size

    @property
    def world_size(self) -> int:
        return self.n_replicas * self.tp_size

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> MegatronGroupConfig:
        actor = MegatronActorConfig.from_config(cfg)
        return cls(actor=actor, n_replicas=cfg.actor_num_workers,
                   num_gpus_per_rank=1.0 if actor.device == "cuda" else 0.0)


class MegatronTrainGroup(TrainGroup):
    """The Megatron `TrainingBackend`: DP x TP `MegatronTrainActor` ranks driven as one."""

    config: MegatronGroupConfig  # type: ignore[assignment]

    def __init__(self, config: MegatronGroupConfig) -> None:
        super().__init__(config)  # type: ignore[arg-type]

    async def start(self) -> None:
        """Create the DP x TP rank actors, join them in one process group, build the shards."""
        import ray

        if self._actors:
            raise RuntimeError("MegatronTrainGroup.start() was already called")
        remote_cls = ray.remote(MegatronTrainActor).options(
            num_cpus=self.config.num_cpus_per_rank, num_gpus=self.config.num_gpus_per_rank
        )
        world = self.config.world_size
        self._actors = [remote_cls.remote(self.config.actor, rank, world) for rank in range(world)]
        await self._all("ready")
        master = self._actors[0].master_address
        address = await (master.remote() if self.config.master_host is None else master.remote(self.config.master_host))
        await self._all("init_process_group", address)
        logger.info("Started %d Megatron rank(s): %d data-parallel x %d tensor-parallel",
                    world, self.config.n_replicas, self.config.tp_size)

    async def train(self, rollout_id: int, batch: RolloutBatch) -> TrainResult:
        """`TrainGroup.train` with the prompt groups split over DP replicas: every TP rank of a
        replica gets the replica's share (and only TP rank 0 reports loss sums)."""
        samples = batch.samples
        if not samples:
            return TrainResult()
        missing = sorted({s.adapter for s in samples} - set(self._specs))
        if missing:
            raise RuntimeError(f"rollout {rollout_id} has samples of adapters not loaded on the trainer: {missing}; "
                               "adapters must be loaded before generation")
        replica_parts = split_prompt_groups(batch.prompt_group_sizes, self.config.n_replicas)
        parts = [replica_parts[rank // self.config.tp_size] for rank in range(len(self._actors))]
        # Each TP rank of a replica scores the same share; they write the same values.
        advantages = self._advantages(batch, await self._reward_kl(batch, parts))
        counts: dict[str, int] = {}
        for sample in samples:
            counts[sample.adapter] = counts.get(sample.adapter, 0) + 1
        per_rank = await asyncio.gather(*(
            actor.train.remote([samples[i] for i in part], [advantages[i] for i in part], counts)
            for actor, part in zip(self._actors, parts)
        ), return_exceptions=True)
        failures = [out for out in per_rank if isinstance(out, BaseException)]
        if failures:  # as `TrainGroup.train`: no rank keeps any part of the batch
            await asyncio.gather(*(actor.discard_batch.remote() for actor in self._actors), return_exceptions=True)
            raise _rank_error(failures[0], f"training rollout {rollout_id}")
        return TrainResult(samples=len(samples), adapters=_adapter_stats(per_rank))

    async def export_adapter(self, name: str) -> LoraExport:
        """Every rank takes part in the TP gather; rank 0's whole tensors stay in the object store."""
        refs = [actor.export_adapter.remote(name) for actor in self._actors]
        await asyncio.gather(*refs[1:])
        return await self._with_metadata(name, refs[0])

    async def save_adapter(self, request: SaveRequest) -> Path:
        paths = await self._all("save_adapter", request.name, request.step, request.data_position)
        return Path(paths[0])

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)
