"""The Megatron training backend's group: DP x TP `MegatronTrainActor` ranks behind the contract.

`megatron_train_group` builds the shared `TrainGroup` over `n_workers *
tensor_model_parallel_size` ranks in one process group (gloo on CPU, nccl on GPU). Global
rank r is TP rank `r % tp` of DP replica `r // tp` (megatron-core's default order). Prompt
groups are split whole over the replicas; every TP rank of a replica gets the same
samples. The ranks hold shards, so exports and saves gather over the TP group of replica
0 (every rank takes part) and come from global rank 0.

    group = megatron_train_group(MegatronGroupConfig.from_config(cfg))   # --train-backend megatron
    await group.start()
    await group.load_adapter(spec); await group.train(rollout_id, batch); await group.step_adapters(names)
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.backends.common.rank_group import RankLayout
from miles.backends.common.train_group import TrainGroup, TrainGroupConfig
from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor
from miles.utils.adapter_config import resolved_field
from miles.utils.arguments import MilesConfig


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
        return cls(actor=actor, n_workers=resolved_field(cfg.actor_num_workers, "--actor-num-workers"),
                   num_cpus_per_worker=float(cfg.actor_num_cpus_per_worker),
                   num_gpus_per_worker=1.0 if actor.device == "cuda" else 0.0, actor_path=cfg.train_actor_path)


def megatron_train_group(config: MegatronGroupConfig) -> TrainGroup:
    """`config.world_size` Megatron ranks: `n_workers` replicas of `tp_size` sharded ranks each."""
    layout = RankLayout(replicas=config.n_workers, tp_size=config.tp_size, sharded=True, label="Megatron")
    return TrainGroup(config, MegatronTrainActor, layout)
