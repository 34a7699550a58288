"""The torch training backend's group: `TorchTrainActor` data-parallel ranks behind the contract.

Every rank holds the whole model, so the layout is plain data parallelism: rank 0
exports, the first live rank saves.

    group = torch_train_group(TrainGroupConfig.from_config(cfg))   # a `TrainingBackend`
    await group.start()
"""

from __future__ import annotations

from miles.backends.common.rank_group import RankLayout
from miles.backends.common.train_group import TrainGroup, TrainGroupConfig
from miles.backends.torch.actor import TorchTrainActor


def torch_train_group(config: TrainGroupConfig) -> TrainGroup:
    """`config.n_workers` torch ranks (`--train-actor-path` may name a `TorchTrainActor` subclass)."""
    return TrainGroup(config, TorchTrainActor, RankLayout(replicas=config.n_workers, label="torch train"))
