"""Engine supervision: start failures are explained; pushes in both update modes; a killed
server comes back behind the router serving every slot at its current version; an engine
created again in the same place (what Ray does after the actor died) stops the server its
predecessor left and serves exactly the slots the fleet gives it."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import httpx
import pytest
import ray

from miles import lora
from miles.lora import weight_sync
from miles.rollout.engines.engine_actor import EngineNotReadyError, EngineServer
from miles.rollout.engines.process import ServerStartError
from miles.rollout.engines.router import Router
from miles.rollout.engines.server_command import EngineServerConfig
from miles.utils.types import SlotPush
from tests.helpers.waiting import wait_until_async

session_loop = pytest.mark.asyncio(loop_scope="session")

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def builtin_config(model_path: str, max_rank: int, mode: str = "in_place") -> EngineServerConfig:
    return EngineServerConfig(kind="builtin", model_path=model_path, n_slots=2, max_lora_rank=max_rank,
                              target_modules="all-linear", lora_update=mode)


def peft_payload(reference, adapter: str) -> tuple[dict, dict]:
    slot = reference.slots[adapter]
    rank, alpha = lora.slot_rank_alpha(reference.model, slot)
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora.lora_modules(reference.model)})
    config = lora.peft_adapter_config(rank=rank, alpha=alpha, target_modules=targets, base_model_name_or_path=None)
    return config, lora.get_slot_weights(reference.model, slot)


async def greedy_matches(client: httpx.AsyncClient, url: str, name: str, reference, adapter: str) -> bool:
    prompt_ids = reference.tokenizer.encode("hello there")
    response = await client.post(url + "/generate", json={"input_ids": prompt_ids, "lora_path": name,
                                                          "sampling_params": GREEDY})
    assert response.status_code == 200, response.text
    tokens = response.json()["output_ids"]
    return tokens == reference.score(prompt_ids, tokens, adapter).greedy_tokens


async def loaded(client: httpx.AsyncClient, url: str) -> set[str]:
    return set((await client.get(url + "/get_server_info")).json()["loaded_loras"])


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


@session_loop
async def test_versioned_pushes_keep_two_versions_per_slot(tiny_model_dir, trainer_reference, tmp_path,
                                                           lora_max_rank):
    server = EngineServer(builtin_config(str(tiny_model_dir), lora_max_rank, "versioned"), str(tmp_path),
                          start_timeout_s=120)
    url = await server.start()
    try:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            for version, adapter in [(1, "ad0"), (2, "ad2"), (3, "alt")]:
                served = await server.push_lora(1, version, *peft_payload(trainer_reference, adapter))
                assert served == server.served_lora_name(1) == f"__miles_slot_1_v{version}"
                assert await greedy_matches(client, url, served, trainer_reference, adapter)
                # The previous version keeps serving requests stamped with it; older ones are gone.
                expected = {f"__miles_slot_1_v{v}" for v in (version - 1, version) if v >= 1}
                assert await loaded(client, url) == expected
            assert await greedy_matches(client, url, "__miles_slot_1_v2", trainer_reference, "ad2")
            assert sorted(p.name for p in (tmp_path / "loras" / "slot_1").iterdir()) == ["v2", "v3"]
            await server.unload_slot(1)
            assert await loaded(client, url) == set()
        with pytest.raises(KeyError):
            server.served_lora_name(1)
    finally:
        await server.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_place", "versioned"])
@session_loop
async def test_killed_server_restarts_behind_the_router_with_every_slot(mode, ray_session, tiny_model_dir,
                                                                        trainer_reference, tmp_path, lora_max_rank):
    server = EngineServer(builtin_config(str(tiny_model_dir), lora_max_rank, mode), str(tmp_path / "engine"),
                          start_timeout_s=120, supervise_interval_s=0.2)
    url = await server.start()
    router = await Router.launch([url], log_path=tmp_path / "router.log")
    server.set_router(router.url)
    group = None
    try:
        await server.push_lora(0, 1, *peft_payload(trainer_reference, "ad0"))
        await server.push_lora(0, 2, *peft_payload(trainer_reference, "ad2"))
        config, tensors = peft_payload(trainer_reference, "ad1")
        if mode == "in_place":  # slot 1 by broadcast; the actor keeps only the object-store reference
            store = weight_sync.listening_store("127.0.0.1")  # the sender's rendezvous, on a port the OS gave it
            spec = weight_sync.UpdateGroupSpec(master_address="127.0.0.1", master_port=store.port, world_size=2,
                                               group_name=f"g{uuid.uuid4().hex[:6]}", timeout_s=60)
            _, group = await asyncio.gather(server.init_weights_update_group(**spec.init_request(1)),
                                            asyncio.to_thread(weight_sync.join_update_group, spec, 0, store))
            assert server.update_group_joined()
            names, dtypes, shapes = weight_sync.tensor_metadata(tensors)
            await asyncio.gather(
                server.push_lora_from_distributed(1, 1, config, names, dtypes, shapes, spec.group_name,
                                                  weights_ref=[ray.put(tensors)]),
                asyncio.to_thread(weight_sync.broadcast_tensors, group, tensors))
        else:
            await server.push_lora(1, 1, config, tensors)
        assert server.slots() == {0: 2, 1: 1}

        old_pid = server.pid()
        os.kill(old_pid, signal.SIGKILL)
        await wait_until_async(lambda: server.restarts == 1, 180, "the engine to restart its server")
        new_url = server.url()
        assert server.pid() != old_pid and await server.health()
        assert await router.workers() == [new_url]  # the old server out, the new one in (its port may be the old one)
        assert server.slots() == {0: 2, 1: 1}
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            for slot, adapter in ((0, "ad2"), (1, "ad1")):  # through the router: the restarted server
                assert await greedy_matches(client, router.url, server.served_lora_name(slot), trainer_reference,
                                            adapter)
            current = {server.served_lora_name(0), server.served_lora_name(1)}
            assert await loaded(client, new_url) == current  # current versions only
        assert not server.update_group_joined()  # the next broadcast push needs a new group
    finally:
        await router.shutdown()
        await server.shutdown()
        if group is not None:
            weight_sync.leave_update_group(group)


@pytest.mark.slow
@session_loop
async def test_a_push_to_a_dead_server_lands_after_the_restart(tiny_model_dir, trainer_reference, tmp_path,
                                                               lora_max_rank):
    # No supervision rounds here: the push itself finds the server dead and restarts it.
    server = EngineServer(builtin_config(str(tiny_model_dir), lora_max_rank, "versioned"), str(tmp_path),
                          start_timeout_s=120, supervise_interval_s=3600)
    await server.start()
    try:
        await server.push_lora(0, 1, *peft_payload(trainer_reference, "ad0"))
        process = server._process
        os.kill(server.pid(), signal.SIGKILL)
        await asyncio.to_thread(process.popen.wait, 30)
        served = await server.push_lora(0, 2, *peft_payload(trainer_reference, "ad2"))
        assert served == "__miles_slot_0_v2" and server.restarts == 1
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            assert await greedy_matches(client, server.url(), served, trainer_reference, "ad2")
            assert await loaded(client, server.url()) == {served}
    finally:
        await server.shutdown()


@pytest.mark.slow
@session_loop
async def test_a_recreated_engine_stops_the_old_server_and_serves_the_slots_it_is_given(
        ray_session, tiny_model_dir, trainer_reference, tmp_path, lora_max_rank):
    cfg = builtin_config(str(tiny_model_dir), lora_max_rank, "versioned")
    first = EngineServer(cfg, str(tmp_path), start_timeout_s=120)
    await first.start()
    leftover = first._process
    second = EngineServer(cfg, str(tmp_path), start_timeout_s=120)  # same arguments, empty memory
    try:
        assert second.identity().incarnation != first.identity().incarnation and second.identity().url is None
        with pytest.raises(EngineNotReadyError):
            second.update_group_joined()
        with pytest.raises(EngineNotReadyError):
            await second.push_lora(0, 1, *peft_payload(trainer_reference, "ad0"))
        url = await second.start()
        assert await asyncio.to_thread(leftover.popen.wait, 30) == -signal.SIGKILL

        def push(slot: int, version: int, adapter: str) -> SlotPush:
            config, tensors = peft_payload(trainer_reference, adapter)
            return SlotPush(slot, version, config, ray.put(tensors))

        # The fleet's record: slot 0 at v2 with v1 before it, slot 1 at v1.
        assert await second.sync_slots([push(0, 2, "ad2"), push(1, 1, "ad1"), push(0, 1, "ad0")]) == {0: 2, 1: 1}
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            assert await loaded(client, url) == {"__miles_slot_0_v1", "__miles_slot_0_v2", "__miles_slot_1_v1"}
            for name, adapter in (("__miles_slot_0_v2", "ad2"), ("__miles_slot_0_v1", "ad0"),
                                  ("__miles_slot_1_v1", "ad1")):
                assert await greedy_matches(client, url, name, trainer_reference, adapter)
            # Slot 1 left meanwhile: a second pass unloads it and leaves slot 0 as it is.
            assert await second.sync_slots([push(0, 2, "ad2")]) == {0: 2}
            assert await loaded(client, url) == {"__miles_slot_0_v1", "__miles_slot_0_v2"}
    finally:
        await second.shutdown()
        await first.shutdown()
