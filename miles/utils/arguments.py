"""Command-line flags of the trainers, parsed once into a typed, frozen `MilesConfig`.

Every flag is a field of `MilesConfig`; the field's default is the flag's default and
its `help` metadata is the flag's help, so defaults live in exactly one place. Flag
names keep Miles' spelling (`multi_lora_n_adapters` <-> `--multi-lora-n-adapters`).

    cfg = parse_args(["--config", "configs/tiny-multi-lora.yaml", "--lr", "1e-4"])

`--config FILE.yaml` holds flag values (keys with `-` or `_`); flags given on the
command line win over the file. Each value is checked against its flag's type (`lr:
1e-3` is the number 0.001; `multi_lora_n_adapters: four` is an error naming the key). An
invalid value or combination exits with status 2 and one line saying what to change. Components take the few fields they need (each defines a
small config of its own with a `from_config(cfg)` constructor), never the whole object.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import TypeAdapter, ValidationError

from miles.utils.loss_settings import LOSS_FLAGS, LossSettings
from miles.utils.plugins import plugin_module
from miles.utils.safe_yaml import load_yaml

logger = logging.getLogger(__name__)


def _flag(default: Any, help: str, **extra: Any) -> Any:
    metadata = {"help": help, **extra}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class ConfigError(ValueError):
    """An invalid flag value or combination; the message says what to change."""


DEFAULT_QUEUE_SIZE = 1024
"""Registrations that may wait for a slot when every slot is held (`--multi-lora-queue-size`)."""

SGLANG_FLAG_PREFIX = "--sglang-"
SGLANG_ARGS_SET_BY_TRAINER = {
    "model_path": "--hf-checkpoint", "host": "the engine launcher", "port": "the engine launcher",
    "enable_lora": "--multi-lora-n-adapters", "max_loras_per_batch": "--multi-lora-n-adapters",
    "max_loaded_loras": "--multi-lora-n-adapters", "max_lora_rank": "--lora-rank",
    "lora_target_modules": "--target-modules", "dtype": "--dtype", "random_seed": "--seed",
    "max_running_requests": "--engine-max-running-requests",
    "tokenizer_worker_num": "the engine launcher: LoRA loading needs one tokenizer worker",
}
"""SGLang server arguments the engine launcher sets itself, with the flag they come from."""
SGLANG_ARGS_OVERRIDDEN = {"tp_size": "--rollout-num-gpus-per-engine"}
"""Accepted (as Miles accepts them) but overridden by one of our flags: a warning, then dropped."""


MEGATRON_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""megatron-core's `recompute_modules` names (`--recompute-modules`)."""
TORCH_RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
"""Those the torch backend's selective recomputation takes (`miles.backends.torch.recompute`)."""


