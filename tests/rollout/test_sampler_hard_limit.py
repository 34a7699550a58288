"""The sampler against an engine whose --max-loaded-loras is a hard limit (SGLang before #11526).

That SGLang cannot run here (no GPU), so a small fake speaks its answers: a load past
the limit is HTTP 400 "Cannot load LoRA adapter X ... Maximum number of loaded LoRA
adapters is N ...", a request for an unloaded adapter is 400 "... not loaded". The sampler
makes room by unloading the snapshots it sampled least recently, never anything else.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from miles.controller.tinker.sampler import Sampler, SnapshotUnavailableError
from miles.utils.types import SamplerSnapshot, SamplingRequestParams
from tests.helpers.rollout_fakes import served_url

session_loop = pytest.mark.asyncio(loop_scope="session")


class HardLimitEngine:
    """SGLang's LoRA answers before #11526, and a one-token /generate."""

    def __init__(self, limit: int, preloaded: dict[str, str]) -> None:
        self.limit = limit
        self.loaded = dict(preloaded)
        self.unloads: list[str] = []
        self.app = FastAPI()

        @self.app.post("/load_lora_adapter")
        async def load(body: dict[str, Any]) -> JSONResponse:
            name, path = body["lora_name"], body["lora_path"]
            if name in self.loaded:
                return self._refuse(f"Failed to load LoRA adapter {name} because it is already loaded")
            if len(self.loaded) >= self.limit:
                return self._refuse(f"Cannot load LoRA adapter {name} at path {path}. Maximum number of loaded "
                                    f"LoRA adapters is {self.limit}. Please unload some LoRA adapters before loading "
                                    "new ones.")
            self.loaded[name] = path
            return JSONResponse({"success": True, "error_message": "", "loaded_adapters": self.loaded})

        @self.app.post("/unload_lora_adapter")
        async def unload(body: dict[str, Any]) -> JSONResponse:
            name = body["lora_name"]
            if self.loaded.pop(name, None) is None:
                return self._refuse(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loaded)}")
            self.unloads.append(name)
            return JSONResponse({"success": True, "error_message": "", "loaded_adapters": self.loaded})

        @self.app.post("/generate")
        async def generate(body: dict[str, Any]) -> JSONResponse:
            name = body.get("lora_path")
            if name is not None and name not in self.loaded:
                return JSONResponse(status_code=400, content={"error": {
                    "message": f"The following requested LoRA adapters are not loaded: {name}", "code": 400}})
            return JSONResponse({"text": "x", "output_ids": [7], "meta_info": {
                "id": body["rid"], "finish_reason": {"type": "length"}, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": 1, "output_token_logprobs": [[-0.5, 7, None]]}})

    def _refuse(self, message: str) -> JSONResponse:
        return JSONResponse(status_code=400, content={"success": False, "error_message": message,
                                                      "loaded_adapters": self.loaded})

    async def __aenter__(self) -> HardLimitEngine:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                     lifespan="off"))
        self._task = asyncio.create_task(self._server.serve())
        self.url = await served_url(self._server, self._task)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        await self._task


def snap(name: str) -> SamplerSnapshot:
    return SamplerSnapshot(model_id="m", name=name, directory=f"/snapshots/{name}")


@session_loop
async def test_the_sampler_unloads_its_least_recently_sampled_snapshot_to_make_room():
    slot = "__miles_slot_0"
    async with HardLimitEngine(limit=3, preloaded={slot: "/slots/0"}) as engine:
        sampler = Sampler(engine.url)
        try:
            params = SamplingRequestParams(max_tokens=1)
            for name in ("a", "b"):
                assert (await sampler.sample(snap(name), [1, 2], params)).lora_loads == 1
            await sampler.sample(snap("a"), [1, 2], params)  # "b" is now the least recently sampled
            assert (await sampler.sample(snap("c"), [1, 2], params)).lora_loads == 1
            assert engine.unloads == [snap("b").lora_name]
            assert set(engine.loaded) == {slot, snap("a").lora_name, snap("c").lora_name}
            # "b" comes back the same way, pushing out "a" (sampled before "c").
            assert (await sampler.sample(snap("b"), [1, 2], params)).sequences[0].tokens == [7]
            assert engine.unloads == [snap("b").lora_name, snap("a").lora_name]
            assert slot in engine.loaded  # the trainer's slot is never a candidate
        finally:
            await sampler.aclose()


@session_loop
async def test_with_nothing_of_its_own_to_unload_the_sampler_says_why():
    async with HardLimitEngine(limit=1, preloaded={"__miles_slot_0": "/slots/0"}) as engine:
        sampler = Sampler(engine.url)
        try:
            with pytest.raises(SnapshotUnavailableError, match="hard limit"):
                await sampler.sample(snap("a"), [1], SamplingRequestParams(max_tokens=1))
            assert engine.unloads == []
        finally:
            await sampler.aclose()
