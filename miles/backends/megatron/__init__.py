"""The Megatron training backend: megatron-core GPTModel + slot page-table LoRA, TP x DP.

    miles.main.train_multi_lora_async --train-backend megatron --tensor-model-parallel-size 2 ...

    from miles.backends.megatron.train_group import MegatronGroupConfig, megatron_train_group
    group = megatron_train_group(MegatronGroupConfig.from_config(cfg))   # a `TrainingBackend`
    await group.start()

Modules: `model` (GPTModel from a Hugging Face Llama/Qwen2 directory, the HF <-> Megatron
weight mapping), `lora` (the slot page table inside the column/row-parallel linears,
A/B sharded like the base weights), `train_model` (the GPTModel shard as a rank's
`TrainModel`: forward, slot loads, TP gathers, the norm over TP), `actor` (one rank: the
backend-neutral `miles.backends.rank` over that model), `train_group` (its DP x TP ranks in
the shared `miles.backends.common.train_group.TrainGroup`), `cpu_shims`
(what megatron-core needs to run on CPU over gloo, applied only without CUDA),
`gpu_check` (Megatron vs the torch backend on the same model and adapters).

Checkpoints and exports are whole PEFT tensors with HF names, the torch backend's format:
either backend resumes the other's checkpoints.
"""
