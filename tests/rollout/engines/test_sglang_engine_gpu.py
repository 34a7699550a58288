"""Real SGLang behind an engine actor (needs CUDA and the `sglang` package; skipped otherwise).

Serves a small locally made Llama, pushes two adapters through the SGLang load path
(`versioned`: no upsert) and generates with each.
"""

from __future__ import annotations

import importlib.util

import httpx
import pytest
import torch

from miles import lora
from miles.rollout.engines.engine_actor import EngineServer
from miles.rollout.engines.server_command import EngineServerConfig
from miles.recipes.tiny_model import write_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang package"),
]

RANK = 8


def write_adapters(model_dir, out, seed: int) -> dict[str, tuple[dict, dict]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora.inject_multi_lora(model, n_slots=1, max_rank=RANK, target_modules="all-linear")
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora.lora_modules(model)})
    generator = torch.Generator().manual_seed(seed)
    payloads = {}
    for name in ("first", "second"):
        lora.init_slot(model, 0, rank=RANK, alpha=16, generator=generator)
        weights = lora.get_slot_weights(model, 0)
        for key, value in weights.items():
            if key.endswith("lora_B.weight"):
                weights[key] = torch.randn(value.shape, generator=generator) * 0.5
        config = lora.peft_adapter_config(rank=RANK, alpha=16, target_modules=targets, base_model_name_or_path=None)
        payloads[name] = (config, weights)
    return payloads


async def test_sglang_serves_two_adapters(tmp_path):
    # head_dim 64: the attention kernels of SGLang do not take tiny heads.
    model_dir = write_tiny_model(tmp_path / "model", arch="llama", hidden_size=256, num_heads=4, num_kv_heads=4)
    cfg = EngineServerConfig(kind="sglang", model_path=str(model_dir), n_slots=2, max_lora_rank=RANK,
                             target_modules="all-linear", dtype="float32", device="cuda", lora_update="versioned",
                             extra_args=("--disable-cuda-graph", "--mem-fraction-static", "0.3"))
    server = EngineServer(cfg, str(tmp_path / "work"), start_timeout_s=400)
    await server.start()
    try:
        outputs = {}
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for version, (name, (config, tensors)) in enumerate(write_adapters(model_dir, tmp_path, 0).items(), 1):
                served = await server.push_lora(version - 1, version, config, tensors)
                response = await client.post(server.url() + "/generate", json={
                    "text": "12+34=", "lora_path": served, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
                assert response.status_code == 200, response.text
                out = response.json()
                assert len(out["output_ids"]) == 8
                assert len(out["meta_info"]["output_token_logprobs"]) == 8
                outputs[name] = out["output_ids"]
            base = (await client.post(server.url() + "/generate", json={
                "text": "12+34=", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})).json()
        assert outputs["first"] != outputs["second"]
        assert base["output_ids"] not in (outputs["first"], outputs["second"])
    finally:
        await server.shutdown()
