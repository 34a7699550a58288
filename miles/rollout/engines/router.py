"""The sglang-router in front of the engines: launch one, or attach to a running one.

    router = await Router.launch(["http://127.0.0.1:30001", ...], log_path=work / "router.log")
    router = await Router.attach("http://10.0.0.5:30000", worker_urls)   # --sglang-router-ip/port
    await router.shutdown()

`launch` runs `python -m sglang_router.launch_router --worker-urls ... --host --port
--policy` (the `sglang-router` pip package: a Rust router that also runs on CPU).
`attach` adds the workers through the router's API (`POST /workers {"url"}`, or
`POST /add_worker?url=` on older routers). Either way it returns once the router lists
every worker (discovery as the controller does it: `/list_workers`, then `/workers`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import httpx

from miles.rollout.engines.process import (
    ServerProcess,
    ServerStartError,
    free_port,
    on_probed_ports,
)
from miles.utils.router_workers import discover_workers

logger = logging.getLogger(__name__)

ROUTER_START_TIMEOUT_S = 120.0
ROUTER = "sglang-router"


def build_router_command(worker_urls: list[str], host: str, port: int, policy: str,
                         prometheus_port: int) -> list[str]:
    # The router always serves Prometheus metrics; a fixed default port would clash
    # between two routers on one node, so each gets its own.
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--host", host, "--port", str(port), "--policy", policy, "--log-level", "warn",
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port)]


class Router:
    def __init__(self, url: str, process: ServerProcess | None):
        self.url = url
        self.process = process
        """The router process when this fleet launched it; None when attached."""
        self.added: list[str] = []
        """Workers added through the API (removed again at shutdown of an attached router)."""

    @classmethod
    async def launch(cls, worker_urls: list[str], *, log_path: Path, host: str = "127.0.0.1",
                     policy: str = "round_robin", timeout_s: float = ROUTER_START_TIMEOUT_S) -> Router:
        # The router refuses port 0 for either of its ports, so it gets two probed free, and
        # two others if a process took one of them before the router bound it.
        async def start() -> Router:
            port = free_port(host)
            command = build_router_command(worker_urls, host, port, policy, prometheus_port=free_port(host))
            process = ServerProcess.launch(command, log_path=log_path)
            router = cls(f"http://{host}:{port}", process)
            try:
                await process.wait_ready(router.url + "/health", timeout_s=timeout_s, what=ROUTER)
                await router.wait_for_workers(worker_urls, timeout_s=timeout_s)
            except BaseException:
                process.terminate()
                raise
            return router

        return await on_probed_ports(start, ROUTER)

    @classmethod
    async def attach(cls, url: str, worker_urls: list[str], *, timeout_s: float = ROUTER_START_TIMEOUT_S) -> Router:
        router = cls(url.rstrip("/"), None)
        await router.add_workers(worker_urls)
        await router.wait_for_workers(worker_urls, timeout_s=timeout_s)
        return router

    async def add_workers(self, worker_urls: list[str]) -> None:
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
            known = set(await discover_workers(self.url, client))
            for worker in worker_urls:
                if worker in known:
                    continue
                response = await client.post(self.url + "/workers", json={"url": worker})
                if response.status_code == 404:
                    response = await client.post(self.url + "/add_worker", params={"url": worker})
                if response.status_code >= 400:
                    raise RuntimeError(f"router {self.url} refused worker {worker}: HTTP {response.status_code} "
                                       f"{response.text[:300]}")
                self.added.append(worker)

    async def remove_workers(self, worker_urls: list[str]) -> None:
        """`DELETE /workers/{id}` (or `POST /remove_worker?url=` on older routers) per URL."""
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
            listing = await client.get(self.url + "/workers")
            ids = {}
            if listing.status_code == 200:
                ids = {w.get("url"): w.get("id") for w in listing.json().get("workers", []) if isinstance(w, dict)}
            for worker in worker_urls:
                if ids.get(worker):
                    response = await client.delete(f"{self.url}/workers/{ids[worker]}")
                else:
                    response = await client.post(self.url + "/remove_worker", params={"url": worker})
                if response.status_code >= 400:
                    logger.warning("Router %s did not remove worker %s: HTTP %d", self.url, worker,
                                   response.status_code)
                elif worker in self.added:
                    self.added.remove(worker)

    async def workers(self) -> list[str]:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            return await discover_workers(self.url, client)

    async def wait_for_workers(self, worker_urls: list[str], *, timeout_s: float) -> None:
        """Return once the router lists every URL in `worker_urls`."""
        deadline = time.monotonic() + timeout_s
        missing = set(worker_urls)
        while time.monotonic() < deadline:
            if self.process is not None and not self.process.alive():
                raise self.process.died_error(ROUTER)
            missing = set(worker_urls) - set(await self.workers())
            if not missing:
                return
            await asyncio.sleep(0.25)
        raise ServerStartError(f"router {self.url} did not register workers {sorted(missing)} within {timeout_s:.0f} s")

    async def shutdown(self) -> None:
        """Stop the router if launched here; an attached one keeps running, minus our workers."""
        if self.process is not None:
            await asyncio.to_thread(self.process.terminate)
        elif self.added:
            added, self.added = self.added, []
            try:
                await self.remove_workers(added)
            except httpx.HTTPError as exc:
                logger.warning("Could not remove workers %s from router %s: %s", added, self.url, exc)
