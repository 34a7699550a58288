"""What only the builtin server promises beyond the shared contract: batching, pause, slots, flags."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from miles.rollout.engines.builtin_server import build_parser, options_from_args
from miles.rollout.engines.lora_table import LoraRequestError, LoraSlotTable, UnknownLoraError
from tests.helpers.waiting import wait_until_async

session_loop = pytest.mark.asyncio(loop_scope="session")

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


async def server_info(client, url) -> dict:
    return (await client.get(url + "/get_server_info")).json()


@session_loop
async def test_a_batch_of_mixed_adapters_decodes_in_shared_steps(builtin_engine_url, client):
    before = await server_info(client, builtin_engine_url)
    response = await client.post(builtin_engine_url + "/generate", json={
        "text": ["a", "bb", "ccc", "dddd"], "lora_path": ["ad0", "ad1", None, "ad2"], "sampling_params": GREEDY})
    assert [len(r["output_ids"]) for r in response.json()] == [10] * 4
    after = await server_info(client, builtin_engine_url)
    # 4 x 10 tokens; the first token of each comes from its prefill, the other 9 from
    # decode steps that carry all four rows at once.
    assert after["decode_steps"] - before["decode_steps"] == 9
    assert after["max_batch_seen"] >= 4


@session_loop
async def test_pause_in_place_holds_requests_until_continue(builtin_engine_url, client):
    assert (await client.post(builtin_engine_url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
    try:
        task = asyncio.create_task(client.post(builtin_engine_url + "/generate",
                                               json={"text": "a", "sampling_params": GREEDY}))

        async def queued() -> dict | None:
            info = await server_info(client, builtin_engine_url)
            return info if info["waiting_requests"] + info["running_requests"] or task.done() else None

        # The server has the request: it waits in the queue, not admitted to a decode step.
        info = await wait_until_async(queued, 60, "the paused server to receive the request")
        assert (info["waiting_requests"], info["running_requests"], info["paused"]) == (1, 0, True)
        assert not task.done()
        assert (await client.get(builtin_engine_url + "/health_generate")).status_code == 503
    finally:
        assert (await client.post(builtin_engine_url + "/continue_generation")).status_code == 200
    out = (await task).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 10


@session_loop
async def test_pause_abort_mode_returns_in_flight_requests(builtin_engine_url, client):
    task = asyncio.create_task(client.post(builtin_engine_url + "/generate", json={
        "text": "a", "sampling_params": {**GREEDY, "max_new_tokens": 450}}))

    async def running() -> bool:
        return task.done() or (await server_info(client, builtin_engine_url))["running_requests"] > 0

    await wait_until_async(running, 60, "the request to start decoding")
    try:
        assert (await client.post(builtin_engine_url + "/pause_generation")).status_code == 200
        out = (await asyncio.wait_for(task, 10)).json()
    finally:
        await client.post(builtin_engine_url + "/continue_generation")
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 450
    bad = await client.post(builtin_engine_url + "/pause_generation", json={"mode": "sideways"})
    assert bad.status_code == 400


@session_loop
async def test_upsert_of_a_new_name_loads_it(builtin_engine_url, client, engine_adapters):
    body = {"lora_name": "fresh_upsert", "lora_path": str(engine_adapters["ad1"]), "upsert": True}
    loaded = await client.post(builtin_engine_url + "/load_lora_adapter", json=body)
    assert loaded.status_code == 200 and "fresh_upsert" in loaded.json()["loaded_adapters"]
    same = {"input_ids": [10, 11, 12], "sampling_params": GREEDY}
    a = (await client.post(builtin_engine_url + "/generate", json={**same, "lora_path": "fresh_upsert"})).json()
    b = (await client.post(builtin_engine_url + "/generate", json={**same, "lora_path": "ad1"})).json()
    assert a["output_ids"] == b["output_ids"]
    unloaded = await client.post(builtin_engine_url + "/unload_lora_adapter", json={"lora_name": "fresh_upsert"})
    assert unloaded.status_code == 200


def test_slot_table_reuses_slots_only_after_release():
    table = LoraSlotTable(2)
    assert table.reserve("a", upsert=False) == (0, True)
    with pytest.raises(UnknownLoraError):
        table.slot_of("a")  # reserved is not served yet
    table.commit("a", "/a")
    assert table.reserve("b", upsert=False) == (1, True)
    table.commit("b", "/b")
    with pytest.raises(LoraRequestError, match="larger --max-loras-per-batch"):
        table.reserve("c", upsert=False)
    with pytest.raises(LoraRequestError, match="upsert"):
        table.reserve("a", upsert=False)
    assert table.reserve("a", upsert=True) == (0, False)
    with pytest.raises(LoraRequestError, match="being loaded"):
        table.remove("a")
    table.commit("a", "/a2")
    assert table.remove("a") == 0
    with pytest.raises(LoraRequestError):
        table.reserve("c", upsert=False)  # slot 0 is still being cleared
    table.release(0)
    assert table.reserve("c", upsert=False) == (0, True)
    table.cancel("c", fresh=True)
    assert table.loaded() == {"b": "/b"}
    assert table.slot_of(None) == -1


def test_flags_follow_sglang_spelling():
    args = build_parser().parse_args([
        "--model-path", "/m", "--max-loras-per-batch", "3", "--max-lora-rank", "8",
        "--lora-target-modules", "q_proj", "v_proj", "--lora-paths", "a=/x", "/y",
        "--dtype", "bfloat16", "--device", "cpu", "--enable-lora",
    ])
    options = options_from_args(args)
    assert options.max_loras_per_batch == 3 and options.max_lora_rank == 8
    assert options.lora_target_modules == "q_proj,v_proj"
    assert options.lora_paths == (("a", "/x"), ("/y", "/y"))
    assert (options.dtype, options.device) == ("bfloat16", "cpu")
    default = options_from_args(build_parser().parse_args(["--model-path", "/m", "--device", "cpu"]))
    assert (default.lora_target_modules, default.dtype) == ("all-linear", "float32")
