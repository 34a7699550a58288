"""The producer against a real builtin engine (tiny model, two PEFT adapters loaded in
slots 0 and 1) behind the real sglang-router: stamped groups for both adapters, and a
mid-generation deregistration whose prefix abort the engine reports as aborted while
the other adapter keeps producing."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from rollout_fakes import FakeController, active, make_run
from waiting import wait_until_async

from miles.rollout.buffers import AdapterBuffers
from miles.rollout.data_source import DataSourceConfig, MultiLoRADataSource
from miles.rollout.engines.process import free_port
from miles.rollout.producer import ProducerConfig, RolloutProducer
from miles.utils.types import MultiLoRASnapshot, engine_lora_name

pytestmark = pytest.mark.slow



def wait_healthy(url: str, proc: subprocess.Popen, path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}{path} not healthy after {timeout}s")


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
    engine_port, router_port = free_port(), free_port()
    engine = subprocess.Popen([
        sys.executable, "-m", "miles.rollout.engines.builtin_server", "--model-path", str(tiny_model_dir),
        "--host", "127.0.0.1", "--port", str(engine_port), "--max-loras-per-batch", "2", "--max-lora-rank", "8",
        "--device", "cpu", "--lora-paths", f"{engine_lora_name(0)}={adapters[0]}", f"{engine_lora_name(1)}={adapters[1]}",
    ])
    router = None
    try:
        wait_healthy(f"http://127.0.0.1:{engine_port}", engine, "/health")
        router = subprocess.Popen([
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(router_port),
            "--worker-urls", f"http://127.0.0.1:{engine_port}", "--policy", "round_robin", "--log-level", "warn",
        ])
        wait_healthy(f"http://127.0.0.1:{router_port}", router, "/health")
        yield f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{engine_port}"
    finally:
        for proc in (router, engine):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()


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
        await wait_until_async(lambda: prod.in_flight["a"] >= 1, 60, "requests of a in flight")
        # Deregistration as the controller does it: a leaves the snapshot, then a prefix abort.
        controller.current = MultiLoRASnapshot(active={"b": b})
        async with httpx.AsyncClient(trust_env=False) as client:
            reply = await client.post(f"{engine}/abort_request", json={"rid": "a::", "prefix": True})
            assert reply.status_code == 200
        await wait_until_async(lambda: prod.in_flight["a"] == 0, 60, "a's requests to finish")
        assert prod.count("aborted", "a") >= 1
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


async def generate(input):
    sample, engine = input.sample, input.engine
    ids, mask, logps = [], [], []
    for turn, extra in enumerate(({"max_new_tokens": 4}, {"max_new_tokens": 480, "ignore_eos": True})):
        if turn == 1:
            SECOND_TURNS.append(sample)
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

        # The controller's deregistration while a conversation is in its second turn. That turn
        # may end before the abort reaches the engine; then the next conversation is tried.
        for _ in range(5):
            n_second = len(two_turns.SECOND_TURNS)
            await wait_until_async(lambda: len(two_turns.SECOND_TURNS) > n_second, 60, "a second turn")
            target = two_turns.SECOND_TURNS[-1]
            controller.current = MultiLoRASnapshot()
            async with httpx.AsyncClient(trust_env=False) as client:
                reply = await client.post(f"{engine}/abort_request", json={"rid": "a::", "prefix": True})
                assert reply.status_code == 200
            await wait_until_async(lambda: prod.in_flight["a"] == 0, 60, "the conversation to end")
            if target.status.value == "aborted":
                break
            controller.current = active(a)
        else:
            raise AssertionError("no abort reached a conversation in its second turn in 5 tries")
        assert any(sample is target and turn == 1 for sample, turn in two_turns.ABORTED)
        assert prod.count("aborted", "a") == len(two_turns.ABORTED)
        assert prod.failure is None
    finally:
        await prod.stop()
