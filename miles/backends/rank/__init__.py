"""One train rank, for either training backend, composed of parts with one owner each.

- `config`: `TrainActorConfig`, what a rank needs (the trainer's flags, parsed once);
- `model`: `TrainModel`, the protocol a backend's model implements (forward, slot
  operations, gathers and reductions over its ranks), and the all-reduce they share;
- `core`: `TrainCore` over a `TrainModel`: loaded adapters and their LR schedules, loads
  and resumes, micro-batches, the loss, the take-back of a failed train call, the
  optimizer step and checkpoints; no Ray;
- `sender`: `UpdateGroupSender`, the sending side of the weights-update groups;
- `actor`: `TrainRank`, the Ray actor that composes them and delegates, and the types its
  exports cross Ray in.

A backend's rank subclasses `TrainRank` and builds its model: `miles.backends.torch.actor`
`TorchTrainActor` (a Hugging Face model, `miles.backends.torch.train_model`) and
`miles.backends.megatron.actor` `MegatronTrainActor` (a GPTModel shard,
`miles.backends.megatron.train_model`). `TrainGroup` drives one per rank.
"""
