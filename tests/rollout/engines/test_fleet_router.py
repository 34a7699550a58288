"""Two builtin engines (Ray actors) behind the real sglang-router, and LoRA pushes into them
(through the trainer's push path, `EnginePusher`)."""

from __future__ import annotations

import asyncio
import socket
import uuid

import httpx
import pytest

from miles import lora
from miles.backends.base import LoraExport
from miles.rollout.engines import router as router_module
from miles.rollout.engines.fleet import EngineFleet, EngineFleetConfig
from miles.rollout.engines.process import free_port
from miles.rollout.engines.router import Router
from miles.rollout.engines.server_command import EngineServerConfig
from miles.utils.router_workers import abort_on_workers, discover_workers
from miles.utils.types import engine_lora_name
from tests.helpers.fleet_pushes import fleet_pusher, lora_export
from tests.helpers.waiting import wait_until_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
async def fleet(ray_session, tiny_model_dir, tmp_path_factory, lora_max_rank):
    server = EngineServerConfig(kind="builtin", model_path=str(tiny_model_dir), n_slots=2, max_lora_rank=lora_max_rank,
                                target_modules="all-linear", dtype="float32", device="cpu")
    cfg = EngineFleetConfig(server=server, num_engines=2, work_dir=str(tmp_path_factory.mktemp("fleet")),
                            start_timeout_s=180)
    fleet = await EngineFleet.start(cfg)
    yield fleet
    await fleet.shutdown()
    await fleet.shutdown()  # idempotent


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


async def finished_requests(client: httpx.AsyncClient, url: str) -> int:
    return (await client.get(url + "/get_server_info")).json()["finished_requests"]


async def test_router_lists_both_workers_and_spreads_requests(fleet, client):
    assert len(set(fleet.urls)) == 2
    assert sorted(await discover_workers(fleet.router_url, client)) == sorted(fleet.urls)
    before = [await finished_requests(client, url) for url in fleet.urls]
    for i in range(6):
        response = await client.post(fleet.router_url + "/generate",
                                     json={"text": f"{i}+1=", "sampling_params": GREEDY})
        assert response.status_code == 200, response.text
        assert len(response.json()["output_ids"]) == 8
    after = [await finished_requests(client, url) for url in fleet.urls]
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == 6 and min(served) >= 2, served


async def test_prefix_abort_through_discovery_reaches_both(fleet, client):
    long = {**GREEDY, "max_new_tokens": 400}
    victims = [asyncio.create_task(client.post(fleet.router_url + "/generate", json={
        "text": f"{i}", "rid": f"victim::{uuid.uuid4().hex}", "sampling_params": long})) for i in range(4)]

    async def all_in_flight() -> bool:
        infos = [(await client.get(url + "/get_server_info")).json() for url in fleet.urls]
        return sum(info["running_requests"] + info["waiting_requests"] for info in infos) == len(victims)

    await wait_until_async(all_in_flight, 60, "the four requests to reach the engines")
    # One prefix abort, through the router's worker list, reaches both engines.
    assert sorted(await abort_on_workers(fleet.router_url, "victim::")) == sorted(fleet.urls)
    for task in victims:
        out = (await asyncio.wait_for(task, 60)).json()
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(out["output_ids"]) < 400


def reference_export(reference, adapter: str) -> LoraExport:
    """The reference model's slot of `adapter`, exported as a train rank exports it."""
    tensors = lora.get_slot_weights(reference.model, reference.slots[adapter])
    rank, alpha = lora.slot_rank_alpha(reference.model, reference.slots[adapter])
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora.lora_modules(reference.model)})
    config = lora.peft_adapter_config(rank=rank, alpha=alpha, target_modules=targets, base_model_name_or_path=None)
    return lora_export(config, tensors)


async def test_pushed_lora_makes_engines_match_the_trainer_slot(fleet, client, trainer_reference):
    prompt_ids = trainer_reference.tokenizer.encode("hello there")
    pusher = fleet_pusher(fleet, "in_place")
    try:
        for version, adapter in [(1, "ad1"), (2, "alt")]:
            name = fleet.lora_name(1, version)
            assert name == engine_lora_name(1, version, "in_place") == "__miles_slot_1"
            await pusher.push([(1, version, reference_export(trainer_reference, adapter))])
            assert await asyncio.gather(*[e.slots.remote() for e in fleet.engines]) == [{1: version}] * 2
            outputs = await served_outputs(fleet, client, trainer_reference, prompt_ids, name, adapter)
    finally:
        await pusher.close()
    base = await client.post(fleet.urls[0] + "/generate", json={"input_ids": prompt_ids, "sampling_params": GREEDY})
    assert base.json()["output_ids"] != outputs[0]


async def served_outputs(fleet, client, reference, prompt_ids, name: str, adapter: str) -> list[list[int]]:
    """Every engine serves `name` as the reference's `adapter`, and so does the router; their outputs."""
    outputs = []
    for url in fleet.urls:
        response = await client.post(url + "/generate", json={
            "input_ids": prompt_ids, "lora_path": name, "sampling_params": GREEDY, "return_logprob": True})
        out = response.json()
        scored = reference.score(prompt_ids, out["output_ids"], adapter)
        assert out["output_ids"] == scored.greedy_tokens
        assert [x[0] for x in out["meta_info"]["output_token_logprobs"]] == pytest.approx(scored.logprobs, abs=1e-4)
        outputs.append(out["output_ids"])
    assert outputs[0] == outputs[1]
    via_router = await client.post(fleet.router_url + "/generate", json={
        "input_ids": prompt_ids, "lora_path": name, "sampling_params": GREEDY})
    assert via_router.json()["output_ids"] == outputs[0]
    return outputs


async def test_a_router_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    """The router needs its port on the command line; when another process binds the probed
    port first, the router dies of it and is started again on a fresh one."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # held, not listening: a health probe of it is refused at once
    busy = taken.getsockname()[1]
    probes = [busy]  # the first port the launcher probes is the taken one
    monkeypatch.setattr(router_module, "free_port", lambda host: probes.pop() if probes else free_port(host))
    try:
        router = await Router.launch([], log_path=tmp_path / "router.log")
    finally:
        taken.close()
    try:
        assert not probes and router.url != f"http://127.0.0.1:{busy}"
        assert "address already in use" in (tmp_path / "router.log").read_text().lower()  # why the first one died
        assert await router.workers() == []  # the second one answers
    finally:
        await router.shutdown()


async def test_attach_to_running_router_adds_workers(fleet, tmp_path):
    empty = await Router.launch([], log_path=tmp_path / "router.log")
    try:
        assert await empty.workers() == []
        attached = await Router.attach(empty.url, fleet.urls, timeout_s=60)
        assert sorted(await attached.workers()) == sorted(fleet.urls)
        await attached.shutdown()  # attached: leaves the router running, takes our workers out
        assert empty.process.alive()

        async def no_workers() -> bool:
            return not await empty.workers()

        await wait_until_async(no_workers, 30, "the router to drop the attached workers")
    finally:
        await empty.shutdown()
    assert not empty.process.alive()
