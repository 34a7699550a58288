"""The torch training backend: frozen HF base + slot page-table LoRA, data-parallel ranks.

    from miles.backends.torch.train_group import torch_train_group
    group = torch_train_group(TrainGroupConfig.from_config(cfg))   # a `TrainingBackend`
    await group.start()

Modules: `train_model` (the Hugging Face model as a rank's `TrainModel`), `lm_head` (the
LM head fused with the token logprobs), `recompute` (activation recomputation),
`allocator` (the CPU allocator), `actor` (one DP rank: the backend-neutral
`miles.backends.rank` over that model), `train_group` (its ranks in the shared
`miles.backends.common.train_group.TrainGroup`).
"""
