"""The torch training backend: frozen HF base + slot page-table LoRA + one AdamW per slot.

    from miles.backends.torch import TrainGroup, TrainGroupConfig
    group = TrainGroup(TrainGroupConfig.from_config(cfg))   # a `TrainingBackend`
    await group.start()

Modules: `loss` (GRPO advantages, PPO-clip/TIS/KL), `optimizer` (per-slot AdamW),
`lr_schedule` (per-adapter schedule on the adapter's sample clock), `checkpoint`
(atomic PEFT + optimizer checkpoints), `batching` (mixed-slot micro-batches), `actor`
(one DP rank), `train_group` (the DP group the driver talks to).
"""

from miles.backends.base import AdapterSpec
from miles.backends.torch.actor import TorchTrainActor, TrainActorConfig
from miles.backends.torch.checkpoint import latest_checkpoint, read_checkpoint, write_checkpoint
from miles.backends.torch.loss import LossConfig, grpo_advantages, policy_loss
from miles.backends.torch.train_group import TrainGroup, TrainGroupConfig

__all__ = [
    "AdapterSpec",
    "LossConfig",
    "TorchTrainActor",
    "TrainActorConfig",
    "TrainGroup",
    "TrainGroupConfig",
    "grpo_advantages",
    "latest_checkpoint",
    "policy_loss",
    "read_checkpoint",
    "write_checkpoint",
]
