"""One data-parallel rank of the torch training backend, as the Ray actor `TrainGroup` drives.

A `TrainRank` whose model is a `TorchTrainModel`: a frozen Hugging Face causal LM with the
slot page table injected; the training, one AdamW per slot and one LR schedule per adapter
are the backend-neutral `TrainCore`'s (`miles.backends.rank`). A plain class, so a single
rank can be driven in-process:

    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint="/tmp/tiny", n_slots=4, lora_rank=8))
    actor.load_adapter(AdapterSpec(name="math", slot=0, rank=8, alpha=16.0, global_batch_size=8))
    actor.train(samples, advantages, samples_per_adapter={"math": 8})
    actor.step_adapters(["math"])
"""

from __future__ import annotations

from miles.backends.rank.actor import TrainRank
from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.allocator import keep_freed_memory
from miles.backends.torch.train_model import TorchTrainModel

__all__ = ["TorchTrainActor", "TrainActorConfig"]


class TorchTrainActor(TrainRank):
    """A torch DP rank: `TrainRank` over a `TorchTrainModel`, built when the rank is."""

    def __init__(self, config: TrainActorConfig, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(config, rank, world_size)
        if self.device.type == "cpu":
            keep_freed_memory()
        model = TorchTrainModel(config, rank, world_size)
        self._compose(model, model.activation_budget(config))
