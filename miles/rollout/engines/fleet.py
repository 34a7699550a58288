"""The inference engines and the router in front of them, started and stopped as one.

    fleet = await EngineFleet.start(EngineFleetConfig.from_config(cfg))
    fleet.router_url                      # where generation requests go
    await fleet.push_lora(push)           # a LoraPush: one object-store ref, every engine loads it
    await fleet.shutdown()

Engines start in parallel (one `EngineActor` each); then the fleet launches
`sglang_router.launch_router` over their URLs, or attaches to the router given by
`--sglang-router-ip/--sglang-router-port` and adds the engines to it. Used inside the
rollout manager actor and by tests; plain Python, no Ray actor of its own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import ray

from miles.rollout.engines.engine_actor import EngineActor
from miles.rollout.engines.router import Router
from miles.rollout.engines.server_command import EngineServerConfig
from miles.utils.arguments import MilesConfig
from miles.utils.types import LoraPush, engine_lora_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineFleetConfig:
    server: EngineServerConfig
    num_engines: int
    work_dir: str
    """Per-engine logs and pushed adapters go under `{work_dir}/engine_{i}` on each engine's node."""
    router_ip: str | None = None
    router_port: int | None = None
    router_policy: str = "round_robin"
    start_timeout_s: float = 300.0
    engine_host: str = "127.0.0.1"
    """Address engines bind; loopback keeps them private to a single-node run."""

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> EngineFleetConfig:
        server = EngineServerConfig.from_config(cfg)
        # SGLang engines keep a prefix cache worth routing for; the builtin engine has none.
        policy = "cache_aware" if server.kind == "sglang" else "round_robin"
        return cls(server=server, num_engines=cfg.rollout_num_engines,
                   work_dir=str((cfg.resolved_run_dir / "engines").resolve()), router_ip=cfg.sglang_router_ip,
                   router_port=cfg.sglang_router_port, router_policy=policy)


class EngineFleet:
    def __init__(self, cfg: EngineFleetConfig, engines: list[ray.actor.ActorHandle], urls: list[str], router: Router):
        self.cfg = cfg
        self.engines = engines
        self.urls = urls
        self.router = router
        self._closed = False

    @property
    def router_url(self) -> str:
        return self.router.url

    @staticmethod
    def lora_name(slot: int) -> str:
        return engine_lora_name(slot)

    @classmethod
    async def start(cls, cfg: EngineFleetConfig) -> EngineFleet:
        gpus = cfg.server.tp_size if cfg.server.device == "cuda" else 0
        engines = [
            EngineActor.options(num_gpus=gpus).remote(cfg.server, str(Path(cfg.work_dir) / f"engine_{i}"),
                                                      start_timeout_s=cfg.start_timeout_s, host=cfg.engine_host)
            for i in range(cfg.num_engines)
        ]
        try:
            urls = list(await asyncio.gather(*[e.start.remote() for e in engines]))
            router = await cls._router(cfg, urls)
        except BaseException:
            await asyncio.gather(*[e.shutdown.remote() for e in engines], return_exceptions=True)
            raise
        logger.info("Engines %s behind router %s", urls, router.url)
        return cls(cfg, engines, urls, router)

    @staticmethod
    async def _router(cfg: EngineFleetConfig, urls: list[str]) -> Router:
        if cfg.router_ip is not None:
            return await Router.attach(f"http://{cfg.router_ip}:{cfg.router_port}", urls)
        return await Router.launch(urls, log_path=Path(cfg.work_dir) / "router.log", policy=cfg.router_policy)

    async def push_lora(self, push: LoraPush) -> list[str]:
        """Load one adapter's weights into every engine; returns each engine's served name."""
        name = self.lora_name(push.slot)
        return list(await asyncio.gather(*[
            e.load_lora.remote(name, push.version, push.peft_config, push.tensors_ref) for e in self.engines
        ]))

    async def abort(self, prefix: str) -> None:
        await asyncio.gather(*[e.abort.remote(prefix) for e in self.engines])

    async def shutdown(self) -> None:
        """Stop the router (if launched here) and every engine; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        await self.router.shutdown()
        results = await asyncio.gather(*[e.shutdown.remote() for e in self.engines], return_exceptions=True)
        for engine, result in zip(self.engines, results):
            if isinstance(result, BaseException):
                logger.warning("Engine shutdown failed: %s", result)
            ray.kill(engine)
