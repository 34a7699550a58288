"""Sampler snapshots on the builtin engine: LRU eviction past --max-loaded-loras, reload on request.

As SGLang since sgl-project/sglang#11526: a load past the limit evicts the least recently
used adapter; a request naming an evicted adapter reloads it from its directory first;
an explicitly unloaded one is gone (400 "not loaded").
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

session_loop = pytest.mark.asyncio(loop_scope="session")

SEEDED = {"max_new_tokens": 8, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def lru_url(builtin_launcher, tiny_model_dir, tmp_path_factory):
    proc, url = builtin_launcher(tiny_model_dir, tmp_path_factory.mktemp("lru_logs"), lora_paths={}, slots=2,
                                 extra=["--max-loaded-loras", "2"])
    yield url
    proc.terminate()


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


async def info(client, url) -> dict:
    return (await client.get(url + "/get_server_info")).json()


async def load(client, url, name, path) -> None:
    answer = await client.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert answer.status_code == 200, answer.text


async def generate(client, url, name) -> httpx.Response:
    return await client.post(url + "/generate", json={"input_ids": PROMPT, "lora_path": name,
                                                      "sampling_params": SEEDED, "return_logprob": True})


@session_loop
async def test_lru_eviction_and_reload_on_request(lru_url, client, engine_adapters):
    url = lru_url
    await load(client, url, "snap0", engine_adapters["ad0"])
    await load(client, url, "snap1", engine_adapters["ad1"])
    first = (await generate(client, url, "snap0")).json()  # snap1 is now the least recently used
    await load(client, url, "snap2", engine_adapters["ad2"])
    state = await info(client, url)
    assert set(state["loaded_loras"]) == {"snap0", "snap2"}
    assert state["evicted_loras"] == {"snap1": str(engine_adapters["ad1"])}

    # snap1 comes back from its directory; snap0 (least recently used now) makes room.
    assert (await generate(client, url, "snap1")).status_code == 200
    state = await info(client, url)
    assert set(state["loaded_loras"]) == {"snap1", "snap2"} and set(state["evicted_loras"]) == {"snap0"}
    assert state["lora_loads"]["snap1"] == 2

    # The reloaded snapshot gives the very same seeded tokens and logprobs as before eviction.
    again = (await generate(client, url, "snap0")).json()
    assert (await info(client, url))["lora_loads"]["snap0"] == 2
    assert again["output_ids"] == first["output_ids"]
    logprobs = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in (first, again)]
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-6)

    # Unloading an evicted name forgets it: no reload after that.
    evicted = next(iter((await info(client, url))["evicted_loras"]))
    assert (await client.post(url + "/unload_lora_adapter", json={"lora_name": evicted})).status_code == 200
    gone = await generate(client, url, evicted)
    assert gone.status_code == 400 and "not loaded" in gone.text
    never = await generate(client, url, "never-loaded")
    assert never.status_code == 400 and "not loaded" in never.text
    for name in (await info(client, url))["loaded_loras"]:
        assert (await client.post(url + "/unload_lora_adapter", json={"lora_name": name})).status_code == 200


@session_loop
async def test_pinned_adapters_are_not_evicted(lru_url, client, engine_adapters):
    url = lru_url
    answer = await client.post(url + "/load_lora_adapter", json={
        "lora_name": "slot", "lora_path": str(engine_adapters["ad0"]), "pinned": True})
    assert answer.status_code == 200
    for i, name in enumerate(["ad1", "ad2", "alt"]):
        await load(client, url, f"snap{i}", engine_adapters[name])
        assert "slot" in (await info(client, url))["loaded_loras"]
    state = await info(client, url)
    assert set(state["loaded_loras"]) == {"slot", "snap2"} and set(state["evicted_loras"]) == {"snap0", "snap1"}
    for name in [*state["loaded_loras"], *state["evicted_loras"]]:
        assert (await client.post(url + "/unload_lora_adapter", json={"lora_name": name})).status_code == 200
    assert (await info(client, url))["evicted_loras"] == {}


@session_loop
async def test_concurrent_requests_for_more_snapshots_than_fit_each_get_their_own_weights(lru_url, client,
                                                                                       engine_adapters):
    """Three snapshots through room for two, all at once: evictions wait for the requests in
    flight, reloads wait for room, and every answer is the one that snapshot gives alone."""
    url = lru_url
    names = {"c0": "ad0", "c1": "ad1", "c2": "ad2"}
    def scored(answer: httpx.Response) -> tuple[list[int], list[float]]:
        assert answer.status_code == 200, answer.text
        out = answer.json()
        return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]

    alone = {}
    for name, adapter in names.items():
        await load(client, url, name, engine_adapters[adapter])
        alone[name] = scored(await generate(client, url, name))
    assert len({round(lps[0], 4) for _, lps in alone.values()}) == 3  # the three adapters really differ
    order = [name for _ in range(3) for name in names]
    answers = await asyncio.gather(*(generate(client, url, name) for name in order))
    for name, answer in zip(order, answers):
        tokens, logprobs = scored(answer)
        assert tokens == alone[name][0] and logprobs == pytest.approx(alone[name][1], abs=1e-5)
    state = await info(client, url)
    assert len(state["loaded_loras"]) == 2 and set(state["loaded_loras"]) | set(state["evicted_loras"]) == set(names)
    assert sum(state["lora_loads"][name] for name in names) >= 4  # 3 loads, then c0 reloaded while others ran
    for name in names:
        assert (await client.post(url + "/unload_lora_adapter", json={"lora_name": name})).status_code == 200
