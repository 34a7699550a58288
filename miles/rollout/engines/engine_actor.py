"""One inference server process per Ray actor: launch, supervise, push LoRA weights into it.

    engine = EngineActor.options(num_gpus=0).remote(server_cfg, work_dir="/tmp/run/engines/0")
    url = ray.get(engine.start.remote())
    ray.get(engine.load_lora.remote("__miles_slot_0", 3, peft_config, tensors_ref))
    ray.get(engine.abort.remote("math::"))
    ray.get(engine.shutdown.remote())

LoRA tensors come through the Ray object store (a top-level ObjectRef argument arrives
resolved; a nested one is awaited here). The actor writes them as a PEFT directory
(safetensors + JSON) on its own node and asks its server to load it: in place
(`upsert`) on the builtin engine, under a versioned name `{name}_v{version}` on SGLang,
whose loads cannot replace a name, followed by unloading the previous version. Nothing
that arrives over HTTP is unpickled.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import httpx
import ray
import torch

from miles.backends.lora import write_peft_dir
from miles.rollout.engines.process import ServerProcess, free_port
from miles.rollout.engines.server_command import EngineServerConfig, server_command

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0


class EngineRequestFailed(RuntimeError):
    """The inference server answered an admin request with an error."""


class EngineServer:
    """Plain-Python body of `EngineActor` (usable without Ray)."""

    def __init__(self, cfg: EngineServerConfig, work_dir: str, *, start_timeout_s: float = START_TIMEOUT_S,
                 host: str = LOOPBACK):
        """`host`: the address the server binds; loopback unless a router on another node must reach it."""
        self.cfg = cfg
        self.host = host
        self.work_dir = Path(work_dir)
        self.start_timeout_s = start_timeout_s
        self._process: ServerProcess | None = None
        self._url: str | None = None
        self._served: dict[str, str] = {}
        """Trainer-side LoRA name -> the name the server holds it under."""
        self._dirs: dict[str, Path] = {}

    @property
    def supports_upsert(self) -> bool:
        return self.cfg.kind == "builtin"

    async def start(self) -> str:
        if self._url is not None:
            return self._url
        self.work_dir.mkdir(parents=True, exist_ok=True)
        port = free_port(self.host)
        self._process = ServerProcess.launch(server_command(self.cfg, self.host, port),
                                             log_path=self.work_dir / f"{self.cfg.kind}-server.log")
        url = f"http://{self.host}:{port}"
        try:
            await self._process.wait_ready(url + "/health", timeout_s=self.start_timeout_s,
                                           what=f"{self.cfg.kind} inference server")
        except BaseException:
            self._process.terminate()
            raise
        self._url = url
        return url

    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the engine is not started: call start() first")
        return self._url

    async def health(self) -> bool:
        if self._process is None or not self._process.alive():
            return False
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            try:
                return (await client.get(self.url() + "/health")).status_code == 200
            except httpx.TransportError:
                return False

    def served_lora_name(self, lora_name: str) -> str:
        """The name to send as `lora_path` for `lora_name` (versioned on SGLang)."""
        if lora_name not in self._served:
            raise KeyError(f"LoRA {lora_name!r} was never pushed to this engine")
        return self._served[lora_name]

    async def load_lora(self, lora_name: str, version: int, peft_config: dict[str, Any],
                        tensors: dict[str, torch.Tensor] | ray.ObjectRef) -> str:
        """Write the adapter on this node and load it into the server; return the served name."""
        if isinstance(tensors, ray.ObjectRef):
            tensors = await tensors
        path = self.work_dir / "loras" / lora_name / f"v{version}"
        await asyncio.to_thread(write_peft_dir, path, tensors, peft_config)
        previous = self._served.get(lora_name)
        if self.supports_upsert:
            served = lora_name
            await self._post("/load_lora_adapter", {"lora_name": served, "lora_path": str(path), "upsert": True})
        else:
            served = f"{lora_name}_v{version}"
            await self._post("/load_lora_adapter", {"lora_name": served, "lora_path": str(path)})
            if previous is not None and previous != served:
                await self._post("/unload_lora_adapter", {"lora_name": previous})
        old_dir = self._dirs.get(lora_name)
        self._served[lora_name], self._dirs[lora_name] = served, path
        if old_dir is not None and old_dir != path:
            shutil.rmtree(old_dir, ignore_errors=True)
        return served

    async def unload_lora(self, lora_name: str) -> None:
        served = self._served.pop(lora_name, None)
        if served is None:
            return
        await self._post("/unload_lora_adapter", {"lora_name": served})
        old_dir = self._dirs.pop(lora_name, None)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)

    async def abort(self, prefix: str) -> dict[str, Any]:
        return await self._post("/abort_request", {"rid": prefix, "prefix": True})

    async def shutdown(self) -> None:
        if self._process is not None:
            await asyncio.to_thread(self._process.terminate)
        self._url = None

    async def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
            response = await client.post(self.url() + route, json=body)
        if response.status_code >= 400:
            raise EngineRequestFailed(f"{route} on {self._url} answered HTTP {response.status_code}: {response.text[:500]}")
        try:
            answer = response.json()
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {"answer": answer}


EngineActor = ray.remote(num_cpus=0)(EngineServer)
"""The Ray actor; on GPU give it `.options(num_gpus=tp_size)` so Ray assigns its devices."""
