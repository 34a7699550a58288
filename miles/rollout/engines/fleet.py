"""The inference engines and the router in front of them, started and stopped as one.

    fleet = await EngineFleet.start(EngineFleetConfig.from_config(cfg))
    fleet.router_url                      # where generation requests go
    fleet.lora_name(slot, version)        # `lora_path` of a group stamped with (slot, version)
    fleet.record_push(SlotPush(...))      # what a restarted engine loads (the pusher records each push)
    await fleet.shutdown()

Engines start in parallel (one `EngineActor` each) while the fleet launches
`sglang_router.launch_router`, or attaches to the router given by
`--sglang-router-ip/--sglang-router-port`; the engines are added to it once they serve. Used inside the
rollout manager actor and by tests; plain Python, no Ray actor of its own. Pushes go to the
engine actors from `miles.main.engine_push.EnginePusher`, the one push path; the fleet keeps
what each push recorded.

Ray restarts a dead engine actor (`max_restarts=ENGINE_MAX_RESTARTS`) with nothing in
memory, so the fleet keeps what it needs: the latest push of every live slot, and in
versioned mode the one before it, which engines keep loaded for groups still in flight
(`record_push`, `forget_slot`; the pusher records each push before sending it). It holds
their object-store references; their owner is the process that exported the tensors (the
driver), which outlives any engine. The watcher also checks each server's `/health`, so
`serving()` turns false as soon as no server answers (the producer then neither submits
groups nor counts their failures). A watcher asks every engine for its identity each
`watch_interval_s`. An engine that does not answer (dead or restarting) is taken out of the
router at once; one that answers with a new incarnation is started again, loads every
live slot at its recorded version (again, until no push was recorded meanwhile), and only
then goes back behind the router. Its weights-update group (in_place) is rebuilt by the
pusher before its next push, as after a server restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.exceptions import RayActorError

from miles.rollout.engines.engine_actor import EngineActor, takes_bucketed_pushes
from miles.rollout.engines.router import Router
from miles.rollout.engines.server_command import EngineServerConfig
from miles.utils import placement
from miles.utils.arguments import MilesConfig
from miles.utils.http_client import LoopClient
from miles.utils.network import cluster_host
from miles.utils.types import LoraUpdateMode, SlotPush, UpdateGroupLayout, engine_lora_name

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0
ENGINE_MAX_RESTARTS = 16
"""Ray restarts of one engine actor before it stays dead (its server restarts are not counted)."""


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
    watch_interval_s: float = 0.5
    """How often every engine actor is asked whether it is alive and still the same one."""

    @classmethod
    def from_config(cls, cfg: MilesConfig, *, lora_update: LoraUpdateMode = "in_place") -> EngineFleetConfig:
        server = EngineServerConfig.from_config(cfg, lora_update=lora_update)
        # SGLang engines keep a prefix cache worth routing for; the builtin engine has none.
        policy = "cache_aware" if server.kind == "sglang" else "round_robin"
        assert cfg.rollout_num_engines is not None, "MilesConfig resolves it"
        return cls(server=server, num_engines=cfg.rollout_num_engines,
                   work_dir=str((cfg.resolved_run_dir / "engines").resolve()), router_ip=cfg.sglang_router_ip,
                   router_port=cfg.sglang_router_port, router_policy=policy)


class EngineFleet:
    def __init__(self, cfg: EngineFleetConfig, engines: list[ray.actor.ActorHandle], urls: list[str], router: Router,
                 placement_group: Any = None, incarnations: list[str] | None = None):
        self.cfg = cfg
        self.placement_group = placement_group
        """One bundle per engine (its GPUs)."""
        self.engines = engines
        self.urls = urls
        """Each engine's server URL as last seen (a dead engine's is taken out of the router)."""
        self.router = router
        self.actor_restarts = 0
        """Engine actors restarted by Ray and put back behind the router."""
        self._incarnations = list(incarnations or [])
        self._live: dict[int, SlotPush] = {}
        """Slot -> its latest push: what a restarted engine loads before it serves."""
        self._previous: dict[int, SlotPush] = {}
        """Versioned mode: slot -> the push before the latest (engines keep it for groups in flight)."""
        self._revision = 0
        """Bumped by every change of `_live` (a restore repeats its load until it is stable)."""
        self._out: set[int] = set()
        """Engines taken out of the router and not restored yet."""
        self._serving = [True] * len(engines)
        """Whether each engine's server took requests when last asked."""
        self._restores: dict[int, asyncio.Task] = {}
        self._retry_at: dict[int, tuple[float, int]] = {}
        """Engine -> (time of the next restore attempt, failed attempts in a row)."""
        self._watcher: asyncio.Task | None = None
        self._closed = False
        self._http = LoopClient(timeout=HEALTH_TIMEOUT_S)
        """The health checks' client (one for every round and engine)."""

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
        engines: list[Any] = [  # Ray handles of `EngineServer`
            EngineActor.options(num_gpus=gpus, scheduling_strategy=placement.bundle_strategy(pg, i),
                                max_restarts=ENGINE_MAX_RESTARTS).remote(
                cfg.server, str(Path(cfg.work_dir) / f"engine_{i}"), start_timeout_s=cfg.start_timeout_s,
                host=cfg.engine_host)
            for i in range(cfg.num_engines)
        ]
        # The router starts (or is attached to) while the engines start; they join it once they serve.
        router_start = asyncio.ensure_future(cls._router(cfg))
        try:
            urls = list(await asyncio.gather(*[e.start.remote() for e in engines]))
            router = await router_start
            await router.add_workers(urls)
            await router.wait_for_workers(urls, timeout_s=cfg.start_timeout_s)
            await asyncio.gather(*[e.set_router.remote(router.url) for e in engines])
        except BaseException:
            router_start.cancel()
            started = (await asyncio.gather(router_start, return_exceptions=True))[0]
            if isinstance(started, Router):
                await started.shutdown()
            await asyncio.gather(*[e.shutdown.remote() for e in engines], return_exceptions=True)
            placement.remove(pg)
            raise
        logger.info("Engines %s behind router %s", urls, router.url)
        incarnations = [who.incarnation for who in await asyncio.gather(*[e.identity.remote() for e in engines])]
        fleet = cls(cfg, engines, urls, router, pg, incarnations)
        fleet._watcher = asyncio.create_task(fleet._watch(), name="engine-fleet-watcher")
        return fleet

    @staticmethod
    async def _router(cfg: EngineFleetConfig) -> Router:
        """The router, with no worker of this fleet yet."""
        if cfg.router_ip is not None:
            return await Router.attach(f"http://{cfg.router_ip}:{cfg.router_port}", [])
        return await Router.launch([], log_path=Path(cfg.work_dir) / "router.log", policy=cfg.router_policy,
                                   host=cluster_host())

    # ---- live slots (what a restarted engine loads) -------------------------------------

    def record_push(self, *pushes: SlotPush) -> None:
        """Remember the latest push of each slot; call it before the pushes are sent to the engines."""
        for push in pushes:
            latest = self._live.get(push.slot)
            if self.lora_update == "versioned" and latest is not None and latest.version != push.version:
                self._previous[push.slot] = latest
            self._live[push.slot] = push
        self._revision += 1

    def forget_slot(self, slot: int) -> None:
        """The slot's adapter left: a restarted engine no longer loads it."""
        self._live.pop(slot, None)
        self._previous.pop(slot, None)
        self._revision += 1

    def serving(self) -> bool:
        """Whether any engine takes requests (as of the watcher's last round): while none does,
        failed groups say nothing about the groups themselves."""
        return any(ok and i not in self._out for i, ok in enumerate(self._serving))

    def live_slots(self) -> dict[int, int]:
        """Slot -> recorded version."""
        return {slot: push.version for slot, push in self._live.items()}

    # ---- the engines' side of pushes ----------------------------------------------------

    def update_group_layout(self) -> UpdateGroupLayout:
        """The layout of a weights-update group with these engines."""
        return UpdateGroupLayout(backend="nccl" if self.cfg.server.device == "cuda" else "gloo",
                                 ranks_per_engine=self._ranks_per_engine(),
                                 bucketed=takes_bucketed_pushes(self.cfg.server.kind))

    async def engine_urls(self) -> list[str]:
        """Current server URLs (a restarted engine listens on a new port)."""
        return list(await asyncio.gather(*[e.url.remote() for e in self.engines]))

    def _ranks_per_engine(self) -> int:
        return self.cfg.server.tp_size if self.cfg.server.device == "cuda" else 1

    async def abort(self, prefix: str) -> None:
        await asyncio.gather(*[e.abort.remote(prefix) for e in self.engines])

    # ---- engine actors that Ray restarted -----------------------------------------------

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.cfg.watch_interval_s)
            try:
                await self._watch_round()
            except Exception:  # keep watching: the next round asks again
                logger.exception("Checking the engine actors failed")

    async def _watch_round(self) -> None:
        idle = [i for i in range(len(self.engines)) if i not in self._restores]
        # A dead actor's server dies with it: its health route fails at once, while Ray may take
        # a few seconds to report the actor; until then no group failure there counts.
        checked = {i: self.urls[i] for i in idle}
        healthy = dict(zip(idle, await asyncio.gather(*[self._healthy(checked[i]) for i in idle])))
        for i in idle:
            self._serving[i] = self._serving[i] and healthy[i]
        answers = await asyncio.gather(*[
            asyncio.wait_for(self.engines[i].identity.remote(), timeout=max(5.0, self.cfg.watch_interval_s))
            for i in idle], return_exceptions=True)
        for i, answer in zip(idle, answers):
            if isinstance(answer, RayActorError):
                await self._take_out(i, answer)
            elif isinstance(answer, BaseException):
                if not isinstance(answer, asyncio.TimeoutError):  # a busy actor answers next round
                    logger.warning("Engine %d did not say who it is: %r", i, answer)
            elif answer.incarnation == self._incarnations[i]:
                self.urls[i] = answer.url or self.urls[i]  # it may have restarted its server itself
                self._serving[i] = answer.serving and (healthy[i] or self.urls[i] != checked[i])
            elif time.monotonic() >= self._retry_at.get(i, (0.0, 0))[0]:
                self._restores[i] = asyncio.create_task(self._restore(i, answer.incarnation),
                                                        name=f"engine-{i}-restore")

    async def _healthy(self, url: str) -> bool:
        try:
            return (await self._http.get().get(url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _take_out(self, i: int, cause: BaseException) -> None:
        if i in self._out:
            return
        self._out.add(i)
        self._serving[i] = False
        logger.warning("Engine %d is unreachable (%s); taking %s out of the router until Ray restarts it", i,
                       type(cause).__name__, self.urls[i])
        try:
            await self.router.remove_workers([self.urls[i]])
        except httpx.HTTPError as exc:  # requests routed there fail and their groups are regenerated
            logger.warning("Router %s did not take out %s: %r", self.router.url, self.urls[i], exc)

    async def _restore(self, i: int, incarnation: str) -> None:
        """Start the server of a restarted engine actor, load every live slot, then route to it."""
        engine = self.engines[i]
        try:
            await self._take_out(i, RuntimeError("restarted by Ray"))
            url = await engine.start.remote()
            while True:  # a push recorded while loading may have missed this engine: load again
                revision = self._revision
                served = await engine.sync_slots.remote([*self._previous.values(), *self._live.values()])
                if revision == self._revision:
                    break
            await engine.set_router.remote(self.router.url)
            await self.router.add_workers([url])
            await self.router.wait_for_workers([url], timeout_s=self.cfg.start_timeout_s)
        except Exception as exc:  # the watcher retries (the incarnation still differs), with a back-off
            failures = self._retry_at.get(i, (0.0, 0))[1] + 1
            self._retry_at[i] = (time.monotonic() + min(60.0, 2.0 ** failures), failures)
            logger.error("Restoring engine %d after a Ray restart failed (%d in a row): %r", i, failures, exc)
            return
        finally:
            self._restores.pop(i, None)
        self._retry_at.pop(i, None)
        self.urls[i], self._incarnations[i] = url, incarnation
        self._out.discard(i)
        self._serving[i] = True
        self.actor_restarts += 1
        logger.warning("Engine %d was restarted by Ray; its server is back at %s behind router %s with slots %s", i,
                       url, self.router.url, served)

    async def shutdown(self) -> None:
        """Stop the router (if launched here) and every engine; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in [self._watcher, *self._restores.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()
        await self.router.shutdown()
        results = await asyncio.gather(*[e.shutdown.remote() for e in self.engines], return_exceptions=True)
        for engine, result in zip(self.engines, results):
            if isinstance(result, BaseException):
                logger.warning("Engine shutdown failed: %s", result)
            ray.kill(engine)
        placement.remove(self.placement_group)
