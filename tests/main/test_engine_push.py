"""Pushes from a real torch train rank to real builtin engines behind the sglang-router, in
both `--engine-lora-update` modes: a group generated after a push, under the name of the
version it was stamped with, gets exactly the trainer's logprobs for that version.

The engines' logprobs for the generated tokens must equal the train rank's logprobs of
the same tokens under the same weights, after each of two optimizer steps (so the
weights of the second push differ from the first). Serving an old version, or naming a
LoRA the engines do not hold, fails these checks. In-place pushes also survive a killed
server: the pusher rejoins the weights-update group before the next push. In both modes an
engine actor killed as a push starts is restarted by Ray and reloaded by the fleet with the
version that push recorded before the router lists it again.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import pytest

from miles.backends.base import AdapterSpec
from miles.backends.common.train_group import TrainGroup, TrainGroupConfig
from miles.backends.torch.actor import TrainActorConfig
from miles.backends.torch.train_group import torch_train_group
from miles.main.engine_push import EnginePusher
from miles.rollout.engines.fleet import EngineFleet, EngineFleetConfig
from miles.rollout.engines.server_command import EngineServerConfig
from miles.utils.types import RolloutBatch, Sample
from tests.helpers.fleet_pushes import FleetManager
from tests.helpers.waiting import wait_until_async

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

SLOT = 1
PROMPT = [5, 17, 42, 8, 23]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def training_batch(rollout_id: int, seed: int) -> RolloutBatch:
    """Two groups of random responses with rewards that differ within each group."""
    rng = random.Random(seed)
    samples = [Sample(adapter="a", slot=SLOT, group_index=g, index=i, prompt="", label=None, metadata={},
                      prompt_ids=list(PROMPT), response_ids=[rng.randrange(4, 100) for _ in range(4)],
                      reward=float(i % 2))
               for g in range(2) for i in range(2)]
    return RolloutBatch(rollout_id=rollout_id, samples=samples, prompt_group_sizes=[2, 2],
                        groups_per_adapter={"a": 2}, step_names=["a"])


async def generate(client: httpx.AsyncClient, url: str, lora_name: str) -> tuple[list[int], list[float]]:
    response = await client.post(url + "/generate", json={"input_ids": PROMPT, "lora_path": lora_name,
                                                           "sampling_params": GREEDY, "return_logprob": True})
    assert response.status_code == 200, response.text
    out = response.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


async def trainer_logprobs(group: TrainGroup, response_ids: list[int]) -> list[float]:
    sample = Sample(adapter="a", slot=SLOT, group_index=0, index=0, prompt="", label=None, metadata={},
                    prompt_ids=list(PROMPT), response_ids=response_ids)
    return (await group.actors[0].logprobs.remote([sample]))[0]


def max_diff(x: list[float], y: list[float]) -> float:
    assert len(x) == len(y)
    return max(abs(a - b) for a, b in zip(x, y))


@pytest.mark.parametrize("mode", ["in_place", "versioned"])
async def test_a_group_after_a_push_is_generated_by_the_pushed_weights(ray_session, tiny_model_dir, tmp_path, mode):
    group = torch_train_group(TrainGroupConfig(
        actor=TrainActorConfig(hf_checkpoint=str(tiny_model_dir), n_slots=2, lora_rank=4), n_workers=1,
        num_cpus_per_worker=0))
    server = EngineServerConfig(kind="builtin", model_path=str(tiny_model_dir), n_slots=2, max_lora_rank=4,
                                target_modules="all-linear", dtype="float32", device="cpu", lora_update=mode)
    fleet_cfg = EngineFleetConfig(server=server, num_engines=2, work_dir=str(tmp_path / "engines"),
                                  start_timeout_s=180)
    fleet, _ = await asyncio.gather(EngineFleet.start(fleet_cfg), group.start())
    pusher = EnginePusher(group, fleet.engines, FleetManager(fleet), mode=mode)
    try:
        await group.load_adapter(AdapterSpec(name="a", slot=SLOT, rank=4, alpha=8.0, global_batch_size=4, lr=0.05))
        served: dict[int, tuple[list[int], list[float]]] = {}
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for version in (1, 2):
                await group.train(version, training_batch(version, seed=version))
                await group.step_adapters(["a"])
                export = await group.export_adapter("a")
                stats = await pusher.push([(SLOT, version, export)])
                assert stats.adapters == 1 and stats.bytes == export.nbytes > 0
                assert stats.joins == (2 if mode == "in_place" and version == 1 else 0)  # one group per engine
                name = fleet.lora_name(SLOT, version)
                assert name == ("__miles_slot_1" if mode == "in_place" else f"__miles_slot_1_v{version}")
                # Every engine, and the router, serve the trainer's weights of this version.
                for url in [*await fleet.engine_urls(), fleet.router_url]:
                    tokens, logprobs = await generate(client, url, name)
                    assert max_diff(logprobs, await trainer_logprobs(group, tokens)) < 1e-4
                served[version] = (tokens, logprobs)
            # The second step changed the weights, so serving version 1 after the second push fails the check.
            tokens_v1, logprobs_v1 = served[1]
            assert max_diff(await trainer_logprobs(group, tokens_v1), logprobs_v1) > 1e-3

            if mode == "in_place":
                # A killed server comes back with the slot; the next push rejoins the group first.
                os.kill(await fleet.engines[0].pid.remote(), signal.SIGKILL)

                async def server_restarted() -> bool:
                    return await fleet.engines[0].restart_count.remote() >= 1

                await wait_until_async(server_restarted, 180, "engine 0 to restart its server")
                await group.train(3, training_batch(3, seed=3))
                await group.step_adapters(["a"])
                stats = await pusher.push([(SLOT, 3, await group.export_adapter("a"))])
                assert stats.joins == 1  # only the restarted engine's group is rebuilt
                for url in await fleet.engine_urls():
                    tokens, logprobs = await generate(client, url, fleet.lora_name(SLOT, 3))
                    assert max_diff(logprobs, await trainer_logprobs(group, tokens)) < 1e-4

            # Ray restarts a killed engine actor. The push sent right after the kill misses it (it is
            # down), yet the fleet loads the version that push recorded before routing to it again.
            version = 4 if mode == "in_place" else 3
            urls = await fleet.engine_urls()
            killed = await fleet.engines[1].identity.remote()
            os.kill(await fleet.engines[1].actor_pid.remote(), signal.SIGKILL)
            await pusher.push([(SLOT, version, await group.export_adapter("a"))])
            await wait_until_async(lambda: fleet.actor_restarts >= 1, 180,
                                   "the fleet to restore the restarted engine actor")
            new_urls = await fleet.engine_urls()
            restored_engine = await fleet.engines[1].identity.remote()  # the fleet has called it: it is up
            # A new actor with a server of its own (whose port may happen to be the old one).
            assert restored_engine.incarnation != killed.incarnation and restored_engine.url == new_urls[1]
            assert new_urls[0] == urls[0]
            assert set(await fleet.router.workers()) == set(new_urls)
            assert fleet.live_slots() == {SLOT: version}
            assert await fleet.engines[1].slots.remote() == {SLOT: version}
            # The same LoRAs as its peer (versioned: the version before too, for groups in flight).
            peer, restored = [set((await client.get(u + "/get_server_info")).json()["loaded_loras"]) for u in new_urls]
            assert restored == peer == ({fleet.lora_name(SLOT, version)} if mode == "in_place" else
                                        {fleet.lora_name(SLOT, version - 1), fleet.lora_name(SLOT, version)})
            tokens, logprobs = await generate(client, new_urls[1], fleet.lora_name(SLOT, version))
            assert max_diff(logprobs, await trainer_logprobs(group, tokens)) < 1e-4
            # The next push reaches it like any other engine (in place: after rejoining its group).
            version += 1
            await group.train(version, training_batch(version, seed=version))
            await group.step_adapters(["a"])
            stats = await pusher.push([(SLOT, version, await group.export_adapter("a"))])
            assert stats.joins == (1 if mode == "in_place" else 0)
            for url in [*new_urls, fleet.router_url]:
                tokens, logprobs = await generate(client, url, fleet.lora_name(SLOT, version))
                assert max_diff(logprobs, await trainer_logprobs(group, tokens)) < 1e-4

            # Retired: no engine serves the slot any more, and a restarted engine would not load it.
            await pusher.unload(SLOT)
            assert fleet.live_slots() == {}
            for url in new_urls:
                gone = await client.post(url + "/generate", json={
                    "input_ids": PROMPT, "lora_path": fleet.lora_name(SLOT, version), "sampling_params": GREEDY})
                assert gone.status_code == 400, gone.text
    finally:
        await pusher.close()
        await fleet.shutdown()
        await group.shutdown()