@dataclass(frozen=True)
class MilesConfig:
    # ---- model and backends ----
    hf_checkpoint: str | None = _flag(None, "Hugging Face model directory of the frozen base model.")
    train_backend: Literal["torch", "megatron"] = _flag("torch", "Training backend.")
    train_actor_path: str | None = _flag(
        None, "Dotted path of the train rank class to run: a subclass of the backend's own "
              "(miles.backends.torch.actor.TorchTrainActor, miles.backends.megatron.actor.MegatronTrainActor).")
    actor_num_workers: int | None = _flag(
        None, "Data-parallel train ranks (Ray actors); default: --actor-num-nodes x --actor-num-gpus-per-node "
              "over the Megatron model-parallel size, else 1.")
    actor_num_nodes: int | None = _flag(None, "Trainer nodes (Miles' placement; sets --actor-num-workers).")
    actor_num_gpus_per_node: int | None = _flag(None, "Trainer GPUs per node (Miles' placement; sets --actor-num-workers).")
    actor_num_cpus_per_worker: int = _flag(
        1, "CPUs Ray reserves for each train rank; on CPU also the rank's torch threads. More than 1 speeds up "
           "a CPU train step where the machine has the cores to spare (engines and other ranks run beside it).")
    device: Literal["auto", "cpu", "cuda"] = _flag("auto", "Device of train ranks and builtin engines.")
    dtype: Literal["auto", "float32", "bfloat16"] = _flag("auto", "Parameter dtype (auto: bf16 on CUDA, fp32 on CPU).")
    micro_batch_size: int | None = _flag(None, "Samples per forward/backward on a train rank (default: all).")
    use_dynamic_batch_size: bool = _flag(
        False, "Micro-batches packed by tokens instead of --micro-batch-size samples: at most "
               "--max-tokens-per-gpu tokens each, counted padded (rows x longest row).")
    max_tokens_per_gpu: int | None = _flag(None, "Token budget of a micro-batch on a train rank (--use-dynamic-batch-size).")
    activation_budget_mb: int | None = _flag(
        None, "Torch backend, given neither --micro-batch-size nor --use-dynamic-batch-size: micro-batches sized "
              "so that the activations kept for the backward stay near this many MiB (estimated from the "
              "model's shape). Default: 1024 on CPU, the whole batch on CUDA; 0: the whole batch.")
    recompute_granularity: Literal["full", "selective"] | None = _flag(
        None, "Activation recomputation (Megatron's flag): full keeps only each recomputed decoder layer's input "
              "and runs the layer again in the backward; selective recomputes only cheap parts (Megatron: core "
              "attention; torch: the norm outputs and SiLU-gated activations, every GEMM output kept). "
              "Default: keep every activation.", choices=("full", "selective"))
    recompute_modules: list[str] | None = _flag(
        None, "With --recompute-granularity selective, the parts recomputed (Megatron's flag and names). Torch "
              "backend: layernorm (the norm outputs; the default), mlp (the MLP with the norm before it, from "
              "the residual), core_attn (accepted: SDPA keeps only q, k, v and its output already); SiLU-gated "
              "activations are formed again in any case. Megatron backend: passed to megatron-core (default "
              "core_attn).", nargs="+", choices=MEGATRON_RECOMPUTE_MODULES)
    recompute_method: Literal["uniform", "block"] | None = _flag(
        None, "With --recompute-granularity full: uniform recomputes every layer (Megatron: in chunks of "
              "--recompute-num-layers; torch: layer by layer), block only the first --recompute-num-layers "
              "layers. Default: uniform.", choices=("uniform", "block"))
    recompute_num_layers: int | None = _flag(
        None, "Layers per recomputed chunk (uniform) or layers recomputed (block). Default: 1 (uniform), "
              "every layer (block).")
    seed: int = _flag(42, "Random seed.")

    # ---- LoRA ----
    lora_rank: int = _flag(16, "Slot width: the largest adapter rank (adapters may use less).")
    lora_alpha: float = _flag(16.0, "Default LoRA alpha of an adapter.")
    target_modules: str = _flag("all-linear", "'all-linear' or a comma list such as q_proj,v_proj.")
    lora_unembed: bool = _flag(
        False, "Every slot also carries a LoRA on the unembedding (lm_head, A: hidden -> rank, B: rank -> "
               "vocabulary), trained like the others: server-driven adapters train it, and a Tinker model "
               "with lora_config.train_unembed=True (the SDK's default) does; one with train_unembed=False "
               "keeps it at zero. Off: no slot has one and train_unembed=True is refused. Torch backend only.")
    lora_dropout: float = _flag(0.0, "LoRA dropout; the slot LoRA layers have none, so only 0 has an effect.")

    # ---- engines and router ----
    rollout_engine: Literal["builtin", "sglang"] = _flag("builtin", "Inference server kind.")
    engine_lora_update: Literal["in_place", "versioned"] = _flag(
        "in_place", "How pushed LoRA weights reach the engines: in_place (one name per slot, tensors broadcast "
                    "over a weights-update group, replaced between decode steps) or versioned (a new name per "
                    "push loaded from a PEFT directory beside the previous version; for SGLang without upsert).")
    overlap_weight_push: bool = _flag(
        True, "Run the push of the adapters that stepped behind the next generate and train (the loop waits for "
              "it at the end of the iteration); staleness is counted against the trainer's weights, so groups "
              "generated while it runs count one version older. --no-overlap-weight-push pushes before generating.")
    engine_python: str | None = _flag(
        None, "Python interpreter that runs each SGLang server (default: this one). SGLang pins its own torch "
              "and transformers, so it usually lives in a virtual environment of its own, e.g. .venv-sglang/bin/python.")
    rollout_num_engines: int | None = _flag(
        None, "Inference engines (one server process each); default: --rollout-num-gpus over "
              "--rollout-num-gpus-per-engine, else 1.")
    rollout_num_gpus: int | None = _flag(None, "GPUs of all inference engines (Miles' placement; sets --rollout-num-engines).")
    rollout_num_gpus_per_engine: int = _flag(1, "GPUs per engine (sglang tensor parallel size).")
    engine_max_running_requests: int = _flag(64, "Most requests an engine decodes at once.")
    engine_num_threads: int = _flag(1, "torch threads of each builtin engine on CPU (SGLang engines: not used).")
    sglang_router_ip: str | None = _flag(None, "Use a running sglang-router at this address.")
    sglang_router_port: int | None = _flag(None, "Port of the running router (with --sglang-router-ip).")
    sglang_server_args: list[str] = _flag(
        [], "Arguments for `sglang.launch_server`, collected from every other --sglang-NAME [VALUE] flag "
            "(--sglang-mem-fraction-static 0.8 -> --mem-fraction-static 0.8).", nargs="*")
    pause_generation_mode: Literal["abort", "retract", "in_place"] = _flag(
        "retract", "How SGLang pauses in-flight requests for a weight update (Miles); the trainer does not pause engines.")

    # ---- rollout ----
    rollout_batch_size: int = _flag(8, "Prompt groups per optimizer step of an adapter (default of adapters).")
    n_samples_per_prompt: int = _flag(4, "Responses per prompt (default of adapters).")
    global_batch_size: int | None = _flag(None, "Samples per train batch (default: rollout_batch_size * n_samples_per_prompt).")
    rollout_max_response_len: int = _flag(1024, "max_new_tokens of each generation.")
    rollout_temperature: float = _flag(1.0, "Sampling temperature.")
    rollout_top_p: float = _flag(1.0, "Top-p of sampling.")
    rollout_top_k: int = _flag(-1, "Top-k of sampling (-1: off).")
    rollout_stop: list[str] = _flag([], "Stop strings.", nargs="*")
    apply_chat_template: bool = _flag(False, "Apply the tokenizer's chat template to prompts.")
    rollout_shuffle: bool = _flag(False, "Shuffle each adapter's prompts, anew every epoch (seeded by --rollout-seed).")
    rollout_seed: int = _flag(42, "Seed of the prompt shuffle (--rollout-shuffle).")
    rollout_max_prompt_len: int | None = _flag(
        None, "Drop prompts longer than this many tokens when a dataset is read (before num_step is derived).")
    input_key: str = _flag("input", "Prompt key of dataset rows for --prompt-data (adapters default to 'text', as Miles).")
    label_key: str | None = _flag(None, "Label key of dataset rows (default of adapters; unset: no label).")
    metadata_key: str = _flag("metadata", "Metadata key of dataset rows (default of adapters).")
    rm_type: str | None = _flag(None, "Built-in reward (default of adapters), e.g. math, exact, f1.")
    rm_url: str | None = _flag(None, "Reward server of --rm-type remote_rm, e.g. http://127.0.0.1:8000.")
    reward_key: str | None = _flag(None, "Key of the score in a reward that returns a dict.")
    group_rm: bool = _flag(False, "Reward a whole prompt group with one call of the custom reward.")
    custom_rm_path: str | None = _flag(None, "Dotted path to fn(args, sample) -> float (default of adapters).")
    dynamic_sampling_filter_path: str | None = _flag(None, "Dotted path to fn(args, samples) -> DynamicFilterOutput or bool keeping a group (default of adapters).")
    custom_generate_function_path: str | None = _flag(None, "Dotted path to async fn(input: GenerateFnInput) -> Sample replacing single-turn generation (default of adapters).")
    rollout_sample_filter_path: str | None = _flag(None, "Dotted path to fn(args, data: list[list[Sample]]) run on each kept group before it is buffered; it sets sample.remove_sample (no loss) or edits loss_mask.")
    max_weight_staleness: int | None = _flag(None, "Drop groups generated more than this many pushes ago.")
    rollout_buffer_steps: int | None = _flag(1, "Generate at most this many optimizer steps of groups ahead per adapter (bounds off-policy lag).")

    # ---- training ----
    lr: float = _flag(1e-4, "Learning rate (default of adapters).")
    min_lr: float = _flag(0.0, "Final learning rate of decaying schedules.")
    weight_decay: float = _flag(0.0, "AdamW weight decay (default of adapters).")
    lr_decay_style: Literal["constant", "linear", "cosine"] = _flag("constant", "LR schedule (default of adapters).")
    lr_warmup_steps: int = _flag(0, "Warmup in optimizer steps (default of adapters); Miles' --lr-warmup-iters.",
                                 aliases=("--lr-warmup-iters",))
    metrics_naming: Literal["ours", "miles"] = _flag(
        "ours", "Adapter metric names in W&B and TensorBoard: ours, adapters/{name}/{metric} against "
                "adapters/{name}/step, or miles, {name}/{metric} against {name}/step as Miles names them.")
    lr_warmup_init: float = _flag(0.0, "LR of an adapter's first warmup step (capped at its lr), rising "
                                       "linearly to its lr over the warmup, as Megatron's --lr-warmup-init.")
    optimizer: Literal["adam"] = _flag("adam", "Optimizer: one Adam (decoupled weight decay) per adapter slot.")
    adam_beta1: float = _flag(0.9, "AdamW beta1.")
    adam_beta2: float = _flag(0.999, "AdamW beta2.")
    adam_eps: float = _flag(1e-8, "AdamW epsilon.")
    clip_grad: float = _flag(1.0, "Per-adapter gradient norm clip (0: off).")

    # ---- loss and advantages (Miles' names and defaults; together they build `loss`) ----
    advantage_estimator: str = _flag("grpo", "grpo, gspo, reinforce_plus_plus or reinforce_plus_plus_baseline.", loss=True)
    disable_grpo_std_normalization: bool = _flag(False, "Dr. GRPO: centre group rewards without dividing by their std.", loss=True)
    disable_rewards_normalization: bool = _flag(False, "Use raw rewards (no group centring).", loss=True)
    normalize_advantages: bool = _flag(False, "Whiten advantages over the response tokens of an adapter's samples.", loss=True)
    gamma: float = _flag(1.0, "Discount of the reinforce++ token rewards.", loss=True)
    kl_coef: float = _flag(0.0, "KL penalty shaping the reward before the advantage (reinforce++ estimators only).", loss=True)
    use_kl_loss: bool = _flag(False, "Add a KL-to-the-base-model term (slot switched off) to the loss.", loss=True)
    kl_loss_coef: float = _flag(0.0, "Weight of the KL loss term (with --use-kl-loss).", loss=True)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = _flag("k1", "KL estimator of the loss term.", loss=True)
    use_unbiased_kl: bool = _flag(False, "Weight the KL term by the importance ratio.", loss=True)
    entropy_coef: float = _flag(0.0, "Entropy bonus: the loss minus this times the token-mean entropy.", loss=True)
    eps_clip: float = _flag(0.2, "PPO clip range (lower).", loss=True)
    eps_clip_high: float | None = _flag(None, "PPO clip range (upper; default: --eps-clip).", loss=True)
    eps_clip_c: float | None = _flag(None, "Dual-clip PPO lower bound for negative advantages (> 1).", loss=True)
    use_tis: bool = _flag(False, "Truncated importance sampling against the engine's logprobs.", loss=True)
    tis_clip: float = _flag(2.0, "Upper bound of the TIS weight.", loss=True)
    tis_clip_low: float = _flag(0.0, "Lower bound of the TIS weight.", loss=True)
    use_rollout_logprobs: bool = _flag(False, "Use the engine's logprobs as the old policy's.", loss=True)
    custom_tis_function_path: str | None = _flag(None, "Dotted path of a custom TIS function (Miles' signature).", loss=True)
    calculate_per_token_loss: bool = _flag(
        False, "Miles: normalize the loss per token over the batch; multi-LoRA refuses it (each sample is a token "
               "mean, weighted by its adapter batch).")

    # ---- drivers ----
    prompt_data: str | None = _flag(None, "train_async: dataset of the single policy (jsonl, json or parquet).")
    num_rollout: int = _flag(100, "train_async: rollouts to train on.")
    start_rollout_id: int = _flag(0, "train_async: first rollout id.")
    update_weights_interval: int = _flag(1, "train_async: push weights every N rollouts.")
    save: str | None = _flag(None, "Root of adapter save directories ({save}/adapters/{name}).")
    save_interval: int | None = _flag(None, "Save an adapter every N of its steps.")
    run_dir: str | None = _flag(None, "Where metrics go (default: --save, else runs/latest).")
    dump_details: str | None = _flag(None, "Write each adapter's trained batches (prompts, responses, rewards, advantages, per-token texts and logprobs) as JSON to DIR/rollouts/{adapter}/rollout_{id:08d}.json, in a background thread (Miles' flag; here bounded, see --dump-details-keep).", metavar="DIR")
    dump_details_keep: int = _flag(8, "With --dump-details: the newest files kept per adapter.")
    use_wandb: bool = _flag(False, "Also log metrics to Weights & Biases.")
    wandb_project: str | None = _flag(None, "W&B project.")
    wandb_group: str | None = _flag(None, "W&B run group.")
    wandb_key: str | None = _flag(None, "W&B API key to log in with.")
    disable_wandb_random_suffix: bool = _flag(False, "Name the W&B run without a random suffix.")

    # ---- multi-LoRA ----
    multi_lora_n_adapters: int = _flag(0, "Slots of the LoRA page table (0: multi-LoRA off).")
    multi_lora_adapter: list[tuple[str, str]] = _flag([], "NAME PATH of an adapter YAML to register at start (repeatable).", nargs=2, action="append", metavar=("NAME", "PATH"))
    multi_lora_adapters: list[str] = _flag([], "Adapter YAMLs to register at start (name = file stem).", nargs="+")
    multi_lora_queue_size: int = _flag(DEFAULT_QUEUE_SIZE, "Registrations that may wait for a slot when every slot is held: they are QUEUED and take freed slots by priority, then in arrival order (0: refuse them with 409, as Miles does).")
    multi_lora_idle_evict_s: float = _flag(0.0, "Page a Tinker client's model out of its slot once it has had no command for this many seconds: its weights, optimizer moments, pending gradient and clock go to its save directory and the slot is freed; its next command pages it back in (0: never).")
    multi_lora_idle_poll_s: float = _flag(5.0, "Service mode: seconds between polls while no adapter is live.")
    multi_lora_api_host: str = _flag("127.0.0.1", "Bind address of the control plane.")
    multi_lora_api_port: int = _flag(8068, "Port of the control plane (0: ephemeral).")
    multi_lora_api_token: str | None = _flag(None, "Bearer token required on every route but /health (or env MILES_API_TOKEN).")
    multi_lora_allowed_roots: list[str] = _flag([], "Roots that paths in requests must resolve inside (default: cwd and --save).", nargs="+")
    multi_lora_allowed_plugin_modules: list[str] = _flag([], "Modules (with their submodules) whose functions an adapter registered over HTTP may name as its reward, generate function, filters or TIS function (default: miles and the modules of the plug-ins this command line names).", nargs="+")
    multi_lora_disable_service_mode: bool = _flag(False, "Exit when no adapter is left instead of idling.")
    multi_lora_max_adapter_global_batch_size: int | None = _flag(None, "Largest rollout_batch_size * n_samples_per_prompt of an adapter (default: 4 x global batch).")
    multi_lora_max_coalesce_wait_s: float = _flag(0.5, "Ship a non-empty batch after this long without progress.")
    multi_lora_max_empty_wait_s: float = _flag(30.0, "Raise EmptyBatchTimeoutError after this long with nothing to train.")
    multi_lora_max_consecutive_failures: int = _flag(32, "Prompt groups of one adapter that may fail in a row (its reward, generate function, filter or prompt raised) before it is FAILED: its requests aborted, saved, slot freed, last error in its status; the others train on (0: never). 32 outlasts one burst of a flaky reward service failing the groups one adapter has in flight, yet stops an adapter that fails every group within seconds of generation.")
    multi_lora_max_consecutive_filtered: int = _flag(256, "Prompt groups of one adapter that its dynamic sampling filter may drop in a row before it is FAILED (0: never). A filter that keeps 1 group in 20 drops 256 in a row with probability 2e-6; one that drops everything is stopped.")
    multi_lora_backend_path: str | None = _flag(None, "Dotted path of a MultiLoRABackend subclass.")
    multi_lora_http_server_path: str | None = _flag(None, "Dotted path of a MultiLoRAHTTPServer subclass.")

    # ---- Megatron backend (kept for --train-backend megatron; no effect with torch) ----
    megatron_to_hf_mode: str | None = _flag(None, "Megatron <-> HF weight conversion.", megatron=True)
    tensor_model_parallel_size: int = _flag(1, "Megatron tensor-parallel size.", megatron=True)
    pipeline_model_parallel_size: int = _flag(1, "Megatron pipeline-parallel size (multi-LoRA needs 1).", megatron=True)
    context_parallel_size: int = _flag(1, "Megatron context-parallel size.", megatron=True)
    expert_model_parallel_size: int = _flag(1, "Megatron expert-parallel size.", megatron=True)
    expert_tensor_parallel_size: int | None = _flag(None, "Megatron expert tensor-parallel size.", megatron=True)
    sequence_parallel: bool = _flag(False, "Megatron sequence parallelism.", megatron=True)
    attention_dropout: float | None = _flag(None, "Megatron attention dropout.", megatron=True)
    hidden_dropout: float | None = _flag(None, "Megatron hidden dropout.", megatron=True)
    accumulate_allreduce_grads_in_fp32: bool = _flag(False, "Megatron gradient accumulation in fp32.", megatron=True)
    attention_softmax_in_fp32: bool = _flag(False, "Megatron attention softmax in fp32.", megatron=True)
    attention_backend: str | None = _flag(None, "Megatron attention backend.", megatron=True)
    # Megatron model shape (the torch backend reads the shape from --hf-checkpoint)
    num_layers: int | None = _flag(None, "Megatron model: layers.", megatron=True)
    hidden_size: int | None = _flag(None, "Megatron model: hidden size.", megatron=True)
    ffn_hidden_size: int | None = _flag(None, "Megatron model: MLP size.", megatron=True)
    num_attention_heads: int | None = _flag(None, "Megatron model: attention heads.", megatron=True)
    group_query_attention: bool = _flag(False, "Megatron model: grouped-query attention.", megatron=True)
    num_query_groups: int | None = _flag(None, "Megatron model: query groups.", megatron=True)
    kv_channels: int | None = _flag(None, "Megatron model: channels per head.", megatron=True)
    swiglu: bool = _flag(False, "Megatron model: SwiGLU MLP.", megatron=True)
    use_rotary_position_embeddings: bool = _flag(False, "Megatron model: rotary embeddings.", megatron=True)
    rotary_base: int | None = _flag(None, "Megatron model: rotary base.", megatron=True)
    disable_bias_linear: bool = _flag(False, "Megatron model: no linear biases.", megatron=True)
    normalization: str | None = _flag(None, "Megatron model: normalization (e.g. RMSNorm).", megatron=True)
    norm_epsilon: float | None = _flag(None, "Megatron model: normalization epsilon.", megatron=True)
    qk_layernorm: bool = _flag(False, "Megatron model: query/key layer norm.", megatron=True)
    vocab_size: int | None = _flag(None, "Megatron model: vocabulary size.", megatron=True)

    loss: LossSettings = field(init=False, repr=False, compare=False, metadata={"derived": True})
    """The loss and advantage flags as one `LossSettings` (adapters may override keys)."""
    multi_lora_registry_path: str | None = _flag(None, "SQLite file the adapter registry is kept in (default: {--save or --run-dir}/controller/registry.sqlite; 'none': memory only).")
    multi_lora_max_dataset_bytes: int = _flag(2 * 1024**3, "Largest dataset file a registration reads (400 above it).")
    multi_lora_dataset_timeout_s: float = _flag(120.0, "Seconds a registration may spend reading its dataset (400 after).")

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        try:  # before eps_clip_high is filled, so an adapter's eps_clip still moves its upper bound
            set_("loss", LossSettings.from_flags(**{name: getattr(self, name) for name in LOSS_FLAGS}))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        set_("actor_num_workers", self._placed_train_ranks())
        set_("rollout_num_engines", self._placed_engines())
        if self.global_batch_size is None:
            set_("global_batch_size", self.rollout_batch_size * self.n_samples_per_prompt)
        if self.multi_lora_max_adapter_global_batch_size is None:
            set_("multi_lora_max_adapter_global_batch_size", 4 * self.global_batch_size)
        if self.eps_clip_high is None:
            set_("eps_clip_high", self.eps_clip)
        if self.multi_lora_api_token is None and os.environ.get("MILES_API_TOKEN"):
            set_("multi_lora_api_token", os.environ["MILES_API_TOKEN"])
        set_("multi_lora_adapter", [tuple(pair) for pair in self.multi_lora_adapter])
        self._validate()

    def _placed_train_ranks(self) -> int:
        """`--actor-num-workers`, else Miles' placement: nodes x GPUs per node over the
        Megatron model-parallel size (1 for the torch backend), else 1."""
        if self.actor_num_nodes is None and self.actor_num_gpus_per_node is None:
            return 1 if self.actor_num_workers is None else self.actor_num_workers
        world = (self.actor_num_nodes or 1) * (self.actor_num_gpus_per_node or 1)
        model_parallel = 1
        if self.train_backend == "megatron":
            model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        if world <= 0 or world % model_parallel:
            raise ConfigError(
                f"--actor-num-nodes x --actor-num-gpus-per-node = {world} is not a positive multiple of "
                f"the model-parallel size {model_parallel} (tensor x pipeline x context)"
            )
        ranks = world // model_parallel
        if self.actor_num_workers is not None and self.actor_num_workers != ranks:
            raise ConfigError(
                f"--actor-num-workers {self.actor_num_workers} disagrees with --actor-num-nodes x "
                f"--actor-num-gpus-per-node ({ranks} data-parallel ranks); give one or the other"
            )
        return ranks

    def _placed_engines(self) -> int:
        """`--rollout-num-engines`, else Miles' `--rollout-num-gpus / --rollout-num-gpus-per-engine`, else 1."""
        if self.rollout_num_gpus is None:
            return 1 if self.rollout_num_engines is None else self.rollout_num_engines
        per_engine = self.rollout_num_gpus_per_engine
        if self.rollout_num_gpus <= 0 or per_engine <= 0 or self.rollout_num_gpus % per_engine:
            raise ConfigError(
                f"--rollout-num-gpus {self.rollout_num_gpus} must be a positive multiple of "
                f"--rollout-num-gpus-per-engine {per_engine}"
            )
        engines = self.rollout_num_gpus // per_engine
        if self.rollout_num_engines is not None and self.rollout_num_engines != engines:
            raise ConfigError(
                f"--rollout-num-engines {self.rollout_num_engines} disagrees with --rollout-num-gpus / "
                f"--rollout-num-gpus-per-engine ({engines} engines); give one or the other"
            )
        return engines

    def _validate(self) -> None:
        positive = ["actor_num_workers", "rollout_num_engines", "lora_rank", "rollout_batch_size",
                    "n_samples_per_prompt", "global_batch_size", "rollout_max_response_len",
                    "engine_max_running_requests", "update_weights_interval", "actor_num_cpus_per_worker",
                    "engine_num_threads"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag_name(name)} must be > 0, got {getattr(self, name)}")
        if self.multi_lora_n_adapters < 0:
            raise ConfigError("--multi-lora-n-adapters must be >= 0 (0 turns multi-LoRA off)")
        if self.multi_lora_queue_size < 0:
            raise ConfigError("--multi-lora-queue-size must be >= 0 (0 refuses a registration that finds no free slot)")
        if self.multi_lora_idle_evict_s < 0:
            raise ConfigError("--multi-lora-idle-evict-s must be >= 0 (0 never pages an idle client model out)")
        if self.lora_alpha <= 0:
            raise ConfigError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if (self.sglang_router_ip is None) != (self.sglang_router_port is None):
            raise ConfigError("give both --sglang-router-ip and --sglang-router-port, or neither")
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError("--save-interval must be > 0 (leave it out to save only at cleanup and exit)")
        if self.rollout_buffer_steps is not None and self.rollout_buffer_steps <= 0:
            raise ConfigError("--rollout-buffer-steps must be > 0 (leave it out for no limit)")
        for name in ("multi_lora_max_consecutive_failures", "multi_lora_max_consecutive_filtered"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag_name(name)} must be >= 0 (0: never fail an adapter for it), "
                                  f"got {getattr(self, name)}")
        if self.max_weight_staleness is not None and self.max_weight_staleness < 0:
            raise ConfigError("--max-weight-staleness must be >= 0")
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            raise ConfigError("--micro-batch-size must be > 0")
        if self.activation_budget_mb is not None and self.activation_budget_mb < 0:
            raise ConfigError(f"--activation-budget-mb must be >= 0 (0: the whole batch), got {self.activation_budget_mb}")
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu <= 0:
            raise ConfigError(f"--max-tokens-per-gpu must be > 0, got {self.max_tokens_per_gpu}")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ConfigError("--use-dynamic-batch-size packs micro-batches to a token budget: "
                              "give it with --max-tokens-per-gpu N")
        if self.recompute_num_layers is not None and self.recompute_num_layers <= 0:
            raise ConfigError(f"--recompute-num-layers must be > 0, got {self.recompute_num_layers}")
        if self.recompute_modules is not None and self.recompute_granularity != "selective":
            raise ConfigError("--recompute-modules picks what --recompute-granularity selective recomputes; add it, "
                              "or drop --recompute-modules")
        if self.recompute_modules and self.train_backend == "torch" and (
                unknown := sorted(set(self.recompute_modules) - set(TORCH_RECOMPUTE_MODULES))):
            raise ConfigError(f"--recompute-modules {' '.join(unknown)}: the torch backend recomputes "
                              f"{', '.join(TORCH_RECOMPUTE_MODULES)} (the others are parts of MoE and MLA layers)")
        if self.recompute_granularity != "full" and (self.recompute_method or self.recompute_num_layers):
            raise ConfigError("--recompute-method and --recompute-num-layers apply to --recompute-granularity full; "
                              "add it, or drop them")
        if self.dump_details_keep <= 0:
            raise ConfigError(f"--dump-details-keep must be > 0, got {self.dump_details_keep}")
        if self.lr_warmup_init < 0:
            raise ConfigError(f"--lr-warmup-init must be >= 0, got {self.lr_warmup_init}")
        if self.rollout_max_prompt_len is not None and self.rollout_max_prompt_len <= 0:
            raise ConfigError("--rollout-max-prompt-len must be > 0 (leave it out to keep every prompt)")
        if self.calculate_per_token_loss and self.multi_lora_n_adapters > 0:
            raise ConfigError("multi-LoRA normalizes each sample by its adapter batch (a token mean per sample); "
                              "drop --calculate-per-token-loss (Miles refuses it with multi-LoRA too)")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.train_backend == "megatron" and self.multi_lora_n_adapters > 0 and self.pipeline_model_parallel_size != 1:
            raise ConfigError("multi-LoRA needs --pipeline-model-parallel-size 1 (no rank would hold a whole adapter)")
        if self.train_backend == "megatron" and self.lora_unembed:
            raise ConfigError("--lora-unembed is not built for --train-backend megatron (its vocabulary-parallel "
                              "head has no slot LoRA): drop --lora-unembed or use --train-backend torch")
        if self.train_backend == "megatron" and self.tensor_model_parallel_size <= 0:
            raise ConfigError(f"--tensor-model-parallel-size must be > 0, got {self.tensor_model_parallel_size}")
        for token in self.sglang_server_args:
            if token.startswith("--") and token[2:].replace("-", "_") in SGLANG_ARGS_SET_BY_TRAINER:
                raise ConfigError(
                    f"--sglang-{token[2:]} is set by the trainer "
                    f"(from {SGLANG_ARGS_SET_BY_TRAINER[token[2:].replace('-', '_')]}); use that flag instead"
                )
        names = [name for name, _ in self.multi_lora_adapter] + [Path(p).stem for p in self.multi_lora_adapters]
        if len(set(names)) != len(names):
            raise ConfigError(f"adapter names given at start must be unique, got {names}")
        if names and self.multi_lora_n_adapters == 0:
            raise ConfigError("adapters were given but --multi-lora-n-adapters is 0: set it to the number of slots")
        room = self.multi_lora_n_adapters + self.multi_lora_queue_size
        if len(names) > room and self.multi_lora_n_adapters > 0:
            raise ConfigError(f"{len(names)} adapters given at start but only {self.multi_lora_n_adapters} slots and "
                              f"{self.multi_lora_queue_size} queue places: raise --multi-lora-n-adapters "
                              "or --multi-lora-queue-size")

    @property
    def plugin_modules(self) -> tuple[str, ...]:
        """What `--multi-lora-allowed-plugin-modules` allows; by default `miles` and the module of
        every plug-in this command line names."""
        if self.multi_lora_allowed_plugin_modules:
            return tuple(self.multi_lora_allowed_plugin_modules)
        own = (self.custom_rm_path, self.custom_generate_function_path, self.dynamic_sampling_filter_path,
               self.rollout_sample_filter_path, self.loss.custom_tis_function_path)
        return ("miles", *sorted({plugin_module(path) for path in own if path}))

    @property
    def initial_adapters(self) -> list[tuple[str, str]]:
        """(name, yaml path) of the adapters to register at start."""
        return list(self.multi_lora_adapter) + [(Path(p).stem, p) for p in self.multi_lora_adapters]

    @property
    def slot_target_modules(self) -> str:
        """The layers every slot's LoRA covers, as `inject_multi_lora` takes them: `--target-modules`,
        with `lm_head` added by `--lora-unembed`."""
        return f"{self.target_modules},lm_head" if self.lora_unembed else self.target_modules

    @property
    def resolved_device(self) -> str:
        """`--device auto`: cuda when this process sees a GPU or the Ray cluster it joined has one
        (a driver on a head node without GPUs still trains and serves on the workers' GPUs)."""
        if self.device != "auto":
            return self.device
        import ray
        import torch

        if torch.cuda.is_available():
            return "cuda"
        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
            return "cuda"
        return "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device == "cuda" else "float32"

    @property
    def resolved_run_dir(self) -> Path:
        if self.run_dir:
            return Path(self.run_dir)
        if self.save:
            return Path(self.save)
        return Path("runs/latest")

    def replace(self, **changes: Any) -> MilesConfig:
        return dataclasses.replace(self, **changes)


