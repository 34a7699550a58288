"""Engine supervision: start failures are explained; SGLang-style versioned LoRA names."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from miles.backends import lora
from miles.rollout.engines.engine_actor import EngineServer
from miles.rollout.engines.process import ServerStartError
from miles.rollout.engines.server_command import EngineServerConfig

session_loop = pytest.mark.asyncio(loop_scope="session")


def builtin_config(model_path: str, max_rank: int) -> EngineServerConfig:
    return EngineServerConfig(kind="builtin", model_path=model_path, n_slots=2, max_lora_rank=max_rank,
                              target_modules="all-linear")


@session_loop
async def test_a_server_that_dies_raises_with_its_log(tmp_path, lora_max_rank):
    server = EngineServer(builtin_config(str(tmp_path / "no_model_here"), lora_max_rank), str(tmp_path / "work"),
                          start_timeout_s=120)
    with pytest.raises(ServerStartError) as info:
        await server.start()
    message = str(info.value)
    assert "exited with code" in message
    assert "no_model_here" in message  # the server's own error, quoted from its log
    assert await server.health() is False
    await server.shutdown()
    await server.shutdown()


def peft_payload(reference, adapter: str) -> tuple[dict, dict]:
    slot = reference.slots[adapter]
    rank, alpha = lora.slot_rank_alpha(reference.model, slot)
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora.lora_modules(reference.model)})
    config = lora.peft_adapter_config(rank=rank, alpha=alpha, target_modules=targets, base_model_name_or_path=None)
    return config, lora.get_slot_weights(reference.model, slot)


@session_loop
async def test_versioned_names_without_upsert(builtin_engine_url, trainer_reference, tmp_path, lora_max_rank,
                                              tiny_model_dir):
    """An SGLang engine cannot replace a loaded name: each push is `{name}_v{version}`, the old one unloaded."""
    cfg = dataclasses.replace(builtin_config(str(tiny_model_dir), lora_max_rank), kind="sglang")
    server = EngineServer(cfg, str(tmp_path))
    server._url = builtin_engine_url  # drive the running builtin server through the SGLang load path
    prompt_ids = trainer_reference.tokenizer.encode("hello there")
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        for version, adapter in [(1, "ad0"), (2, "ad2")]:
            config, tensors = peft_payload(trainer_reference, adapter)
            served = await server.load_lora("__miles_slot_3", version, config, tensors)
            assert served == server.served_lora_name("__miles_slot_3") == f"__miles_slot_3_v{version}"
            out = (await client.post(builtin_engine_url + "/generate", json={
                "input_ids": prompt_ids, "lora_path": served,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})).json()
            assert out["output_ids"] == trainer_reference.score(prompt_ids, out["output_ids"], adapter).greedy_tokens
        loaded = (await client.get(builtin_engine_url + "/get_server_info")).json()["loaded_loras"]
        assert "__miles_slot_3_v2" in loaded and "__miles_slot_3_v1" not in loaded
        assert sorted(p.name for p in (tmp_path / "loras" / "__miles_slot_3").iterdir()) == ["v2"]
        await server.unload_lora("__miles_slot_3")
        loaded = (await client.get(builtin_engine_url + "/get_server_info")).json()["loaded_loras"]
        assert not any(name.startswith("__miles_slot_3") for name in loaded)
    with pytest.raises(KeyError):
        server.served_lora_name("__miles_slot_3")
