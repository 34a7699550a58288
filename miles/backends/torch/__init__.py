"""The torch training backend: frozen HF base + slot page-table LoRA + one AdamW per slot.

    from miles.backends.torch.train_group import TrainGroup, TrainGroupConfig
    group = TrainGroup(TrainGroupConfig.from_config(cfg))   # a `TrainingBackend`
    await group.start()

Modules: `loss` (GRPO advantages, PPO-clip/TIS/KL), `optimizer` (per-slot AdamW),
`lr_schedule` (per-adapter schedule on the adapter's sample clock), `checkpoint`
(atomic PEFT + optimizer checkpoints), `batching` (mixed-slot micro-batches), `lm_head`
(the LM head fused with the token logprobs), `recompute` (activation recomputation),
`allocator` (the CPU allocator), `train_model` (the Hugging Face model as a rank's
`TrainModel`), `actor` (one DP rank: the backend-neutral `miles.backends.rank` over that
model), `train_group` (the DP group the driver talks to). The Megatron backend reuses
`loss`, `optimizer`, `lr_schedule`, `checkpoint` and `batching`.
"""
