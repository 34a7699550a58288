"""The builtin engine in `versioned` mode answers LoRA requests as SGLang 0.5 does.

What SGLang does (its tokenizer manager, LoRA registry and LoRA manager): `upsert` is
not a field of `/load_lora_adapter` (ignored), so loading a loaded name fails with HTTP
400 `{"success": false, "error_message": "Failed to load LoRA adapter X because it is
already loaded", ...}`; `/load_lora_adapter_from_distributed` does not exist; unloading
an unknown name is 400 "LoRA with name X does not exist"; unloading stops new requests
for the name at once but waits for the requests already using it; past
`--max-loaded-loras` the least recently used adapter is evicted.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers.waiting import wait_until_async

session_loop = pytest.mark.asyncio(loop_scope="session")

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def versioned_url(builtin_launcher, tiny_model_dir, tmp_path_factory):
    proc, url = builtin_launcher(tiny_model_dir, tmp_path_factory.mktemp("versioned_logs"), lora_paths={}, slots=2,
                               extra=["--engine-lora-update", "versioned", "--max-loaded-loras", "3"])
    yield url
    proc.terminate()


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


async def load(client, url, name, path, **extra) -> httpx.Response:
    return await client.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


async def loaded(client, url) -> dict[str, str]:
    return (await client.get(url + "/get_server_info")).json()["loaded_loras"]


async def unload_all(client, url) -> None:
    for name in await loaded(client, url):
        assert (await client.post(url + "/unload_lora_adapter", json={"lora_name": name})).status_code == 200


@session_loop
async def test_no_upsert_and_no_broadcast_route(versioned_url, client, engine_adapters):
    url = versioned_url
    assert (await load(client, url, "v1", engine_adapters["ad0"])).status_code == 200
    for extra in ({}, {"upsert": True}):
        again = await load(client, url, "v1", engine_adapters["ad1"], **extra)
        assert again.status_code == 400
        body = again.json()
        assert body["success"] is False
        assert body["error_message"] == "Failed to load LoRA adapter v1 because it is already loaded"
        assert set(body["loaded_adapters"]) == {"v1"}
    route = await client.post(url + "/load_lora_adapter_from_distributed", json={})
    assert route.status_code == 404
    unknown = await client.post(url + "/unload_lora_adapter", json={"lora_name": "never"})
    assert unknown.status_code == 400
    assert unknown.json()["error_message"].startswith("LoRA with name never does not exist")
    await unload_all(client, url)


@session_loop
async def test_unload_waits_for_requests_in_flight(versioned_url, client, engine_adapters, trainer_reference):
    url = versioned_url
    assert (await load(client, url, "busy", engine_adapters["ad2"])).status_code == 200
    prompt_ids = trainer_reference.tokenizer.encode("keep going")
    long = asyncio.create_task(client.post(url + "/generate", json={
        "input_ids": prompt_ids, "lora_path": "busy", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}))

    async def running() -> bool:
        return long.done() or (await client.get(url + "/get_server_info")).json()["running_requests"] > 0

    await wait_until_async(running, 60, "the long request to start decoding")
    # Held mid-decode by an in-place pause, the request uses "busy" for as long as the test needs.
    assert (await client.post(url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
    try:
        assert (await client.get(url + "/get_server_info")).json()["running_requests"] == 1, \
            "the long request finished before the pause"
        unload = asyncio.create_task(client.post(url + "/unload_lora_adapter", json={"lora_name": "busy"}))

        async def unloading() -> bool:
            return unload.done() or "busy" not in await loaded(client, url)

        await wait_until_async(unloading, 60, "the unload to take busy off the loaded adapters")
        late = await client.post(url + "/generate", json={"input_ids": prompt_ids, "lora_path": "busy",
                                                          "sampling_params": GREEDY})
        assert late.status_code == 400 and "busy" in late.json()["detail"]
        assert not unload.done() and not long.done()  # the unload waits for the request held in flight
    finally:
        assert (await client.post(url + "/continue_generation")).status_code == 200
    assert (await unload).status_code == 200
    out = (await long).json()
    # The request that was running finished normally, on the adapter's weights throughout.
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 300
    assert out["output_ids"] == trainer_reference.score(prompt_ids, out["output_ids"], "ad2").greedy_tokens


@session_loop
async def test_max_loaded_loras_evicts_the_least_recently_used(versioned_url, client, engine_adapters):
    url = versioned_url
    for name, adapter in (("a", "ad0"), ("b", "ad1"), ("c", "ad2")):
        assert (await load(client, url, name, engine_adapters[adapter])).status_code == 200
    used = await client.post(url + "/generate", json={"text": "x", "lora_path": "a", "sampling_params": GREEDY})
    assert used.status_code == 200  # "a" is now more recently used than "b"
    answer = await load(client, url, "d", engine_adapters["alt"])
    assert answer.status_code == 200
    assert set(answer.json()["loaded_adapters"]) == {"a", "c", "d"}
    assert set(await loaded(client, url)) == {"a", "c", "d"}
    await unload_all(client, url)