def _flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(element type, optional) of a field annotation such as `int | None`."""
    hint = annotation
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if typing.get_origin(hint) is Literal:
        return str, optional
    if typing.get_origin(hint) in (list, tuple):
        inner = typing.get_args(hint)[0]
        return (str if typing.get_origin(inner) is tuple else inner), optional
    return hint, optional


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles", description="Miles multi-LoRA asynchronous RL trainer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", default=None, help="YAML file of flag values; command-line flags win.")
    hints = typing.get_type_hints(MilesConfig)
    for f in dataclasses.fields(MilesConfig):
        if f.metadata.get("derived"):
            continue
        meta = {k: v for k, v in f.metadata.items() if k not in ("loss", "megatron")}
        help_text = meta.pop("help")
        aliases = meta.pop("aliases", ())
        elem, _ = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text, "default": argparse.SUPPRESS}
        if hints[f.name] is bool:
            kwargs.update(action=argparse.BooleanOptionalAction if f.default is True else "store_true")
        else:
            kwargs["type"] = elem
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else None
            if choices:
                kwargs["choices"] = choices
            kwargs.update(meta)
        parser.add_argument(f"--{_flag_name(f.name)}", *aliases, **kwargs)
    return parser


def _load_config_file(path: str) -> dict[str, Any]:
    try:
        data = load_yaml(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    known = _flag_fields()
    values: dict[str, Any] = {}
    sglang_args: list[str] = []
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        name = FLAG_ALIASES.get(name, name)
        if name not in known and name.startswith("sglang_"):
            sglang_args += _sglang_tokens(name.removeprefix("sglang_"), value)
            continue
        if name not in known:
            raise ConfigError(f"--config {path}: unknown flag {key!r}")
        values[name] = value
    if sglang_args:
        values["sglang_server_args"] = [*values.get("sglang_server_args", []), *sglang_args]
    if "multi_lora_adapter" in values and isinstance(values["multi_lora_adapter"], dict):
        values["multi_lora_adapter"] = list(values["multi_lora_adapter"].items())
    return check_types(values, source=f"--config {path}: ")


FLAG_ALIASES = {"lr_warmup_iters": "lr_warmup_steps"}
"""Miles' names of flags that keep our name as their field (`--lr-warmup-iters`)."""


