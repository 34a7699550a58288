"""The whole in-place push path through Ray engine actors and the real sglang-router:
a broadcast push reaches every engine; a killed server comes back behind the router with
the slot reloaded; the fleet then rejoins a new weights-update group and pushes again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import httpx
import pytest
import ray

from miles import lora
from miles.lora import weight_sync
from miles.rollout.engines.fleet import EngineFleet, EngineFleetConfig
from miles.rollout.engines.process import free_port
from miles.rollout.engines.server_command import EngineServerConfig
from miles.utils.types import LoraPush

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
async def fleet(ray_session, tiny_model_dir, tmp_path_factory, lora_max_rank):
    server = EngineServerConfig(kind="builtin", model_path=str(tiny_model_dir), n_slots=2, max_lora_rank=lora_max_rank,
                                target_modules="all-linear", dtype="float32", device="cpu", lora_update="in_place")
    cfg = EngineFleetConfig(server=server, num_engines=2, work_dir=str(tmp_path_factory.mktemp("fleet_recovery")),
                            start_timeout_s=180)
    fleet = await EngineFleet.start(cfg)
    yield fleet
    await fleet.shutdown()


async def join(fleet: EngineFleet):
    spec = fleet.update_group_spec("127.0.0.1", free_port(), group_name=f"g{uuid.uuid4().hex[:6]}")
    assert spec.world_size == 3 and spec.backend == "gloo"
    _, group = await asyncio.gather(fleet.join_update_group(spec),
                                    asyncio.to_thread(weight_sync.join_update_group, spec, 0))
    return spec, group


async def broadcast_push(fleet, spec, group, reference, adapter: str, slot: int, version: int) -> list[str]:
    tensors = lora.get_slot_weights(reference.model, reference.slots[adapter])
    rank, alpha = lora.slot_rank_alpha(reference.model, reference.slots[adapter])
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora.lora_modules(reference.model)})
    config = lora.peft_adapter_config(rank=rank, alpha=alpha, target_modules=targets, base_model_name_or_path=None)
    push = LoraPush(adapter=adapter, slot=slot, version=version, peft_config=config, tensors_ref=ray.put(tensors))
    names, dtypes, shapes = weight_sync.tensor_metadata(tensors)
    served, _ = await asyncio.gather(fleet.push_lora_from_distributed(push, names, dtypes, shapes, spec.group_name),
                                     asyncio.to_thread(weight_sync.broadcast_tensors, group, tensors))
    return served


async def serves(client, urls: list[str], name: str, reference, adapter: str) -> bool:
    prompt_ids = reference.tokenizer.encode("hello there")
    for url in urls:
        out = (await client.post(url + "/generate", json={"input_ids": prompt_ids, "lora_path": name,
                                                          "sampling_params": GREEDY})).json()
        if out["output_ids"] != reference.score(prompt_ids, out["output_ids"], adapter).greedy_tokens:
            return False
    return True


async def test_broadcast_push_survives_a_killed_engine(fleet, trainer_reference):
    spec, group = await join(fleet)
    old_groups = [group]
    try:
        name = fleet.lora_name(0, 1)
        assert await broadcast_push(fleet, spec, group, trainer_reference, "ad0", slot=0, version=1) == [name, name]
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            urls = await fleet.engine_urls()
            assert await serves(client, [*urls, fleet.router_url], name, trainer_reference, "ad0")

            os.kill(await fleet.engines[0].pid.remote(), signal.SIGKILL)
            deadline = time.monotonic() + 180
            while await fleet.engines[0].restart_count.remote() < 1:
                assert time.monotonic() < deadline, "the engine did not restart its server"
                await asyncio.sleep(0.2)
            new_urls = await fleet.engine_urls()
            assert new_urls[0] != urls[0] and new_urls[1] == urls[1]
            assert set(await fleet.router.workers()) == set(new_urls)
            # Reloaded from the object-store copy before it went back behind the router.
            assert await serves(client, new_urls, name, trainer_reference, "ad0")
            assert not await fleet.update_group_joined()

            # The next push first rebuilds the group with every engine, then broadcasts.
            await fleet.leave_update_group(spec.group_name)
            weight_sync.leave_update_group(group)
            old_groups.clear()
            spec, group = await join(fleet)
            old_groups.append(group)
            assert await fleet.update_group_joined()
            await broadcast_push(fleet, spec, group, trainer_reference, "ad2", slot=0, version=2)
            assert await serves(client, [*new_urls, fleet.router_url], name, trainer_reference, "ad2")
            assert await asyncio.gather(*[e.slots.remote() for e in fleet.engines]) == [{0: 2}, {0: 2}]
    finally:
        for g in old_groups:
            weight_sync.leave_update_group(g)


async def test_versioned_fleet_serves_the_stamped_version_on_every_engine(ray_session, tiny_model_dir, tmp_path,
                                                                         trainer_reference, lora_max_rank):
    server = EngineServerConfig(kind="builtin", model_path=str(tiny_model_dir), n_slots=2, max_lora_rank=lora_max_rank,
                                target_modules="all-linear", dtype="float32", device="cpu", lora_update="versioned")
    fleet = await EngineFleet.start(EngineFleetConfig(server=server, num_engines=2, work_dir=str(tmp_path),
                                                      start_timeout_s=180))
    try:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            urls = await fleet.engine_urls()
            for version, adapter in ((1, "ad0"), (2, "ad2"), (3, "alt")):
                tensors = lora.get_slot_weights(trainer_reference.model, trainer_reference.slots[adapter])
                rank, alpha = lora.slot_rank_alpha(trainer_reference.model, trainer_reference.slots[adapter])
                targets = sorted({n.rsplit(".", 1)[-1] for n in lora.lora_modules(trainer_reference.model)})
                config = lora.peft_adapter_config(rank=rank, alpha=alpha, target_modules=targets,
                                                  base_model_name_or_path=None)
                name = fleet.lora_name(1, version)
                assert name == f"__miles_slot_1_v{version}"
                push = LoraPush(adapter=adapter, slot=1, version=version, peft_config=config,
                                tensors_ref=ray.put(tensors))
                assert await fleet.push_lora(push) == [name, name]
                # A group stamped with this version is served it by whichever engine the router picks.
                assert await serves(client, [*urls, fleet.router_url], name, trainer_reference, adapter)
            # Groups stamped one version back still run; two back is unloaded.
            assert await serves(client, urls, fleet.lora_name(1, 2), trainer_reference, "ad2")
            gone = await client.post(urls[0] + "/generate", json={"input_ids": [5, 6], "lora_path": fleet.lora_name(1, 1),
                                                                  "sampling_params": GREEDY})
            assert gone.status_code == 400
    finally:
        await fleet.shutdown()
