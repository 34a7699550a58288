"""In-place pushes by broadcast: a sender joins a gloo group with the builtin server and
broadcasts an adapter's tensors; the server then serves exactly those weights."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from miles import lora
from miles.lora import weight_sync
from miles.utils.types import engine_lora_name

session_loop = pytest.mark.asyncio(loop_scope="session")

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


async def join(client: httpx.AsyncClient, url: str) -> tuple[weight_sync.UpdateGroupSpec, object]:
    """The server (rank 1) and this process (rank 0, the sender) join one group at the same time."""
    store = weight_sync.listening_store("127.0.0.1")  # the sender's rendezvous, on a port the OS gave it
    spec = weight_sync.UpdateGroupSpec(master_address="127.0.0.1", master_port=store.port, world_size=2,
                                       group_name=f"test_{uuid.uuid4().hex[:8]}", backend="gloo", timeout_s=60)
    answer, group = await asyncio.gather(client.post(url + "/init_weights_update_group", json=spec.init_request(1)),
                                         asyncio.to_thread(weight_sync.join_update_group, spec, 0, store))
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    return spec, group


async def push(client, url, spec, group, name: str, adapter_dir, *, upsert: bool = True,
               bucketed: bool = False) -> httpx.Response:
    """Metadata over HTTP and tensors by broadcast, concurrently (as the trainer does it)."""
    tensors, config = lora.read_peft_dir(adapter_dir)
    names, dtypes, shapes = weight_sync.tensor_metadata(tensors)
    body = {"lora_name": name, "config_dict": config, "names": names, "dtypes": dtypes, "shapes": shapes,
            "group_name": spec.group_name, "upsert": upsert, "flattened_bucket": bucketed}
    response, sent = await asyncio.gather(client.post(url + "/load_lora_adapter_from_distributed", json=body),
                                          asyncio.to_thread(weight_sync.broadcast_tensors, group, tensors,
                                                            bucketed=bucketed))
    assert sent == sum(t.numel() * t.element_size() for t in tensors.values())
    return response


async def served(client, url, name, prompt_ids) -> tuple[list[int], list[float]]:
    out = (await client.post(url + "/generate", json={"input_ids": prompt_ids, "lora_path": name,
                                                      "sampling_params": GREEDY, "return_logprob": True})).json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@session_loop
async def test_broadcast_push_serves_the_sent_weights(builtin_engine_url, client, engine_adapters, trainer_reference):
    url = builtin_engine_url
    spec, group = await join(client, url)
    name = engine_lora_name(4, 1, "in_place")
    prompt_ids = trainer_reference.tokenizer.encode("a broadcast push")
    try:
        # A fresh load, then an in-place replacement of the same name, sent as one flat bucket.
        for adapter, bucketed in (("alt", False), ("ad2", True)):
            response = await push(client, url, spec, group, name, engine_adapters[adapter], bucketed=bucketed)
            assert response.status_code == 200, response.text
            assert response.json()["loaded_adapters"][name] == "__distributed__"
            tokens, logprobs = await served(client, url, name, prompt_ids)
            reference = trainer_reference.score(prompt_ids, tokens, adapter)
            assert tokens == reference.greedy_tokens
            assert logprobs == pytest.approx(reference.logprobs, abs=1e-4)

        # Without upsert a loaded name is refused, after the tensors were received, so the
        # group stays in step and the next push still works.
        refused = await push(client, url, spec, group, name, engine_adapters["alt"], upsert=False)
        assert refused.status_code == 400 and "already loaded" in refused.json()["error_message"]
        tokens, _ = await served(client, url, name, prompt_ids)
        assert tokens == trainer_reference.score(prompt_ids, tokens, "ad2").greedy_tokens  # unchanged
        again = await push(client, url, spec, group, name, engine_adapters["alt"])
        assert again.status_code == 200
        tokens, _ = await served(client, url, name, prompt_ids)
        assert tokens == trainer_reference.score(prompt_ids, tokens, "alt").greedy_tokens
    finally:
        await client.post(url + "/unload_lora_adapter", json={"lora_name": name})
        destroyed = await client.post(url + "/destroy_weights_update_group", json={"group_name": spec.group_name})
        weight_sync.leave_update_group(group)
    assert destroyed.status_code == 200
    assert spec.group_name not in (await client.get(url + "/get_server_info")).json()["weights_update_groups"]


@session_loop
async def test_group_errors_are_400_with_sglang_shape(builtin_engine_url, client):
    url = builtin_engine_url
    unknown = await client.post(url + "/load_lora_adapter_from_distributed", json={
        "lora_name": "x", "config_dict": {}, "names": [], "dtypes": [], "shapes": [], "group_name": "nope"})
    assert unknown.status_code == 400 and unknown.json()["success"] is False
    assert "init_weights_update_group" in unknown.json()["message"]
    nccl = await client.post(url + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert nccl.status_code == 400 and "gloo" in nccl.json()["message"]
    missing = await client.post(url + "/destroy_weights_update_group", json={"group_name": "never_joined"})
    assert missing.status_code == 400


@pytest.fixture(scope="module")
def limited_url(builtin_launcher, tiny_model_dir, tmp_path_factory):
    """A server with room for two adapters, past which loads evict (`--max-loaded-loras 2`)."""
    proc, url = builtin_launcher(tiny_model_dir, tmp_path_factory.mktemp("limited_logs"), lora_paths={}, slots=2,
                                 extra=["--max-loaded-loras", "2"])
    yield url
    proc.terminate()


@session_loop
async def test_a_pushed_slot_survives_sampler_snapshots_past_the_limit(limited_url, client, engine_adapters,
                                                                      trainer_reference):
    """A slot received by broadcast has no directory to come back from, so snapshots loaded
    past --max-loaded-loras evict each other, never the trainer's slot."""
    url = limited_url
    spec, group = await join(client, url)
    slot = engine_lora_name(0, 1, "in_place")
    prompt_ids = trainer_reference.tokenizer.encode("slot and snapshots")
    try:
        assert (await push(client, url, spec, group, slot, engine_adapters["ad1"])).status_code == 200
        for i, adapter in enumerate(("ad0", "ad2", "alt")):
            answer = await client.post(url + "/load_lora_adapter", json={
                "lora_name": f"tinker-m-{i}", "lora_path": str(engine_adapters[adapter])})
            assert answer.status_code == 200, answer.text
            assert set(answer.json()["loaded_adapters"]) == {slot, f"tinker-m-{i}"}
        tokens, logprobs = await served(client, url, slot, prompt_ids)
        reference = trainer_reference.score(prompt_ids, tokens, "ad1")
        assert tokens == reference.greedy_tokens and logprobs == pytest.approx(reference.logprobs, abs=1e-4)
        # A request for an evicted snapshot reloads it in the one evictable place.
        tokens, _ = await served(client, url, "tinker-m-0", prompt_ids)
        assert tokens == trainer_reference.score(prompt_ids, tokens, "ad0").greedy_tokens
        info = (await client.get(url + "/get_server_info")).json()
        assert set(info["loaded_loras"]) == {slot, "tinker-m-0"}
        assert set(info["evicted_loras"]) == {"tinker-m-1", "tinker-m-2"}
    finally:
        info = (await client.get(url + "/get_server_info")).json()
        for name in [*info["loaded_loras"], *info["evicted_loras"]]:
            await client.post(url + "/unload_lora_adapter", json={"lora_name": name})
        await client.post(url + "/destroy_weights_update_group", json={"group_name": spec.group_name})
        weight_sync.leave_update_group(group)


def test_dtype_names_round_trip():
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert weight_sync.parse_dtype(weight_sync.dtype_name(dtype)) is dtype
    with pytest.raises(ValueError, match="unsupported tensor dtype"):
        weight_sync.parse_dtype("complex32")