def _flag_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(MilesConfig) if not f.metadata.get("derived")}


def _sglang_tokens(name: str, value: Any) -> list[str]:
    """`--NAME VALUE` for SGLang (a bare flag when True, nothing when False)."""
    flag = "--" + name.replace("_", "-")
    if value is True or value is None:
        return [flag]
    if value is False:
        return []
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def split_sglang_args(unknown: list[str]) -> tuple[list[str], list[str]]:
    """(SGLang server argv, tokens that are not `--sglang-*`) from argparse's leftovers.

    `--sglang-NAME [VALUE ...]` becomes `--NAME [VALUE ...]`: the values are the tokens up
    to the next `--flag`; `--sglang-NAME=VALUE` works too.
    """
    server, rest = [], []
    owner = None
    for token in unknown:
        if token.startswith(SGLANG_FLAG_PREFIX):
            name, eq, value = token[len(SGLANG_FLAG_PREFIX):].partition("=")
            server += [f"--{name}"] + ([value] if eq else [])
            owner = server
        elif token.startswith("--"):
            rest.append(token)
            owner = rest
        elif owner is not None:
            owner.append(token)
        else:
            rest.append(token)
    return server, rest


def drop_overridden_sglang_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without the arguments in SGLANG_ARGS_OVERRIDDEN, warning lines naming them)."""
    kept, warnings, skipping = [], [], False
    for token in argv:
        if token.startswith("--"):
            name = token[2:].replace("-", "_")
            skipping = name in SGLANG_ARGS_OVERRIDDEN
            if skipping:
                warnings.append(f"--sglang-{token[2:]} has no effect: the engines' value comes from "
                                f"{SGLANG_ARGS_OVERRIDDEN[name]} (as in Miles)")
                continue
        if not skipping:
            kept.append(token)
    return kept, warnings


@functools.cache
def _field_types() -> dict[str, tuple[Any, TypeAdapter[Any]]]:
    hints = typing.get_type_hints(MilesConfig)
    return {f.name: (hints[f.name], TypeAdapter(hints[f.name]))
            for f in dataclasses.fields(MilesConfig) if not f.metadata.get("derived")}


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def check_types(values: dict[str, Any], source: str = "") -> dict[str, Any]:
    """Each value converted to its field's type (pydantic's lax rules: "4" -> 4, 1e-3 ->
    0.001); ConfigError naming the key, the expected type and the value otherwise."""
    types_ = _field_types()
    checked = {}
    for name, value in values.items():
        if name not in types_:
            raise ConfigError(f"{source}unknown flag {name!r}")
        hint, adapter = types_[name]
        try:
            if isinstance(value, bool) and hint is not bool:
                raise ValueError("a boolean is not a " + _type_name(hint))
            checked[name] = adapter.validate_python(value)
        except (ValidationError, ValueError) as exc:
            reason = exc.errors(include_url=False)[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise ConfigError(
                f"{source}{name} (--{_flag_name(name)}) expects {_type_name(hint)}, got {value!r} ({reason})"
            ) from None
    return checked


def config_from_dict(values: dict[str, Any]) -> MilesConfig:
    """Build a config from field values (YAML or code), with type checks."""
    return MilesConfig(**check_types(values))


def parse_args(argv: list[str] | None = None) -> MilesConfig:
    """Parse flags (and `--config`); exit 2 with one clear line when invalid.

    Every flag given that has no effect in this configuration is logged as one warning
    line naming it (`inert_flag_warnings`)."""
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    sglang_args, rest = split_sglang_args(unknown)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        values = _load_config_file(namespace.config) if namespace.config else {}
        values.update({k: v for k, v in vars(namespace).items() if k != "config"})
        if sglang_args:
            values["sglang_server_args"] = [*values.get("sglang_server_args", []), *sglang_args]
        kept, warnings = drop_overridden_sglang_args(list(values.get("sglang_server_args", [])))
        if "sglang_server_args" in values:
            values["sglang_server_args"] = kept
        cfg = config_from_dict(values)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    for line in warnings + inert_flag_warnings(cfg, set(values)):
        logger.warning(line)
    return cfg


def inert_flag_warnings(cfg: MilesConfig, given: set[str]) -> list[str]:
    """One line per flag in `given` (field names) that has no effect with `cfg`."""
    fields = {f.name: f for f in dataclasses.fields(MilesConfig)}
    out = []

    def warn(name: str, why: str) -> None:
        out.append(f"--{_flag_name(name)} has no effect: {why}")

    defaults = LossSettings().flags()
    for name in sorted(given):
        f = fields.get(name)
        if f is None:
            continue
        value = getattr(cfg, name)
        if name == "max_tokens_per_gpu" and not cfg.use_dynamic_batch_size:
            warn(name, "it is the token budget of --use-dynamic-batch-size, which is off")
        elif name == "micro_batch_size" and cfg.use_dynamic_batch_size:
            warn(name, "with --use-dynamic-batch-size micro-batches are packed to --max-tokens-per-gpu tokens")
        elif name == "activation_budget_mb" and cfg.train_backend == "megatron":
            warn(name, "it sizes the torch backend's micro-batches; Megatron's take --micro-batch-size")
        elif name == "activation_budget_mb" and (cfg.micro_batch_size or cfg.use_dynamic_batch_size):
            which = "--use-dynamic-batch-size" if cfg.use_dynamic_batch_size else "--micro-batch-size"
            warn(name, f"{which} sets the micro-batches")
        elif f.metadata.get("megatron") and cfg.train_backend != "megatron":
            warn(name, f"it configures the Megatron backend, and this run uses --train-backend {cfg.train_backend}")
        elif name == "sglang_server_args" and value and cfg.rollout_engine != "sglang":
            for token in (t for t in value if t.startswith("--")):
                out.append(f"--sglang-{token[2:]} has no effect: it is an SGLang server argument, and this run "
                           f"uses --rollout-engine {cfg.rollout_engine}")
        elif name == "sequence_parallel" and value:
            warn(name, "the Megatron backend runs tensor parallelism without it (the same numbers; "
                       "activations are not split along the sequence)")
        elif (name == "recompute_num_layers" and value != 1 and cfg.recompute_method != "block"
              and cfg.train_backend != "megatron"):
            warn(name, "the torch backend recomputes uniformly layer by layer (the number counts with "
                       "--recompute-method block)")
        elif name == "engine_num_threads" and cfg.rollout_engine != "builtin":
            warn(name, "it sets the threads of builtin engines, and this run uses "
                       f"--rollout-engine {cfg.rollout_engine}")
        elif name == "lora_dropout" and value != 0:
            warn(name, "the slot LoRA layers apply no dropout")
        elif name == "calculate_per_token_loss" and value:
            warn(name, "the train actors take a token mean per sample")
        elif name == "pause_generation_mode":
            warn(name, "the trainer does not pause the engines for a weight update")
        elif name == "num_rollout" and cfg.multi_lora_n_adapters > 0:
            warn(name, "in multi-LoRA training each adapter stops at its own num_step (as in Miles)")
        elif name in ("wandb_group", "wandb_key", "disable_wandb_random_suffix") and value and not cfg.use_wandb:
            warn(name, "--use-wandb is not set")
        elif name == "wandb_project" and not cfg.use_wandb:
            warn(name, "--use-wandb is not set")
        elif name == "rm_url" and value and cfg.rm_type != "remote_rm":
            pass  # adapters may still name remote_rm as their rm_type
        elif name == "kl_loss_coef" and value and not cfg.loss.use_kl_loss:
            warn(name, "the KL loss term needs --use-kl-loss")
        elif (name in ("gamma", "kl_coef") and value != defaults[name]
              and not cfg.loss.advantage_estimator.startswith("reinforce_plus_plus")):
            warn(name, f"it shapes the reinforce++ advantages, and --advantage-estimator is {cfg.loss.advantage_estimator}")
        elif name == "kl_loss_type" and not cfg.loss.use_kl_loss:
            warn(name, "the KL loss term needs --use-kl-loss")
    return out


if __name__ == "__main__":  # pragma: no cover - manual inspection
    print(parse_args(sys.argv[1:]))
