"""Fixtures of the Tinker tests that sample: one builtin engine on the tiny model behind a
real sglang-router (port 0), and a random PEFT adapter that a test-side driver writes
where a `save_weights_for_sampler` says: made once per test process (a few seconds) for
every module here that asks."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ENGINE_MAX_RANK = 4
"""The engine's `--max-lora-rank`, and the rank of the adapter the drivers write."""


@pytest.fixture(scope="session")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random rank-4 PEFT adapter of the tiny model (B non-zero, so it changes the model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles import lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rank = ENGINE_MAX_RANK
    lora.inject_multi_lora(model, n_slots=1, max_rank=rank, target_modules="all-linear")
    generator = torch.Generator().manual_seed(3)
    lora.init_slot(model, 0, rank=rank, alpha=2.0 * rank, generator=generator)
    weights = {k: torch.randn(v.shape, generator=generator) * 0.5 if k.endswith("lora_B.weight") else v
               for k, v in lora.get_slot_weights(model, 0).items()}
    lora.set_slot_weights(model, 0, weights, rank=rank, alpha=2.0 * rank)
    return lora.export_peft_adapter(model, 0, tmp_path_factory.mktemp("snapshot") / "adapter")


@pytest.fixture(scope="session")
def router_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from miles.rollout.engines.process import ServerProcess
    from miles.rollout.engines.router import Router
    from miles.rollout.engines.server_command import BUILTIN_URL_LINE

    logs = tmp_path_factory.mktemp("sampling_logs")
    command = [sys.executable, "-m", "miles.rollout.engines.builtin_server", "--model-path", str(tiny_model_dir),
               "--host", "127.0.0.1", "--port", "0", "--max-loras-per-batch", "2",
               "--max-lora-rank", str(ENGINE_MAX_RANK), "--lora-target-modules", "all-linear", "--dtype", "float32",
               "--device", "cpu", "--num-threads", "1", "--max-loaded-loras", "2"]
    engine, engine_url = asyncio.run(ServerProcess.start(
        command, log_path=logs / "builtin.log", url_line=BUILTIN_URL_LINE, timeout_s=120, what="builtin server",
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}))
    try:
        router = asyncio.run(Router.launch([engine_url], log_path=logs / "router.log"))
        yield router.url
        asyncio.run(router.shutdown())
    finally:
        engine.terminate()
