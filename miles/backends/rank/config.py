"""What one train rank needs, for either backend: the model, the page table, the optimizer and the loss.

    config = TrainActorConfig.from_config(cfg)   # the trainer's flags, parsed once
    TorchTrainActor(config, rank, world_size)    # or MegatronTrainActor(MegatronActorConfig...)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from miles.utils.arguments import MilesConfig
from miles.utils.loss_settings import LossSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The base model's parameter dtypes a rank loads (`--dtype`); LoRA weights stay fp32."""


@dataclass(frozen=True)
class TrainActorConfig:
    """What one train rank needs: the model, the page table, the optimizer and the loss."""

    hf_checkpoint: str
    n_slots: int
    lora_rank: int
    target_modules: str = "all-linear"
    """The layers with slot LoRA (`inject_multi_lora`): "all-linear,lm_head" with `--lora-unembed`."""
    device: str = "cpu"
    dtype: str = "float32"
    micro_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    """A token budget per forward (`--use-dynamic-batch-size --max-tokens-per-gpu`): rows x
    longest row of each micro-batch stay within it; `micro_batch_size` is then not used."""
    activation_budget_mb: float | None = None
    """Given neither of those, a train call is cut into micro-batches whose activations
    (`activation_bytes_per_token`) stay near this many MiB (`--activation-budget-mb`);
    None: `CPU_ACTIVATION_BUDGET_MB` on CPU and the whole batch on CUDA; 0: the whole batch."""
    recompute_granularity: str | None = None
    """Activation recomputation, Megatron's names: "full" (whole decoder layers) or
    "selective" (here: the norm outputs and gated activations, `release_cheap_activations`);
    None keeps every activation."""
    recompute_method: str | None = None
    """With "full": "uniform" (every layer) or "block" (the first `recompute_num_layers`)."""
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None
    """With "selective": Megatron's module names (`--recompute-modules`); None: layernorm."""
    num_threads: int | None = None
    """torch threads of a CPU rank (`--actor-num-cpus-per-worker`); None leaves torch's count."""
    seed: int = 42
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    loss: LossSettings = field(default_factory=LossSettings)
    """The trainer's loss flags (`cfg.loss`): the settings of adapters whose spec has none."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> TrainActorConfig:
        if not cfg.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required: the Hugging Face directory of the base model")
        return cls(
            hf_checkpoint=cfg.hf_checkpoint,
            n_slots=max(1, cfg.multi_lora_n_adapters),
            lora_rank=cfg.lora_rank,
            target_modules=cfg.slot_target_modules,
            device=cfg.resolved_device,
            dtype=cfg.resolved_dtype,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens_per_micro_batch=cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None,
            activation_budget_mb=cfg.activation_budget_mb,
            recompute_granularity=cfg.recompute_granularity,
            recompute_method=cfg.recompute_method,
            recompute_num_layers=cfg.recompute_num_layers,
            recompute_modules=None if cfg.recompute_modules is None else tuple(cfg.recompute_modules),
            num_threads=cfg.actor_num_cpus_per_worker,
            seed=cfg.seed,
            adam_betas=(cfg.adam_beta1, cfg.adam_beta2),
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            min_lr=cfg.min_lr,
            lr_warmup_init=cfg.lr_warmup_init,
            loss=cfg.loss,
        )
