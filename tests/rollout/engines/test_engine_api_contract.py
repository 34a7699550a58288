"""The SGLang API contract every engine must keep, run against a live server URL.

`engine_url` is a server with adapters ad0..ad2 loaded; `trainer_reference` is the same
model and adapters in-process, scored as a train rank scores them.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = ["12+34=", "hello there", "x", "The quick brown fox", "9-3="]


def rid(adapter: str) -> str:
    return f"{adapter}::{uuid.uuid4().hex}"


async def generate(client: httpx.AsyncClient, url: str, **body) -> dict | list:
    response = await client.post(url + "/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(max_new_tokens: int = 8, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


async def test_each_slot_matches_trainer_side_model(engine_url, client, trainer_reference):
    tokenizer = trainer_reference.tokenizer
    outputs = {}
    for adapter in [None, "ad0", "ad1", "ad2"]:
        for prompt in PROMPTS[:3]:
            out = await generate(client, engine_url, text=prompt, lora_path=adapter,
                                 sampling_params=greedy(10), return_logprob=True)
            prompt_ids = tokenizer.encode(prompt)
            assert out["meta_info"]["prompt_tokens"] == len(prompt_ids)
            assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) == 10
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            scored = trainer_reference.score(prompt_ids, out["output_ids"], adapter)
            assert out["output_ids"] == scored.greedy_tokens
            engine_logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
            assert engine_logprobs == pytest.approx(scored.logprobs, abs=1e-4)
            assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
            outputs[(adapter, prompt)] = tuple(out["output_ids"])
    for prompt in PROMPTS[:3]:
        per_slot = {outputs[(adapter, prompt)] for adapter in [None, "ad0", "ad1", "ad2"]}
        assert len(per_slot) == 4, f"slots gave identical generations for {prompt!r}"


async def test_batched_and_concurrent_equal_one_at_a_time(engine_url, client):
    adapters = ["ad0", "ad1", None, "ad2", "ad0"]
    params = [greedy(6 + i) for i in range(len(PROMPTS))]
    alone = []
    for prompt, adapter, p in zip(PROMPTS, adapters, params):
        alone.append(await generate(client, engine_url, text=prompt, lora_path=adapter, sampling_params=p,
                                    return_logprob=True))
    batched = await generate(client, engine_url, text=PROMPTS, lora_path=adapters, sampling_params=params,
                             return_logprob=True)
    concurrent = await asyncio.gather(*[
        generate(client, engine_url, text=prompt, lora_path=adapter, sampling_params=p, return_logprob=True)
        for prompt, adapter, p in zip(PROMPTS, adapters, params)
    ])
    assert isinstance(batched, list) and len(batched) == len(PROMPTS)
    for one, b, c in zip(alone, batched, concurrent):
        assert b["output_ids"] == one["output_ids"] == c["output_ids"]
        lp_one = [x[0] for x in one["meta_info"]["output_token_logprobs"]]
        assert [x[0] for x in b["meta_info"]["output_token_logprobs"]] == pytest.approx(lp_one, abs=1e-4)
        assert [x[0] for x in c["meta_info"]["output_token_logprobs"]] == pytest.approx(lp_one, abs=1e-4)


async def test_token_ids_in_and_rids_out(engine_url, client, trainer_reference):
    ids = trainer_reference.tokenizer.encode(PROMPTS[0])
    by_text = await generate(client, engine_url, text=PROMPTS[0], lora_path="ad1", sampling_params=greedy(5))
    request_id = rid("ad1")
    by_ids = await generate(client, engine_url, input_ids=ids, lora_path="ad1", sampling_params=greedy(5),
                            rid=request_id)
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["meta_info"]["id"] == request_id
    assert by_ids["meta_info"]["output_token_logprobs"] is None


def aborting(client, url: str, abort: dict, tasks: list[asyncio.Task]):
    """A condition that posts `abort` and holds once every task answered. An abort may
    overtake a request still on its way to the engine, so it is posted until all have."""

    async def answered() -> bool:
        assert (await client.post(url + "/abort_request", json=abort)).status_code == 200
        return all(task.done() for task in tasks)

    return answered


async def test_prefix_abort_stops_one_adapter_only(engine_url, client):
    long = greedy(400)
    victims = [asyncio.create_task(generate(client, engine_url, text=p, lora_path="ad0", rid=rid("victim"),
                                            sampling_params=long)) for p in PROMPTS[:3]]
    keepers = [asyncio.create_task(generate(client, engine_url, text=p, lora_path="ad1", rid=rid("keeper"),
                                            sampling_params=greedy(12))) for p in PROMPTS[:2]]
    await wait_until_async(aborting(client, engine_url, {"rid": "victim::", "prefix": True}, victims), 20,
                           "every victim to answer the prefix abort")
    for task in victims:
        out = await task
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(out["output_ids"]) < 400
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    for task in keepers:
        out = await task
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert len(out["output_ids"]) == 12


async def test_exact_rid_and_abort_all(engine_url, client):
    target, other = rid("exact"), rid("exact")
    t1 = asyncio.create_task(generate(client, engine_url, text="a", rid=target, sampling_params=greedy(400)))
    t2 = asyncio.create_task(generate(client, engine_url, text="b", rid=other, sampling_params=greedy(30)))
    await wait_until_async(aborting(client, engine_url, {"rid": target}, [t1]), 20, "the exact-rid abort")
    assert (await t1)["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await t2)["meta_info"]["finish_reason"]["type"] == "length"
    t3 = asyncio.create_task(generate(client, engine_url, text="c", rid=rid("all"), sampling_params=greedy(400)))
    await wait_until_async(aborting(client, engine_url, {"abort_all": True}, [t3]), 20, "the abort of all requests")
    assert (await t3)["meta_info"]["finish_reason"]["type"] == "abort"


async def test_upsert_replaces_weights_in_place(engine_url, client, engine_adapters, trainer_reference):
    name = f"up_{uuid.uuid4().hex[:6]}"
    prompt_ids = trainer_reference.tokenizer.encode(PROMPTS[1])
    load = {"lora_name": name, "lora_path": str(engine_adapters["ad2"])}
    assert (await client.post(engine_url + "/load_lora_adapter", json=load)).status_code == 200
    before = await generate(client, engine_url, input_ids=prompt_ids, lora_path=name, sampling_params=greedy(10))
    assert before["output_ids"] == trainer_reference.score(prompt_ids, before["output_ids"], "ad2").greedy_tokens
    again = await client.post(engine_url + "/load_lora_adapter", json=load)
    assert again.status_code == 400 and "upsert" in again.json()["detail"]
    upsert = {"lora_name": name, "lora_path": str(engine_adapters["alt"]), "upsert": True}
    assert (await client.post(engine_url + "/load_lora_adapter", json=upsert)).status_code == 200
    after = await generate(client, engine_url, input_ids=prompt_ids, lora_path=name, sampling_params=greedy(10),
                           return_logprob=True)
    scored = trainer_reference.score(prompt_ids, after["output_ids"], "alt")
    assert after["output_ids"] == scored.greedy_tokens
    assert [x[0] for x in after["meta_info"]["output_token_logprobs"]] == pytest.approx(scored.logprobs, abs=1e-4)
    assert after["output_ids"] != before["output_ids"]
    assert (await client.post(engine_url + "/unload_lora_adapter", json={"lora_name": name})).status_code == 200


async def test_unload_then_generate_is_rejected(engine_url, client, engine_adapters):
    name = f"gone_{uuid.uuid4().hex[:6]}"
    load = {"lora_name": name, "lora_path": str(engine_adapters["alt"])}
    assert (await client.post(engine_url + "/load_lora_adapter", json=load)).status_code == 200
    await generate(client, engine_url, text="a", lora_path=name, sampling_params=greedy(2))
    assert (await client.post(engine_url + "/unload_lora_adapter", json={"lora_name": name})).status_code == 200
    response = await client.post(engine_url + "/generate", json={"text": "a", "lora_path": name})
    assert 400 <= response.status_code < 500
    assert name in response.json()["detail"]
    second = await client.post(engine_url + "/unload_lora_adapter", json={"lora_name": name})
    assert 400 <= second.status_code < 500


MALFORMED = [
    ("not json", None),
    ("", None),
    (None, {"text": "a", "input_ids": [1, 2]}),
    (None, {}),
    (None, {"text": "a", "lora_path": "no_such_adapter"}),
    (None, {"text": "a", "sampling_params": {"temperature": -1}}),
    (None, {"text": "a", "sampling_params": {"top_p": 0}}),
    (None, {"text": "a", "sampling_params": {"top_k": -5}}),
    (None, {"text": "a", "sampling_params": {"max_new_tokens": -1}}),
    (None, {"text": "a", "sampling_params": {"no_such_param": 1}}),
    (None, {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}),
    (None, {"text": ["a", "b"], "rid": "one"}),
    (None, {"text": []}),
    (None, {"input_ids": [10**9]}),
    (None, {"input_ids": []}),
    (None, {"text": 5}),
]


@pytest.mark.parametrize("raw, body", MALFORMED)
async def test_malformed_generate_is_4xx_and_server_survives(engine_url, client, raw, body):
    if raw is not None:
        response = await client.post(engine_url + "/generate", content=raw,
                                     headers={"content-type": "application/json"})
    else:
        response = await client.post(engine_url + "/generate", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["detail"]
    assert (await client.get(engine_url + "/health")).status_code == 200
    ok = await generate(client, engine_url, text="a", sampling_params=greedy(2))
    assert len(ok["output_ids"]) == 2


@pytest.mark.parametrize("route, body", [
    ("/load_lora_adapter", {"lora_name": "x"}),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/definitely/not/here"}),
    ("/unload_lora_adapter", {}),
    ("/unload_lora_adapter", {"lora_name": "never_loaded"}),
    ("/abort_request", {}),
])
async def test_malformed_admin_requests_are_4xx(engine_url, client, route, body):
    response = await client.post(engine_url + route, json=body)
    assert 400 <= response.status_code < 500, response.text
    assert (await client.get(engine_url + "/health")).status_code == 200


async def test_stop_string_and_stop_token(engine_url, client):
    free = await generate(client, engine_url, text=PROMPTS[3], lora_path="ad2", sampling_params=greedy(12))
    text = free["text"]
    stop = text[4:6]
    stopped = await generate(client, engine_url, text=PROMPTS[3], lora_path="ad2",
                             sampling_params=greedy(12, stop=[stop]))
    assert stopped["text"] == text[: text.find(stop)]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop, "message": None}
    token = free["output_ids"][3]
    by_token = await generate(client, engine_url, text=PROMPTS[3], lora_path="ad2",
                              sampling_params=greedy(12, stop_token_ids=[token]))
    first = free["output_ids"].index(token)
    assert by_token["output_ids"] == free["output_ids"][: first + 1]
    assert by_token["meta_info"]["finish_reason"]["matched"] == token


async def test_sampling_is_seeded_and_top_k_one_is_greedy(engine_url, client):
    sampled = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = await generate(client, engine_url, text="x", lora_path="ad0", sampling_params={**sampled, "seed": 1})
    b = await generate(client, engine_url, text="x", lora_path="ad0", sampling_params={**sampled, "seed": 1})
    c = await generate(client, engine_url, text="x", lora_path="ad0", sampling_params={**sampled, "seed": 2})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    g = await generate(client, engine_url, text="x", lora_path="ad0", sampling_params=greedy(8))
    k1 = await generate(client, engine_url, text="x", lora_path="ad0",
                        sampling_params={**sampled, "max_new_tokens": 8, "top_k": 1, "seed": 5})
    assert k1["output_ids"] == g["output_ids"]


async def test_zero_new_tokens_and_info_routes(engine_url, client):
    out = await generate(client, engine_url, text="abc", sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["prompt_tokens"] == 3
    info = (await client.get(engine_url + "/get_model_info")).json()
    assert info["is_generation"] is True and info["model_path"]
    assert (await client.get(engine_url + "/get_server_info")).status_code == 200
    assert (await client.get(engine_url + "/health_generate")).status_code == 200
    assert (await client.post(engine_url + "/flush_cache")).status_code == 200
