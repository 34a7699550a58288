"""Versioned pushes through Ray engine actors and the real sglang-router, by the trainer's push
path (`EnginePusher`): every engine serves the version a group was stamped with, the version
before it still runs, older ones are unloaded. (A killed server, a killed engine actor and the
in-place path over the same fleet: tests/main/test_engine_push.py.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from miles import lora
from miles.rollout.engines.fleet import EngineFleet, EngineFleetConfig
from miles.rollout.engines.server_command import EngineServerConfig
from tests.helpers.fleet_pushes import fleet_pusher, lora_export

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


async def serves(client, urls: list[str], name: str, reference, adapter: str) -> bool:
    prompt_ids = reference.tokenizer.encode("hello there")
    for url in urls:
        out = (await client.post(url + "/generate", json={"input_ids": prompt_ids, "lora_path": name,
                                                          "sampling_params": GREEDY})).json()
        if out["output_ids"] != reference.score(prompt_ids, out["output_ids"], adapter).greedy_tokens:
            return False
    return True


async def test_versioned_fleet_serves_the_stamped_version_on_every_engine(ray_session, tiny_model_dir, tmp_path,
                                                                         trainer_reference, lora_max_rank):
    server = EngineServerConfig(kind="builtin", model_path=str(tiny_model_dir), n_slots=2, max_lora_rank=lora_max_rank,
                                target_modules="all-linear", dtype="float32", device="cpu", lora_update="versioned")
    fleet = await EngineFleet.start(EngineFleetConfig(server=server, num_engines=2, work_dir=str(tmp_path),
                                                      start_timeout_s=180))
    pusher = fleet_pusher(fleet, "versioned")
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
                await pusher.push([(1, version, lora_export(config, tensors))])
                assert await asyncio.gather(*[e.slots.remote() for e in fleet.engines]) == [{1: version}] * 2
                # A group stamped with this version is served it by whichever engine the router picks.
                assert await serves(client, [*urls, fleet.router_url], name, trainer_reference, adapter)
            # Groups stamped one version back still run; two back is unloaded.
            assert await serves(client, urls, fleet.lora_name(1, 2), trainer_reference, "ad2")
            gone = await client.post(urls[0] + "/generate",
                                     json={"input_ids": [5, 6], "lora_path": fleet.lora_name(1, 1),
                                           "sampling_params": GREEDY})
            assert gone.status_code == 400
    finally:
        await pusher.close()
        await fleet.shutdown()
