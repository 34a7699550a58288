"""Custom generate functions through the real producer: the two-turn calculator-tool
example against a scripted SGLang-shaped server on loopback (request chain, loss mask,
logprobs, reward), abort by prefix in the middle of a conversation, an adapter retired
between two turns, and load-time checks of generate functions."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from typing import Any

import pytest
from fastapi import FastAPI, Request

from miles.recipes.calculator_tool import CALL_CLOSE
from miles.recipes.tiny_model import build_char_tokenizer
from miles.rollout.buffers import AdapterBuffers
from miles.rollout.data_source import DataSourceConfig, MultiLoRADataSource
from miles.rollout.generate import load_generate_function
from miles.rollout.producer import ProducerConfig, RolloutProducer
from miles.utils.plugins import PluginError
from miles.utils.types import SampleStatus, engine_lora_name
from tests.helpers.rollout_fakes import FakeController, active, make_run, served_url
from tests.helpers.waiting import wait_until_async

TOKENIZER = build_char_tokenizer()
ASK, TOOL, ANSWER = "<calc>47*36</calc>", "<result>1692</result>", "1692"


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class ScriptedEngine:
    """Answers the first turn of a conversation with `ASK` and a later one with `ANSWER`.

    Like SGLang, a turn stopped by a stop string has that string in `output_ids` and
    not in `text`. `turn_gates[i]` holds the i-th turn until it is set; a request whose
    rid starts with an aborted prefix finishes with "abort".
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.turn_gates = [asyncio.Event(), asyncio.Event()]
        for gate in self.turn_gates:
            gate.set()
        self.aborted_prefixes: list[str] = []
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            self.requests.append(body)
            turn = TOKENIZER.decode(body["input_ids"]).count("</result>")
            gate = asyncio.ensure_future(self.turn_gates[turn].wait())
            while not gate.done() and not self._aborted(body["rid"]):
                await asyncio.wait([gate], timeout=0.01)
            gate.cancel()
            if self._aborted(body["rid"]):
                return self._reply(body, "", "", "abort")
            if turn == 0:
                return self._reply(body, ASK, ASK[: -len(CALL_CLOSE)], "stop", matched=CALL_CLOSE)
            return self._reply(body, ANSWER, ANSWER, "stop")

        self.app = app

    def _aborted(self, rid: str) -> bool:
        return any(rid.startswith(prefix) for prefix in self.aborted_prefixes)

    @staticmethod
    def _reply(body, generated: str, text: str, reason: str, matched: str | None = None) -> dict[str, Any]:
        ids = encode(generated)
        logprobs = [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)]
        return {"text": text, "output_ids": ids,
                "meta_info": {"id": body["rid"], "finish_reason": {"type": reason, "matched": matched},
                              "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids),
                              "output_token_logprobs": logprobs}}

    async def __aenter__(self) -> ScriptedEngine:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                     lifespan="off"))
        self._task = asyncio.create_task(self._server.serve())
        self.url = await served_url(self._server, self._task)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for gate in self.turn_gates:
            gate.set()
        self._server.should_exit = True
        await self._task


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "calc.jsonl"
    path.write_text("".join(json.dumps({"text": "47*36=", "label": "1692"}) + "\n" for _ in range(4)))
    return str(path)


def calc_run(dataset, **kwargs):
    return make_run("calc", 2, data=dataset, input_key="text", label_key="label",
                    custom_rm_path="miles.recipes.calculator_tool.reward",
                    custom_generate_function_path="miles.recipes.calculator_tool.generate", **kwargs)


def producer(server, controller, **config):
    source = MultiLoRADataSource(DataSourceConfig(seed=0, apply_chat_template=False, default_rm_type=None), TOKENIZER)
    cfg = ProducerConfig(max_groups_in_flight=1, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=-1,
                         stop=("\n",), snapshot_poll_s=0.02, **config)
    buffers = AdapterBuffers()
    return RolloutProducer(cfg, router_url=server.url, controller=controller, data_source=source, buffers=buffers,
                           lora_name=engine_lora_name, reward_args=None), buffers


