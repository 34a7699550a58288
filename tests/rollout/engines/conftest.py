"""Fixtures of the engine tests: LoRA adapters, a trainer-side reference, live servers.

The adapters are random PEFT directories written from the slot page table (B is made
non-zero so each adapter really changes the model). The reference is what a train rank
computes: the same tiny model in-process with the same adapters in its slots.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles import lora
from miles.rollout.engines.process import ServerProcess
from miles.rollout.engines.server_command import BUILTIN_URL_LINE

ENGINE_SLOTS = 5
MAX_RANK = 4
ADAPTER_RANKS = {"ad0": 4, "ad1": 2, "ad2": 4, "alt": 4}
"""Adapters made for the tests; ad0..ad2 are loaded at server start, alt is loaded by tests."""


def make_adapters(model_dir: Path, out: Path, ranks: dict[str, int], seed: int) -> dict[str, Path]:
    """Write one random PEFT adapter directory per name (rank as given)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora.inject_multi_lora(model, n_slots=1, max_rank=max(ranks.values()), target_modules="all-linear")
    generator = torch.Generator().manual_seed(seed)
    dirs = {}
    for name, rank in ranks.items():
        lora.init_slot(model, 0, rank=rank, alpha=2.0 * rank, generator=generator)
        weights = lora.get_slot_weights(model, 0)
        for key, value in weights.items():
            if key.endswith("lora_B.weight"):
                weights[key] = torch.randn(value.shape, generator=generator) * 0.5
        lora.set_slot_weights(model, 0, weights, rank=rank, alpha=2.0 * rank)
        dirs[name] = lora.export_peft_adapter(model, 0, out / name)
    return dirs


@dataclass
class Scored:
    greedy_tokens: list[int]
    """Argmax of the trainer's logits at each response position."""
    logprobs: list[float]
    """Trainer logprobs of the given response tokens."""


class TrainerReference:
    """The tiny model with the test adapters in slots, scored the way a train rank does."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path]):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        lora.inject_multi_lora(self.model, n_slots=len(adapters), max_rank=MAX_RANK, target_modules="all-linear")
        self.slots = {}
        for slot, (name, path) in enumerate(sorted(adapters.items())):
            lora.load_peft_adapter(self.model, slot, path)
            self.slots[name] = slot

    @torch.no_grad()
    def score(self, prompt_ids: list[int], response_ids: list[int], adapter: str | None) -> Scored:
        ids_1T = torch.tensor([prompt_ids + response_ids])
        with lora.use_slots(self.model, [self.slots[adapter] if adapter else -1]):
            logits_TV = self.model(ids_1T).logits[0].float()
        positions = slice(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1)
        logprobs_RV = torch.log_softmax(logits_TV[positions], dim=-1)
        picked = logprobs_RV.gather(1, torch.tensor(response_ids)[:, None])[:, 0]
        return Scored(logprobs_RV.argmax(dim=-1).tolist(), picked.tolist())


@pytest.fixture(scope="session")
def lora_max_rank() -> int:
    return MAX_RANK


@pytest.fixture(scope="session")
def engine_adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("engine_adapters"), ADAPTER_RANKS, seed=7)


@pytest.fixture(scope="session")
def trainer_reference(tiny_model_dir, engine_adapters) -> TrainerReference:
    return TrainerReference(tiny_model_dir, engine_adapters)


def launch_builtin(model_dir: Path, log_dir: Path, *, lora_paths: dict[str, Path], slots: int = ENGINE_SLOTS,
                   extra: list[str] | None = None) -> tuple[ServerProcess, str]:
    """A builtin server on a port the OS picks (it reports the port in its log)."""
    command = [sys.executable, "-m", "miles.rollout.engines.builtin_server", "--model-path", str(model_dir),
               "--host", "127.0.0.1", "--port", "0", "--max-loras-per-batch", str(slots),
               "--max-lora-rank", str(MAX_RANK), "--lora-target-modules", "all-linear", "--dtype", "float32",
               "--device", "cpu", "--num-threads", "1", *(extra or [])]
    if lora_paths:
        command += ["--lora-paths", *[f"{name}={path}" for name, path in lora_paths.items()]]
    return asyncio.run(ServerProcess.start(command, log_path=log_dir / "builtin.log", url_line=BUILTIN_URL_LINE,
                                           timeout_s=120, what="builtin server",
                                           env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}))


@pytest.fixture(scope="session")
def builtin_engine_url(tiny_model_dir, engine_adapters, tmp_path_factory):
    preload = {name: engine_adapters[name] for name in ("ad0", "ad1", "ad2")}
    proc, url = launch_builtin(tiny_model_dir, tmp_path_factory.mktemp("engine_logs"), lora_paths=preload)
    yield url
    proc.terminate()


@pytest.fixture(params=["builtin_engine_url"])
def engine_url(request) -> str:
    """URL of a live server speaking SGLang's API with ad0..ad2 loaded (one param per server kind)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def builtin_launcher():
    """`launch_builtin` for tests that start a server of their own."""
    return launch_builtin
