"""One rank (a DP replica's TP shard) of the Megatron training backend, as the Ray actor
the train group drives.

A `TrainRank` whose model is a `MegatronTrainModel`: a megatron-core GPTModel shard with
the slot page table in its parallel linears; the training contract, one `SlotAdamW` over
this rank's LoRA shards and one LR schedule per adapter are the backend-neutral
`TrainCore`'s, as in the torch backend. The model is built when the rank joins its
process group, since megatron-core's TP/DP groups must exist first.

Driven in-process for one rank (TP = DP = 1):

    actor = MegatronTrainActor(MegatronActorConfig(hf_checkpoint="/tmp/tiny", n_slots=4, lora_rank=8))
    actor.init_process_group(None)           # a one-rank gloo group
    actor.load_adapter(spec); actor.train(samples, advantages, counts); actor.step_adapters(["math"])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.backends.megatron.model import ModelShape
from miles.backends.megatron.train_model import MegatronTrainModel
from miles.backends.rank.actor import TrainRank
from miles.backends.rank.config import TrainActorConfig
from miles.utils.arguments import MilesConfig


@dataclass(frozen=True)
class MegatronActorConfig(TrainActorConfig):
    """`TrainActorConfig` plus the tensor-parallel layout."""

    tensor_model_parallel_size: int = 1

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> MegatronActorConfig:
        base = TrainActorConfig.from_config(cfg)
        return cls(**{f: getattr(base, f) for f in base.__dataclass_fields__},
                   tensor_model_parallel_size=cfg.tensor_model_parallel_size)


class MegatronTrainActor(TrainRank):
    """A Megatron rank: `TrainRank` over a `MegatronTrainModel`, built when it joins its process group."""

    config: MegatronActorConfig

    def __init__(self, config: MegatronActorConfig, rank: int = 0, world_size: int = 1) -> None:
        tp = config.tensor_model_parallel_size
        if tp <= 0 or world_size % tp:
            raise ValueError(f"{world_size} ranks are not a multiple of --tensor-model-parallel-size {tp}")
        super().__init__(config, rank, world_size)
        self.shape = ModelShape.from_hf_dir(config.hf_checkpoint)
        self.shape.check_tp(tp)

    def init_process_group(self, address: str | None, timeout_s: float = 600.0) -> None:
        """Join the process group (a one-rank one when `address` is None), set up Megatron's
        TP/DP groups, then build this rank's model shard and its core."""
        from megatron.core import parallel_state

        if not dist.is_initialized():
            self._join_default_group(address or self.master_address(), timeout_s)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        tp = self.config.tensor_model_parallel_size
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        if self.device.type == "cuda":
            from megatron.core import tensor_parallel

            # Attention forks the TP RNG tracker around dropout (0 here); on CUDA the fork
            # needs the tracker's states (on CPU `cpu_shims` makes the fork a no-op).
            tensor_parallel.model_parallel_cuda_manual_seed(self.config.seed)
        # Megatron's micro-batches come from --micro-batch-size alone: no activation budget.
        self._compose(MegatronTrainModel(self.config, self.shape, self.rank, tp))

    def shutdown(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        super().shutdown()
