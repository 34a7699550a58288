"""The command line of Miles' multi-LoRA example, kept as data for CLI compatibility tests.

Source: radixark/miles at commit MILES_COMMIT, `examples/multi_lora/run_multi_lora.py`
(`_train`, with the script's default `ScriptArgs`), which runs
`train_multi_lora_async.py` with `MODEL_ARGS` (from `scripts/models/qwen3-4B.py`, added
by `execute_train`) followed by these flags. `BOUNDED_ARGV` is `... train` (two adapters
from `adapters/*.yaml`), `SERVICE_ARGV` is `... serve`; `WANDB_ARGV` is appended when
`WANDB_API_KEY` is set (`get_default_wandb_args`). The adapter files are in
`MILES_ADAPTER_YAMLS` (their keys are data too). Paths are Miles' own; a test points
`--hf-checkpoint`, `--save` and the adapter files at local ones.
"""

from __future__ import annotations

MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"

ADAPTER_DIR = "examples/multi_lora/adapters"

MODEL_ARGV = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128",
    "--qk-layernorm",
]

_COMMON_HEAD = [
    # ckpt_args
    "--hf-checkpoint", "/root/models/Qwen3-4B", "--megatron-to-hf-mode", "bridge",
    # lora_args
    "--lora-rank", "32", "--lora-alpha", "32", "--lora-dropout", "0.0", "--target-modules", "all-linear",
    # multi_lora_args (both modes)
    "--multi-lora-n-adapters", "4", "--multi-lora-idle-poll-s", "5",
]

_BOUNDED_MULTI_LORA = [
    "--multi-lora-adapter", "dapo_math", f"{ADAPTER_DIR}/dapo_math.yaml",
    "--multi-lora-adapter", "gsm8k", f"{ADAPTER_DIR}/gsm8k.yaml",
    "--multi-lora-disable-service-mode",
]

_SERVICE_MULTI_LORA = ["--multi-lora-api-port", "8068"]

_COMMON_TAIL = [
    # sync_args
    "--pause-generation-mode", "in_place", "--max-weight-staleness", "3", "--use-tis",
    # rollout_args
    "--apply-chat-template", "--rollout-shuffle", "--num-rollout", "50", "--rollout-batch-size", "32",
    "--n-samples-per-prompt", "8", "--rollout-max-response-len", "4096", "--rollout-temperature", "1",
    "--global-batch-size", "256",
    # grpo_args
    "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-coef", "0.00", "--entropy-coef", "0.00",
    "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    # optimizer_args
    "--optimizer", "adam", "--lr", "1e-5", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # perf_args
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    # sglang_args
    "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.8",
    # topology_args
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
    # save_args
    "--save", "/tmp/multi_lora", "--save-interval", "5",
    # misc_args
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]

BOUNDED_ARGV = _COMMON_HEAD + _BOUNDED_MULTI_LORA + _COMMON_TAIL
SERVICE_ARGV = _COMMON_HEAD + _SERVICE_MULTI_LORA + _COMMON_TAIL

WANDB_ARGV = [
    "--use-wandb", "--wandb-project", "miles-run_multi_lora", "--wandb-group", "RUN_ID",
    "--wandb-key", "WANDB_API_KEY", "--disable-wandb-random-suffix",
]

MILES_ADAPTER_YAMLS = {
    "gsm8k.yaml": {
        "rank": 16,
        "alpha": 16,
        "rollout_batch_size": 32,
        "n_samples_per_prompt": 4,
        "data": "/root/datasets/gsm8k/train.parquet",
        "input_key": "messages",
        "label_key": "label",
        "rm_type": "math",
        "num_step": 400,
    },
    "dapo_math.yaml": {
        "rank": 32,
        "alpha": 32,
        "rollout_batch_size": 8,
        "n_samples_per_prompt": 8,
        "data": "/root/datasets/dapo-math-17k/dapo-math-17k.jsonl",
        "input_key": "prompt",
        "label_key": "label",
        "rm_type": "deepscaler",
        "num_step": 500,
    },
}


def flag_names(argv: list[str]) -> list[str]:
    """The distinct `--flags` of an argv, in order of first use."""
    seen: dict[str, None] = {}
    for token in argv:
        if token.startswith("--"):
            seen.setdefault(token, None)
    return list(seen)


def split_flags(argv: list[str]) -> list[list[str]]:
    """The argv cut into `[--flag, value, ...]` pieces."""
    pieces: list[list[str]] = []
    for token in argv:
        if token.startswith("--"):
            pieces.append([token])
        else:
            pieces[-1].append(token)
    return pieces
