"""The inference engines and the router in front of them, started and stopped as one.

    fleet = await EngineFleet.start(EngineFleetConfig.from_config(cfg))
    fleet.router_url                      # where generation requests go
    fleet.lora_name(slot, version)        # `lora_path` of a group stamped with (slot, version)
    await fleet.push_lora(push)           # a LoraPush: one object-store ref, every engine loads it
    # in_place by broadcast: the engines join while the sender joins at rank 0 (weight_sync)
    spec = fleet.update_group_spec(master_address, master_port)
    await asyncio.gather(fleet.join_update_group(spec), <sender joins spec at rank 0>)
    await asyncio.gather(fleet.push_lora_from_distributed(push, names, dtypes, shapes, spec.group_name),
                         <sender broadcasts the same tensors>)
    await fleet.shutdown()

Engines start in parallel (one `EngineActor` each); then the fleet launches
`sglang_router.launch_router` over their URLs, or attaches to the router given by
`--sglang-router-ip/--sglang-router-port` and adds the engines to it. Used inside the
rollout manager actor and by tests; plain Python, no Ray actor of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from miles.rollout.engines.engine_actor import EngineActor
from miles.rollout.engines.router import Router
from miles.rollout.engines.server_command import EngineServerConfig
from miles.backends.weight_sync import UpdateGroupSpec
from miles.utils import placement
from miles.utils.arguments import MilesConfig
from miles.utils.network import cluster_host
from miles.utils.types import LoraPush, LoraUpdateMode, engine_lora_name

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
    engine_host: str | None = None
    """Address engines bind; default each engine's node address when the cluster has more
    than one node, else loopback (private to a single-node run)."""

    @classmethod
    def from_config(cls, cfg: MilesConfig, *, lora_update: LoraUpdateMode = "in_place") -> EngineFleetConfig:
        server = EngineServerConfig.from_config(cfg, lora_update=lora_update)
        # SGLang engines keep a prefix cache worth routing for; the builtin engine has none.
        policy = "cache_aware" if server.kind == "sglang" else "round_robin"
        return cls(server=server, num_engines=cfg.rollout_num_engines,
                   work_dir=str((cfg.resolved_run_dir / "engines").resolve()), router_ip=cfg.sglang_router_ip,
                   router_port=cfg.sglang_router_port, router_policy=policy)


class EngineFleet:
    def __init__(self, cfg: EngineFleetConfig, engines: list[ray.actor.ActorHandle], urls: list[str], router: Router,
                 placement_group: Any = None):
        self.cfg = cfg
        self.placement_group = placement_group
        """One bundle per engine (its GPUs)."""
        self.engines = engines
        self.urls = urls
        self.router = router
        self._closed = False

    @property
    def router_url(self) -> str:
        return self.router.url

    @property
    def lora_update(self) -> LoraUpdateMode:
        return self.cfg.server.lora_update

    def lora_name(self, slot: int, version: int) -> str:
        """The engine-side name for a group stamped with (slot, version)."""
        return engine_lora_name(slot, version, self.lora_update)

    @classmethod
    async def start(cls, cfg: EngineFleetConfig) -> EngineFleet:
        gpus = cfg.server.tp_size if cfg.server.device == "cuda" else 0
        pg = await placement.one_bundle_each(cfg.num_engines, cpus=0.0, gpus=gpus)
        engines = [
            EngineActor.options(num_gpus=gpus, scheduling_strategy=placement.bundle_strategy(pg, i)).remote(
                cfg.server, str(Path(cfg.work_dir) / f"engine_{i}"), start_timeout_s=cfg.start_timeout_s,
                host=cfg.engine_host)
            for i in range(cfg.num_engines)
        ]
        try:
            urls = list(await asyncio.gather(*[e.start.remote() for e in engines]))
            router = await cls._router(cfg, urls)
            await asyncio.gather(*[e.set_router.remote(router.url) for e in engines])
        except BaseException:
            await asyncio.gather(*[e.shutdown.remote() for e in engines], return_exceptions=True)
            placement.remove(pg)
            raise
        logger.info("Engines %s behind router %s", urls, router.url)
        return cls(cfg, engines, urls, router, pg)

    @staticmethod
    async def _router(cfg: EngineFleetConfig, urls: list[str]) -> Router:
        if cfg.router_ip is not None:
            return await Router.attach(f"http://{cfg.router_ip}:{cfg.router_port}", urls)
        return await Router.launch(urls, log_path=Path(cfg.work_dir) / "router.log", policy=cfg.router_policy,
                                   host=cluster_host())

    async def push_lora(self, push: LoraPush) -> list[str]:
        """Load one adapter's weights into every engine (through the object store); returns the served names."""
        return list(await asyncio.gather(*[
            e.push_lora.remote(push.slot, push.version, push.peft_config, push.tensors_ref) for e in self.engines
        ]))

    def update_group_spec(self, master_address: str, master_port: int, *, group_name: str = "miles_lora_update",
                          backend: str | None = None, timeout_s: float | None = None) -> UpdateGroupSpec:
        """The weights-update group of the sender (rank 0) and every engine rank."""
        backend = backend or ("nccl" if self.cfg.server.device == "cuda" else "gloo")
        spec = UpdateGroupSpec(master_address=master_address, master_port=master_port,
                               world_size=1 + self.cfg.num_engines * self._ranks_per_engine(),
                               group_name=group_name, backend=backend)
        return spec if timeout_s is None else dataclasses.replace(spec, timeout_s=timeout_s)

    def update_group_layout(self) -> tuple[str, int]:
        """(process-group backend, ranks per engine) of a weights-update group with these engines."""
        return ("nccl" if self.cfg.server.device == "cuda" else "gloo"), self._ranks_per_engine()

    async def join_update_group(self, spec: UpdateGroupSpec) -> None:
        """Every engine joins `spec` (returns once the sender joined too)."""
        await asyncio.gather(*[
            e.init_weights_update_group.remote(**spec.init_request(rank_offset=1 + i * self._ranks_per_engine()))
            for i, e in enumerate(self.engines)
        ])

    async def leave_update_group(self, group_name: str) -> None:
        await asyncio.gather(*[e.destroy_weights_update_group.remote(group_name) for e in self.engines])

    async def update_group_joined(self) -> bool:
        """False when an engine is out of the group (never joined, or restarted since): rejoin all before pushing."""
        return all(await asyncio.gather(*[e.update_group_joined.remote() for e in self.engines]))

    async def push_lora_from_distributed(self, push: LoraPush, names: list[str], dtypes: list[str],
                                         shapes: list[list[int]], group_name: str) -> list[str]:
        """Every engine receives one adapter by broadcast (the sender broadcasts concurrently).

        `push.tensors_ref` is handed over unfetched, for reloading a restarted engine.
        """
        return list(await asyncio.gather(*[
            e.push_lora_from_distributed.remote(push.slot, push.version, push.peft_config, names, dtypes, shapes,
                                                group_name, weights_ref=[push.tensors_ref])
            for e in self.engines
        ]))

    async def unload_slot(self, slot: int) -> None:
        await asyncio.gather(*[e.unload_slot.remote(slot) for e in self.engines])

    async def engine_urls(self) -> list[str]:
        """Current server URLs (a restarted engine listens on a new port)."""
        return list(await asyncio.gather(*[e.url.remote() for e in self.engines]))

    def _ranks_per_engine(self) -> int:
        return self.cfg.server.tp_size if self.cfg.server.device == "cuda" else 1

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
        placement.remove(self.placement_group)
