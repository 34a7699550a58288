"""Command lines of the inference servers: the builtin engine and `sglang.launch_server`.

    cfg = EngineServerConfig.from_config(miles_cfg)
    argv = server_command(cfg, "127.0.0.1", 30000)   # builtin or sglang, per cfg.kind

Both speak SGLang's HTTP API and take SGLang's LoRA flags (`--enable-lora
--max-loras-per-batch N --max-lora-rank R --lora-target-modules ...`). SGLang spells
"every linear layer" as `all`; ours (and PEFT's) is `all-linear`, translated here.

LoRA capacity (`lora_capacity`): SGLang's `--max-loras-per-batch` counts the base model
as one adapter of a batch, and `--max-loaded-loras` must be at least that. With `N`
slots, `in_place` needs N names and `versioned` room for two versions per slot (2N), so
both flags are names + 1 (the base). Sampler snapshots of Tinker clients
(`sampler_snapshots`) add to `--max-loaded-loras` only: past it the engines evict the
least recently used snapshot and reload it on its next request (the builtin engine never
evicts a slot pushed by broadcast), so the slots of server-driven RL keep their places.
SGLang runs with one tokenizer worker, which LoRA
loading and pausing in place assume. Every flag we pass is one SGLang 0.5's
`ServerArgs` defines (tests/rollout/engines checks it against SGLang's own parser).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Literal

from miles.utils.arguments import MilesConfig
from miles.utils.types import LoraUpdateMode

EngineKind = Literal["builtin", "sglang"]

BUILTIN_URL_PREFIX = "Builtin engine server listening at "
BUILTIN_URL_LINE = re.compile(re.escape(BUILTIN_URL_PREFIX) + r"(http://\S+)")
"""The line the builtin server writes once its port is bound (with `--port 0`, the one the OS gave it)."""


@dataclass(frozen=True)
class EngineServerConfig:
    """What one inference server needs to start."""

    kind: EngineKind
    model_path: str
    n_slots: int
    """LoRA slots (`--max-loras-per-batch`); at least 1."""
    max_lora_rank: int
    target_modules: str
    """`all-linear` or a comma list such as `q_proj,v_proj`, either with `lm_head` added by
    `--lora-unembed` (`all-linear,lm_head`)."""
    dtype: str = "float32"
    device: str = "cpu"
    max_running_requests: int = 64
    seed: int = 0
    tp_size: int = 1
    num_threads: int = 1
    """torch threads of a builtin engine on CPU (`--engine-num-threads`)."""
    lora_update: LoraUpdateMode = "in_place"
    """How pushes reach the server (`--engine-lora-update`)."""
    python: str = sys.executable
    """Interpreter that runs the server. SGLang pins its own torch and transformers, so it
    may live in a virtual environment of its own (`scripts/gpu_check.py` makes one)."""
    extra_args: tuple[str, ...] = ()
    """Appended to the server's command line as given (e.g. `--mem-fraction-static 0.5` for SGLang)."""
    sampler_snapshots: int = 0
    """Room for this many Tinker sampler snapshots loaded beside the slots (`--max-loaded-loras`)."""

    @classmethod
    def from_config(cls, cfg: MilesConfig, *, lora_update: LoraUpdateMode = "in_place") -> EngineServerConfig:
        if cfg.hf_checkpoint is None:
            raise ValueError("--hf-checkpoint is required to start inference engines: give the base model directory")
        return cls(
            kind=cfg.rollout_engine, model_path=cfg.hf_checkpoint, n_slots=max(1, cfg.multi_lora_n_adapters),
            max_lora_rank=cfg.lora_rank, target_modules=cfg.slot_target_modules, dtype=cfg.resolved_dtype,
            device=cfg.resolved_device, max_running_requests=cfg.engine_max_running_requests, seed=cfg.seed,
            tp_size=cfg.rollout_num_gpus_per_engine, num_threads=cfg.engine_num_threads, lora_update=lora_update,
            extra_args=tuple(cfg.sglang_server_args) if cfg.rollout_engine == "sglang" else (),
            python=cfg.engine_python or sys.executable,
        )

    def lora_capacity(self) -> int:
        """Adapters loaded at once (and per batch), base model included: see the module docstring."""
        names = self.n_slots * (2 if self.lora_update == "versioned" else 1)
        return names + 1

    def max_loaded_loras(self) -> int:
        """`--max-loaded-loras`: the slots' capacity plus room for sampler snapshots."""
        return self.lora_capacity() + self.sampler_snapshots

    def target_module_list(self) -> list[str]:
        """`--lora-target-modules` of the server: the names (`all-linear` whole), `lm_head` as
        SGLang and PEFT name the unembedding."""
        return [name.strip() for name in self.target_modules.split(",") if name.strip()]


def build_builtin_command(cfg: EngineServerConfig, host: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "miles.rollout.engines.builtin_server",
        "--model-path", cfg.model_path, "--host", host, "--port", str(port),
        "--max-loras-per-batch", str(cfg.lora_capacity()), "--max-loaded-loras", str(cfg.max_loaded_loras()),
        "--engine-lora-update", cfg.lora_update,
        "--max-lora-rank", str(cfg.max_lora_rank), "--lora-target-modules", *cfg.target_module_list(),
        "--dtype", cfg.dtype, "--device", cfg.device,
        "--max-running-requests", str(cfg.max_running_requests),
        "--random-seed", str(cfg.seed), "--num-threads", str(cfg.num_threads), *cfg.extra_args,
    ]


def build_sglang_command(cfg: EngineServerConfig, host: str, port: int) -> list[str]:
    targets = ["all" if name == "all-linear" else name for name in cfg.target_module_list()]
    return [
        cfg.python, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path, "--host", host, "--port", str(port),
        "--enable-lora", "--max-loras-per-batch", str(cfg.lora_capacity()),
        "--max-loaded-loras", str(cfg.max_loaded_loras()), "--max-lora-rank", str(cfg.max_lora_rank),
        "--lora-target-modules", *targets,
        "--dtype", cfg.dtype, "--tp-size", str(cfg.tp_size), "--tokenizer-worker-num", "1",
        "--max-running-requests", str(cfg.max_running_requests), "--random-seed", str(cfg.seed), *cfg.extra_args,
    ]


def server_command(cfg: EngineServerConfig, host: str, port: int) -> list[str]:
    if cfg.kind == "builtin":
        return build_builtin_command(cfg, host, port)
    if cfg.kind == "sglang":
        return build_sglang_command(cfg, host, port)
    raise ValueError(f"unknown engine kind {cfg.kind!r}: use 'builtin' or 'sglang'")
