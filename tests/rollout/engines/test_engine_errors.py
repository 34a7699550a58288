"""An engine that fails a request itself says so (HTTP 500 with the error), and serves on.

Before, a decode step that raised finished its requests as aborted: the producer took them
for a retired adapter's groups and regenerated them forever, so a broken engine (seen on a
GPU machine whose transformers named the KV cache differently) stalled training without one
error line in the trainer's log.
"""

from __future__ import annotations

import httpx
import pytest

from miles.rollout.engines.builtin_engine import BuiltinEngine, EngineOptions
from miles.rollout.engines.builtin_server import create_app

session_loop = pytest.mark.asyncio(loop_scope="session")


@session_loop
async def test_a_failing_decode_step_is_a_500_naming_the_error_and_the_engine_serves_on(tiny_model_dir,
                                                                                        monkeypatch):
    engine = BuiltinEngine(EngineOptions(model_path=str(tiny_model_dir), max_loras_per_batch=0, dtype="float32",
                                         device="cpu"))
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as client:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True}}

            def broken_prefill(jobs):
                raise RuntimeError("no attribute 'cache'")

            monkeypatch.setattr(engine.scheduler, "_prefill", broken_prefill)
            failed = await client.post("/generate", json=body)
            assert failed.status_code == 500
            assert failed.json()["detail"] == "engine error: RuntimeError: no attribute 'cache'"

            monkeypatch.undo()
            served = await client.post("/generate", json=body)
            assert served.status_code == 200
            assert len(served.json()["output_ids"]) == 4
            assert served.json()["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        engine.stop()