async def test_calculator_conversation_masks_the_tool_output(dataset):
    async with ScriptedEngine() as server:
        prod, buffers = producer(server, FakeController(active(calc_run(dataset, n_samples=2))))
        prod.start()
        await wait_until_async(lambda: len(buffers.get("calc")) >= 1, 10, "a group")
        await prod.stop()
    group = buffers.get("calc").pop(1)[0]
    sample = group.samples[0]
    prompt, ask, tool, answer = encode("47*36="), encode(ASK), encode(TOOL), encode(ANSWER)
    first_turns = [r for r in server.requests if r["input_ids"] == prompt]
    second_turns = [r for r in server.requests if r["input_ids"] != prompt]
    assert len(first_turns) >= 2 and len(second_turns) >= 2  # both samples of the group, two turns each
    first, second = first_turns[0], second_turns[0]
    assert second["input_ids"] == prompt + ask + tool
    assert first["rid"].split("::")[0] == second["rid"].split("::")[0] == "calc"
    assert first["rid"] != second["rid"] and first["lora_path"] == second["lora_path"] == "__miles_slot_2"
    assert first["sampling_params"]["stop"] == ["\n", CALL_CLOSE]
    assert sample.prompt_ids == prompt and sample.response_ids == ask + tool + answer
    assert sample.tokens == prompt + ask + tool + answer and sample.response_length == len(ask + tool + answer)
    assert sample.loss_mask == [1] * len(ask) + [0] * len(tool) + [1] * len(answer)
    assert sample.rollout_log_probs == pytest.approx(
        [-0.1 * (i + 1) for i in range(len(ask))] + [0.0] * len(tool) + [-0.1 * (i + 1) for i in range(len(answer))])
    assert sample.response == ASK + TOOL + ANSWER and sample.status is SampleStatus.COMPLETED
    assert sample.reward == 1.0


async def test_prefix_abort_mid_conversation_drops_the_group(dataset):
    async with ScriptedEngine() as server:
        server.turn_gates[1].clear()  # every second turn waits
        prod, buffers = producer(server, FakeController(active(calc_run(dataset, n_samples=2))))
        prod.start()
        await wait_until_async(
            lambda: sum(TOKENIZER.decode(r["input_ids"]).count("</result>") for r in server.requests) == 2, 10,
            "both samples in their second turn")
        server.aborted_prefixes.append("calc::")  # what the controller posts when the adapter retires
        await wait_until_async(lambda: prod.count("aborted") >= 1, 10, "the aborted group")
        n_requests = len(server.requests)
        await prod.stop()
    assert prod.count("produced") == 0 and len(buffers.get("calc")) == 0
    # later groups' first turns are aborted too (the prefix stays aborted) and none of
    # them goes on to the tool and a second turn
    second_turns = [r for r in server.requests if "</result>" in TOKENIZER.decode(r["input_ids"])]
    assert len(second_turns) == 2 and n_requests >= 4


async def test_adapter_retired_between_turns_sends_no_further_turn(dataset):
    run = calc_run(dataset)
    controller = FakeController(active(run))
    async with ScriptedEngine() as server:
        server.turn_gates[0].clear()
        prod, buffers = producer(server, controller)
        prod.start()
        await wait_until_async(lambda: len(server.requests) == 1, 10, "the first turn")
        controller.current = active()  # retired (and its slot maybe reused) while the first turn runs
        await wait_until_async(lambda: "calc" not in prod._snapshot.sampleable, 10, "the producer sees it")
        server.turn_gates[0].set()
        await wait_until_async(lambda: prod.count("aborted") == 1, 10, "the aborted group")
        await prod.stop()
    assert len(server.requests) == 1 and len(buffers.get("calc")) == 0


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "my_generate.py").write_text(textwrap.dedent("""
        async def legacy(args, sample, sampling_params):
            return sample

        def not_async(input):
            return input.sample

        class Stateful:
            async def __call__(self, input):
                return input.sample
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_generate", None)


def test_generate_functions_are_checked_at_load(plugins):
    with pytest.raises(PluginError, match="expected async fn\\(input: GenerateFnInput\\)"):
        load_generate_function("my_generate.legacy")
    with pytest.raises(PluginError, match="must be an async function"):
        load_generate_function("my_generate.not_async")
    with pytest.raises(PluginError, match="cannot be imported"):
        load_generate_function("my_generate.missing")
    assert callable(load_generate_function("my_generate.Stateful"))
