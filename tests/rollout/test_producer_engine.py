"""The producer against a real builtin engine (tiny model, two PEFT adapters loaded in
slots 0 and 1) behind the real sglang-router: stamped groups for both adapters, and a
mid-generation deregistration whose prefix abort the engine reports as aborted while
the other adapter keeps producing."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest

from miles.rollout.buffers import AdapterBuffers
from miles.rollout.data_source import DataSourceConfig, MultiLoRADataSource
from miles.rollout.engines.process import ServerProcess
from miles.rollout.engines.router import Router
from miles.rollout.engines.server_command import BUILTIN_URL_LINE
from miles.rollout.producer import ProducerConfig, RolloutProducer
from miles.utils.types import MultiLoRASnapshot, engine_lora_name
from tests.helpers.rollout_fakes import FakeController, active, make_run
from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.slow


def write_adapters(model_dir, out_dir) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
        path = out_dir / f"adapter{seed}"
        peft_model.save_pretrained(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def router_url(tiny_model_dir, tmp_path_factory):
    adapters = write_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))
    logs = tmp_path_factory.mktemp("logs")
    command = [
        sys.executable, "-m", "miles.rollout.engines.builtin_server", "--model-path", str(tiny_model_dir),
        "--host", "127.0.0.1", "--port", "0", "--max-loras-per-batch", "2", "--max-lora-rank", "8", "--device", "cpu",
        "--lora-paths", f"{engine_lora_name(0)}={adapters[0]}", f"{engine_lora_name(1)}={adapters[1]}",
    ]
    started = ServerProcess.start(command, log_path=logs / "engine.log", url_line=BUILTIN_URL_LINE, timeout_s=120,
                                  what="builtin server")
    engine, engine_url = asyncio.run(started)
    try:
        router = asyncio.run(Router.launch([engine_url], log_path=logs / "router.log"))
        try:
            yield router.url, engine_url
        finally:
            asyncio.run(router.shutdown())
    finally:
        engine.terminate()


async def post(url: str, body: dict) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        reply = await client.post(url, json=body)
    assert reply.status_code == 200, reply.text


async def held_requests(engine: str) -> tuple[int, int]:
    """(decoding, queued) requests at the engine."""
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        info = (await client.get(f"{engine}/get_server_info")).json()
    return info["running_requests"], info["waiting_requests"]


async def test_two_adapters_then_deregistration_aborts_only_its_requests(router_url, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    router, engine = router_url
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(8)))
    common = dict(data=str(data), input_key="text", label_key="label", rm_type="final_number", n_samples=2)
    a = make_run("a", 0, version=3, registration_id="reg-a-1", **common)
    b = make_run("b", 1, version=7, registration_id="reg-b-1", **common)
    controller = FakeController(active(a, b))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    source = MultiLoRADataSource(DataSourceConfig(seed=0, apply_chat_template=False, default_rm_type=None),
                                 tokenizer)
    # Greedy and long, so requests are still decoding when the abort arrives.
    config = ProducerConfig(max_groups_in_flight=4, max_new_tokens=48, temperature=0.0, top_p=1.0, top_k=1,
                            snapshot_poll_s=0.05)
    buffers = AdapterBuffers()
    prod = RolloutProducer(config, router_url=router, controller=controller, data_source=source, buffers=buffers,
                           lora_name=engine_lora_name, reward_args=None)
    prod.start()
    try:
        await wait_until_async(lambda: len(buffers.get("a")) >= 2 and len(buffers.get("b")) >= 2, 120,
                               "groups of both adapters")
        for name, run in (("a", a), ("b", b)):
            for group in buffers.get(name).pop(2):
                assert (group.slot, group.version, group.registration_id) == (run.slot, run.version,
                                                                              run.registration_id)
                assert len(group.samples) == 2
                for sample in group.samples:
                    assert len(sample.rollout_logprobs) == len(sample.response_ids) <= 48
                    assert all(lp <= 0.0 for lp in sample.rollout_logprobs)
        # Paused in place, the engine holds every request that reaches it; once it holds two per
        # group the producer has in flight (both samples of each), a's requests are all there.
        await post(f"{engine}/pause_generation", {"mode": "in_place"})
        try:
            async def all_held() -> bool:
                return prod.in_flight["a"] >= 1 and sum(await held_requests(engine)) == 2 * sum(prod.in_flight.values())

            await wait_until_async(all_held, 60, "the paused engine to hold every request in flight, a's among them")
            held_a, aborted_a = prod.in_flight["a"], prod.count("aborted", "a")
            # Deregistration as the controller does it: a leaves the snapshot, then a prefix abort.
            controller.current = MultiLoRASnapshot(active={"b": b})
            await wait_until_async(lambda: "a" not in prod._snapshot.sampleable, 10, "the producer to see a gone")
            await post(f"{engine}/abort_request", {"rid": "a::", "prefix": True})
            await wait_until_async(lambda: prod.in_flight["a"] == 0, 60, "a's requests to finish")
            assert prod.count("aborted", "a") - aborted_a == held_a  # every group of a in flight, and only a's
            assert prod.count("aborted", "b") == 0
        finally:
            await post(f"{engine}/continue_generation", {})
        submitted_a, produced_b = prod.count("submitted", "a"), prod.count("produced", "b")
        await wait_until_async(lambda: prod.count("produced", "b") >= produced_b + 2, 120, "b to keep producing")
        assert prod.count("submitted", "a") == submitted_a
        assert prod.count("aborted", "b") == 0 and prod.failure is None
    finally:
        await prod.stop()


TWO_TURNS = '''
from miles.rollout.generate import FINISH_STATUS
from miles.utils.types import SampleStatus

SECOND_TURNS = []
ABORTED = []  # (sample, turn) of each conversation an abort ended
OBSERVATION = " ok "
BEFORE_SECOND_TURN = None  # set by the test: awaited before a second turn is sent


async def generate(input):
    sample, engine = input.sample, input.engine
    ids, mask, logps = [], [], []
    for turn, extra in enumerate(({"max_new_tokens": 4}, {"max_new_tokens": 480, "ignore_eos": True})):
        if turn == 1:
            SECOND_TURNS.append(sample)
            if BEFORE_SECOND_TURN is not None:
                await BEFORE_SECOND_TURN()
        out = await engine.generate(sample.prompt_ids + ids, {**input.sampling_params, **extra})
        if FINISH_STATUS[out.meta_info.finish_reason.type] is SampleStatus.ABORTED:
            sample.status = SampleStatus.ABORTED
            ABORTED.append((sample, turn))
            return sample
        ids += out.output_ids
        mask += [1] * len(out.output_ids)
        logps += [lp for lp, _, _ in out.meta_info.output_token_logprobs]
        if turn == 0:
            observation = input.tokenizer.encode(OBSERVATION, add_special_tokens=False)
            ids, mask, logps = ids + observation, mask + [0] * len(observation), logps + [0.0] * len(observation)
    sample.tokens = sample.prompt_ids + ids
    sample.response_length = len(ids)
    sample.loss_mask, sample.rollout_log_probs = mask, logps
    sample.status = SampleStatus.COMPLETED
    return sample
'''


async def test_two_turn_generate_function_then_prefix_abort_in_the_second_turn(router_url, tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    from transformers import AutoTokenizer

    (tmp_path / "two_turns.py").write_text(TWO_TURNS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "two_turns", raising=False)
    import two_turns

    router, engine = router_url
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(8)))
    a = make_run("a", 1, data=str(data), input_key="text", label_key="label", rm_type="final_number", n_samples=1,
                 custom_generate_function_path="two_turns.generate")
    controller = FakeController(active(a))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    source = MultiLoRADataSource(DataSourceConfig(seed=0, apply_chat_template=False, default_rm_type=None),
                                 tokenizer)
    config = ProducerConfig(max_groups_in_flight=1, max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=1,
                            snapshot_poll_s=0.05)
    buffers = AdapterBuffers()
    prod = RolloutProducer(config, router_url=router, controller=controller, data_source=source, buffers=buffers,
                           lora_name=engine_lora_name, reward_args=None)
    prod.start()
    try:
        await wait_until_async(lambda: len(buffers.get("a")) >= 1, 120, "a two-turn group")
        sample = buffers.get("a").pop(1)[0].samples[0]
        observation = tokenizer.encode(two_turns.OBSERVATION, add_special_tokens=False)
        first = sample.response_ids[: sample.loss_mask.index(0)]
        second = sample.response_ids[len(first) + len(observation):]
        assert sample.response_ids[len(first): len(first) + len(observation)] == observation
        assert sample.loss_mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
        assert len(second) == 480 and len(sample.rollout_logprobs) == sample.response_length
        # Greedy: the engine, asked directly with the conversation so far and the slot's
        # LoRA, continues exactly as the second turn did.
        async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
            reply = await client.post(f"{engine}/generate", json={
                "input_ids": sample.prompt_ids + first + observation, "lora_path": engine_lora_name(1),
                "sampling_params": {"max_new_tokens": 480, "temperature": 0.0, "top_k": 1, "ignore_eos": True}})
        assert reply.json()["output_ids"] == second

        # The controller's deregistration while a conversation is in its second turn: the next
        # conversation to reach it pauses the engine in place first, so its second turn is held
        # there (one group in flight, one sample: the only request) until the abort.
        async def pause_once() -> None:
            two_turns.BEFORE_SECOND_TURN = None
            await post(f"{engine}/pause_generation", {"mode": "in_place"})

        two_turns.BEFORE_SECOND_TURN = pause_once
        try:
            async def second_turn_held() -> bool:  # it arrived after the pause: queued, not decoding
                return two_turns.BEFORE_SECOND_TURN is None and await held_requests(engine) == (0, 1)

            await wait_until_async(second_turn_held, 60, "a second turn held by the paused engine")
            target = two_turns.SECOND_TURNS[-1]
            controller.current = MultiLoRASnapshot()
            # Seen gone, a gets no new group once the aborted one ends (it would wait at the paused engine).
            await wait_until_async(lambda: "a" not in prod._snapshot.sampleable, 10, "the producer to see a gone")
            await post(f"{engine}/abort_request", {"rid": "a::", "prefix": True})
            await wait_until_async(lambda: prod.in_flight["a"] == 0, 60, "the conversation to end")
        finally:
            two_turns.BEFORE_SECOND_TURN = None
            await post(f"{engine}/continue_generation", {})
        assert two_turns.ABORTED == [(target, 1)] and target.status.value == "aborted"
        assert prod.count("aborted", "a") == 1
        assert prod.failure is None
    finally:
        await prod.stop()
