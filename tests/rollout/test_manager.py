"""The RolloutManager actor end to end on CPU: real controller actor, builtin engine
and router from the engine fleet, two registered adapters (one resuming its data
stream from a saved position), one train batch with exact accounting and typed
per-adapter stats; then the only engine's actor is killed and the next batch still comes,
from the restarted engine with the recorded slots; an idempotent dispose takes the router
down."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
import ray

from miles.lora.peft_io import read_peft_dir
from miles.rollout.data_source import AdapterDataset
from miles.utils.arguments import MilesConfig
from miles.utils.types import AdapterRolloutStats, DataPosition, SlotPush, engine_lora_name
from miles.utils.types.lifecycle_ops import MarkBatchTrained, RecordWeightUpdate
from tests.helpers.waiting import call_actor_async

pytestmark = pytest.mark.slow


def write_adapter(model_dir, path, seed):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                     init_lora_weights=False)).save_pretrained(path)
    return str(path)


async def worker_urls(router: str) -> list[str]:
    async with httpx.AsyncClient(trust_env=False) as client:
        reply = await client.get(f"{router}/list_workers")
        if reply.status_code == 200:
            return reply.json()["urls"]
        reply = await client.get(f"{router}/workers")
        return [w["url"] for w in reply.json()["workers"]]


async def test_manager_generates_an_accounted_batch_and_disposes(ray_session, tiny_model_dir, tmp_path):
    from miles.controller.actor import create_multilora_controller, destroy_multi_lora_controller
    from miles.rollout.manager import RolloutManager

    data = tmp_path / "d.jsonl"
    rows = [{"text": f"{i}+{i}=", "label": str(2 * i)} for i in range(6)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = MilesConfig(
        hf_checkpoint=str(tiny_model_dir), device="cpu", multi_lora_n_adapters=2, lora_rank=8,
        rollout_num_engines=1, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=8,
        rollout_max_response_len=6, rm_type="math", save=str(tmp_path / "save"), multi_lora_api_port=0,
        rollout_shuffle=True,
        multi_lora_allowed_roots=[str(tmp_path)], multi_lora_max_coalesce_wait_s=60.0,
        multi_lora_max_empty_wait_s=120.0,
    )
    controller = create_multilora_controller(cfg)
    manager = RolloutManager.remote(cfg)
    try:
        router = await manager.start.remote(controller)
        assert await manager.get_router_address.remote() == router
        assert len(await manager.engines.remote()) == 1
        slots = {name: await controller.register_adapter.remote(name, {"data": str(data)}) for name in ("a", "b")}
        # a resumes its stream at row 2 of epoch 1 (stream index 8) while still PENDING.
        registration_a = (await controller.snapshot.remote()).pending["a"].registration_id
        await manager.restore_data_position.remote("a", registration_a, DataPosition(epoch=1, index=2))
        for url in await worker_urls(router):
            async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
                for seed, (name, slot) in enumerate(sorted(slots.items())):
                    path = write_adapter(tiny_model_dir, tmp_path / f"peft_{name}", seed)
                    reply = await client.post(f"{url}/load_lora_adapter",
                                              json={"lora_name": engine_lora_name(slot), "lora_path": path})
                    assert reply.status_code == 200, reply.text
        await controller.apply.remote(RecordWeightUpdate(["a", "b"]))

        batch = await manager.generate.remote(0)
        assert batch.groups_per_adapter == {"a": 2, "b": 2} and batch.step_names == ["a", "b"]
        assert len(batch.samples) == 8 and batch.prompt_group_sizes == [2, 2, 2, 2]
        assert slots == {"a": 0, "b": 1}
        assert [(s.adapter, s.slot) for s in batch.samples] == [("a", 0)] * 4 + [("b", 1)] * 4
        assert all(len(s.rollout_logprobs) == len(s.response_ids) <= 6 for s in batch.samples)
        assert any(s.response_ids for s in batch.samples)
        # a's prompts come from its restored stream (indices 8.. in the seeded order);
        # which of the first few finish first is up to the engine.
        resumed = AdapterDataset(rows, f"{cfg.rollout_seed}:a")
        resumed.seek(DataPosition(epoch=1, index=2))
        stream_a = dict(resumed.next_row() for _ in range(4))
        groups_a = {(s.group_index, s.prompt) for s in batch.samples if s.adapter == "a"}
        assert len(groups_a) == 2
        assert all(index in stream_a and stream_a[index]["text"] == prompt for index, prompt in groups_a)
        assert {s.group_index for s in batch.samples if s.adapter == "b"} <= {0, 1, 2, 3}
        assert set(batch.per_adapter) == {"a", "b"}
        assert all(isinstance(stats, AdapterRolloutStats) and stats.groups == 2 and stats.raw_reward_mean is not None
                   and stats.generation.produced >= 2 for stats in batch.per_adapter.values())
        assert batch.stats.batch_n_samples == 8 and batch.stats.generation.submitted >= 4
        positions = await manager.data_positions.remote()
        stream_index = {name: p.epoch * len(rows) + p.index for name, p in positions.items()}
        assert 10 <= stream_index["a"] <= 12 and 2 <= stream_index["b"] <= 4  # at most one step drawn ahead
        committed = await controller.apply.remote(MarkBatchTrained(0))
        assert {name: run.step for name, run in committed.live.items()} == {"a": 1, "b": 1}

        # The only engine's actor dies. Ray restarts it; the fleet loads the recorded slots and
        # routes to it again; meanwhile the producer waits instead of dying of failed groups.
        for name, slot in slots.items():
            tensors, config = read_peft_dir(tmp_path / f"peft_{name}")
            await manager.record_push.remote(SlotPush(slot, 1, config, ray.put(tensors)))
        [engine] = await manager.engines.remote()
        old_incarnation = (await engine.identity.remote()).incarnation
        os.kill(await engine.actor_pid.remote(), signal.SIGKILL)
        for rollout_id in (1, 2):  # at most one step is drawn ahead: the second needs the restarted engine
            batch = await manager.generate.remote(rollout_id)
            assert batch.groups_per_adapter == {"a": 2, "b": 2}
            committed = await controller.apply.remote(MarkBatchTrained(rollout_id))
            steps = {name: run.step for name, run in committed.live.items()}
            assert steps == {"a": 1 + rollout_id, "b": 1 + rollout_id}
        [new_url] = await worker_urls(router)
        # Ray may still be restarting the actor (ActorUnavailableError): ask until it answers.
        who = await call_actor_async(engine.identity, timeout=120, what="the restarted engine actor to answer")
        # a new actor's server (the port may be the old one)
        assert who.incarnation != old_incarnation and new_url == who.url
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            info = (await client.get(f"{new_url}/get_server_info")).json()
        assert set(info["loaded_loras"]) == {engine_lora_name(0), engine_lora_name(1)}
    finally:
        await manager.dispose.remote()
        await manager.dispose.remote()  # idempotent
        destroy_multi_lora_controller()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{router}/health", timeout=2.0, trust_env=False)
