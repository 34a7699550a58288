"""What both training backends share: the driver-side group and the math of a train rank.

Modules: `train_group` (`TrainGroup`, the `TrainingBackend` the driver talks to, over a
`rank_group.RankGroup` of either backend's rank actors laid out as a `RankLayout`), `loss`
(GRPO advantages, PPO-clip/TIS/KL), `client_loss` (the Tinker protocol's losses),
`optimizer` (per-slot AdamW), `lr_schedule` (per-adapter schedule on the adapter's sample
clock), `checkpoint` (atomic PEFT + optimizer checkpoints), `batching` (mixed-slot
micro-batches).
"""
