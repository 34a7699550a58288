"""One train rank, for either training backend, composed of parts with one owner each.

- `config`: `TrainActorConfig`, what a rank needs (the trainer's flags, parsed once);
- `model`: `TrainModel`, the protocol a backend's model implements (forward, slot
  operations, gathers and reductions over its ranks), and the all-reduce they share;
- `core`: `TrainCore` over a `TrainModel`, no Ray, composed of:
  - `adapters`: `SlotAdapters`, the loaded adapters (spec, LR schedule) and their slot layouts;
  - `loads`: `AdapterLoads`, fresh loads, resumes from a checkpoint, cleanups;
  - `train`: `BatchTrainer`, train calls and scorings cut into micro-batches, each
    sample's loss with its adapter's settings;
  - `take_back`: `TakeBack`, the take-back of a failed train call;
  - `step`: `AdapterSteps`, the optimizer step of a set of adapters;
  - `export`: `AdapterExport`, an adapter's tensors and state, and its step checkpoints;
  - `client_state`: `ClientStates`, a client adapter's save_state/load_state and page-outs;
- `sender`: `UpdateGroupSender`, the sending side of the weights-update groups;
- `actor`: `TrainRank`, the Ray actor that composes them and delegates, and the types its
  exports cross Ray in.

A backend's rank subclasses `TrainRank` and builds its model: `miles.backends.torch.actor`
`TorchTrainActor` (a Hugging Face model, `miles.backends.torch.train_model`) and
`miles.backends.megatron.actor` `MegatronTrainActor` (a GPTModel shard,
`miles.backends.megatron.train_model`). `TrainGroup` drives one per rank.
"""
