"""One inference server process per Ray actor: launch, supervise, push LoRA weights into it.

    engine = EngineActor.options(num_gpus=0).remote(server_cfg, work_dir="/tmp/run/engines/0")
    url = ray.get(engine.start.remote())
    ray.get(engine.set_router.remote(router_url))          # where a restarted server goes back
    ray.get(engine.push_lora.remote(slot, version, peft_config, tensors_ref))      # either mode
    # in_place, by broadcast (the sender joins the same group at rank 0, see miles.lora.weight_sync):
    ray.get(engine.init_weights_update_group.remote(**spec.init_request(rank_offset=1)))
    ray.get(engine.push_lora_from_distributed.remote(slot, version, peft_config, names, dtypes, shapes,
                                                     group_name, weights_ref=[tensors_ref]))
    ray.get(engine.abort.remote("math::"))
    ray.get(engine.shutdown.remote())

Engine-side names come from `engine_lora_name(slot, version, mode)`:
- `in_place`: the slot keeps its name; a push replaces the weights (`upsert`).
- `versioned`: each push loads `{slot name}_v{version}` beside the previous version; the
  version before that is unloaded first (SGLang lets its in-flight requests finish), so
  at most two versions per slot are loaded.

Pushes through the object store write a PEFT directory on this node and load it; pushes
by broadcast send only metadata over HTTP. Nothing that arrives over HTTP is unpickled.

The actor remembers the latest weights of every live slot (the PEFT directory, or for a
broadcast push the object-store reference it was given). If the server process dies,
the actor restarts it, loads every live slot at its current version, and only then puts
it back behind the router. A restarted server is out of the weights-update group until
the next `init_weights_update_group` (see `update_group_joined`).

If the actor itself dies, Ray restarts it (`EngineFleet` creates it with `max_restarts`)
with nothing in memory: a fresh incarnation (`identity()`), no server, every request raising
`EngineNotReadyError`. The fleet notices the new incarnation, calls `start()` (which first
stops a server the dead actor left behind), `sync_slots` with the latest push of every live
slot that it keeps, and only then puts the server behind the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import ray
from pydantic import BaseModel

from miles.rollout.engines.process import ServerProcess, free_port, on_probed_ports
from miles.rollout.engines.router import Router
from miles.rollout.engines.server_command import (
    BUILTIN_URL_LINE,
    EngineServerConfig,
    server_command,
)
from miles.utils.http_client import LoopClient
from miles.utils.network import cluster_host
from miles.utils.types import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoraFromDistributedRequest,
    LoadLoraRequest,
    SlotPush,
    UnloadLoraRequest,
    engine_lora_name,
    engine_lora_slot,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
SUPERVISE_INTERVAL_S = 0.5


def _import_push_modules() -> None:
    """Import what pushes use (torch, through `miles.lora`): the actor itself starts without
    it, so that it launches its server sooner (`EngineServer.start` imports it meanwhile)."""
    import miles.lora  # noqa: F401


def _write_peft_dir(path: Path, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any]) -> None:
    from miles.lora import write_peft_dir

    write_peft_dir(path, tensors, peft_config)


@dataclass(frozen=True)
class EngineIdentity:
    """Who an engine actor is, as the fleet's watcher asks it each round."""

    incarnation: str
    """A new id each time the actor is created (a Ray restart gives a new one)."""
    url: str | None
    """Its server's URL; None before its server started."""
    serving: bool
    """Whether the server takes requests now."""


class EngineRequestFailed(RuntimeError):
    """The inference server answered an admin request with an error."""


class EngineConfigError(RuntimeError):
    """The server cannot work in the configured mode (the message says what to change)."""


class EngineNotReadyError(RuntimeError):
    """The engine has no server yet (not started, or Ray just restarted the actor): the fleet
    starts it and loads every live slot before it serves; a push to it can be skipped."""


@dataclass
class _SlotWeights:
    """The latest weights pushed to one slot, enough to load them again."""

    version: int
    peft_config: dict[str, Any]
    path: Path | None = None
    """PEFT directory on this node (object-store pushes, or written on recovery)."""
    weights_ref: list[ray.ObjectRef] = field(default_factory=list)
    """For broadcast pushes: the object-store copy, fetched only if the server restarts."""


class EngineServer:
    """Plain-Python body of `EngineActor` (usable without Ray)."""

    def __init__(self, cfg: EngineServerConfig, work_dir: str, *, start_timeout_s: float = START_TIMEOUT_S,
                 host: str | None = LOOPBACK, supervise_interval_s: float = SUPERVISE_INTERVAL_S):
        """`host`: the address the server binds; None: this node's address when the cluster has
        more than one node (a router on another node must reach it), else loopback."""
        self.cfg = cfg
        self.mode = cfg.lora_update
        self.host = host
        self.work_dir = Path(work_dir)
        self.start_timeout_s = start_timeout_s
        self.supervise_interval_s = supervise_interval_s
        self._process: ServerProcess | None = None
        self._url: str | None = None
        self._router_url: str | None = None
        self._slots: dict[int, _SlotWeights] = {}
        self._served: dict[int, list[int]] = {}
        """Slot -> versions loaded on the current server process, oldest first."""
        self._group_joined = False
        self._lock = asyncio.Lock()
        """Pushes, unloads and restarts never interleave."""
        self._http = LoopClient(timeout=REQUEST_TIMEOUT_S)
        self._supervisor: asyncio.Task | None = None
        self._closing = False
        self.restarts = 0
        self._incarnation = uuid.uuid4().hex
        self._recovering = False

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> str:
        if self._url is not None:
            return self._url
        self.host = self.host or cluster_host()
        await asyncio.to_thread(self._stop_leftover_server)
        # torch, which only pushes need here, loads while the server starts.
        push_modules = asyncio.ensure_future(asyncio.to_thread(_import_push_modules))
        try:
            self._url = await self._launch()
        finally:
            await push_modules
        self._supervisor = asyncio.create_task(self._supervise(), name="engine-supervisor")
        return self._url

    async def _launch(self) -> str:
        host = self.host
        assert host is not None, "start() picks the host before any launch"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.work_dir / f"{self.cfg.kind}-server.log"
        what = f"{self.cfg.kind} inference server"
        if self.cfg.kind == "builtin":  # binds port 0 and reports the port it got
            process, url = await ServerProcess.start(server_command(self.cfg, host, 0), log_path=log_path,
                                                     url_line=BUILTIN_URL_LINE, timeout_s=self.start_timeout_s,
                                                     what=what)
        else:
            # SGLang takes its port on the command line (it warms itself up through it), so it
            # gets one probed free, and another if a process took that one first.
            async def start_sglang() -> tuple[ServerProcess, str]:
                port = free_port(host)
                launched = ServerProcess.launch(server_command(self.cfg, host, port), log_path=log_path)
                try:
                    await launched.wait_ready(f"http://{host}:{port}/health", timeout_s=self.start_timeout_s,
                                              what=what)
                except BaseException:
                    launched.terminate()
                    raise
                return launched, f"http://{host}:{port}"

            process, url = await on_probed_ports(start_sglang, what)
        try:
            if self.cfg.kind == "sglang" and self.mode == "in_place":
                await self._require_distributed_route(url)
        except BaseException:
            process.terminate()
            raise
        self._process = process
        self._pid_file.write_text(json.dumps({"pid": process.pid, "command": process.command}))
        return url

    @property
    def _pid_file(self) -> Path:
        return self.work_dir / "server.pid"

    def _stop_leftover_server(self) -> None:
        """Kill the server a dead predecessor of this actor left running (it holds the device's
        memory); the pid counts only if that process still runs the command recorded with it."""
        try:
            recorded = json.loads(self._pid_file.read_text())
            cmdline = Path(f"/proc/{recorded['pid']}/cmdline").read_bytes().split(b"\0")[:-1]
        except (OSError, ValueError, KeyError):
            return
        if [part.decode(errors="replace") for part in cmdline] != recorded["command"]:
            return
        logger.warning("Stopping the %s server (pid %d) left by this engine's previous actor", self.cfg.kind,
                       recorded["pid"])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(recorded["pid"], signal.SIGKILL)

    async def _require_distributed_route(self, url: str) -> None:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            response = await client.post(url + "/load_lora_adapter_from_distributed", json={})
        if response.status_code == 404:
            raise EngineConfigError(
                "this SGLang build has no /load_lora_adapter_from_distributed, so it cannot replace a LoRA in "
                "place; start the trainer with --engine-lora-update versioned (or use an SGLang build with "
                "in-place LoRA upsert)")

    def bucketed_pushes(self) -> bool:
        return takes_bucketed_pushes(self.cfg.kind)

    def set_router(self, router_url: str) -> None:
        """The router this server sits behind; a restarted server is put back there."""
        self._router_url = router_url.rstrip("/")

    def url(self) -> str:
        if self._url is None:
            raise EngineNotReadyError(f"the engine in {self.work_dir} has no server: call start() first")
        return self._url

    def identity(self) -> EngineIdentity:
        """Who answers: the incarnation is a new id each time the actor is created (Ray
        restarts it with an empty memory and no server)."""
        serving = self._process is not None and self._process.alive() and not self._recovering
        return EngineIdentity(self._incarnation, self._url, serving)

    def actor_pid(self) -> int:
        """Process id of this actor (tests kill it to exercise a Ray restart)."""
        return os.getpid()

    def restart_count(self) -> int:
        """How many times the server was restarted after dying."""
        return self.restarts

    def pid(self) -> int | None:
        """Process id of the running server (tests kill it to exercise recovery)."""
        return self._process.pid if self._process is not None else None

    async def health(self) -> bool:
        if self._process is None or not self._process.alive():
            return False
        try:
            return (await self._http.get().get(self.url() + "/health", timeout=5.0)).status_code == 200
        except httpx.TransportError:
            return False

    async def shutdown(self) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        if self._process is not None:
            await asyncio.to_thread(self._process.terminate)
        self._url = None
        await self._http.aclose()

    # ---- recovery --------------------------------------------------------------------

    async def _supervise(self) -> None:
        failures = 0
        while not self._closing:
            # Back off after failed restarts (up to a minute) instead of relaunching in a tight loop.
            await asyncio.sleep(self.supervise_interval_s if not failures else min(60.0, 2.0 ** failures))
            if self._process is not None and not self._process.alive() and not self._closing:
                try:
                    await self.recover()
                    failures = 0
                except Exception:  # keep supervising: the next round retries the restart
                    failures += 1
                    logger.exception("Restarting the %s server in %s failed (%d in a row)", self.cfg.kind,
                                     self.work_dir, failures)

    async def recover(self) -> str:
        """Restart a dead server: reload every live slot, then put it back behind the router."""
        async with self._lock:
            if self._process is not None and self._process.alive():
                return self.url()
            old_url = self._url
            logger.warning("The %s server at %s exited with code %s; restarting it", self.cfg.kind, old_url,
                           self._process.popen.returncode if self._process else None)
            router = Router(self._router_url, None) if self._router_url else None
            self._recovering = True
            if router is not None and old_url is not None:
                await router.remove_workers([old_url])
            self._served.clear()
            self._group_joined = False
            self._url = await self._launch()
            try:
                for slot, weights in sorted(self._slots.items()):
                    path = weights.path or await self._write_from_ref(slot, weights)
                    await self._load_version(slot, weights.version, path)
                if router is not None:
                    await router.add_workers([self._url])
                    await router.wait_for_workers([self._url], timeout_s=self.start_timeout_s)
            except BaseException:
                # Not ready for requests: stop it, so the next supervision round starts over.
                if self._process is not None:  # `_launch` set it
                    await asyncio.to_thread(self._process.terminate)
                raise
            self._recovering = False
            self.restarts += 1
            logger.warning("The %s server is back at %s with slots %s", self.cfg.kind, self._url,
                           {s: w.version for s, w in self._slots.items()})
            return self._url

    async def _write_from_ref(self, slot: int, weights: _SlotWeights) -> Path:
        if not weights.weights_ref:
            raise EngineConfigError(f"slot {slot} v{weights.version} was pushed by broadcast without weights_ref; "
                                    "it cannot be reloaded after a restart")
        tensors = await weights.weights_ref[0]
        weights.path = self._slot_dir(slot, weights.version)
        await asyncio.to_thread(_write_peft_dir, weights.path, tensors, weights.peft_config)
        return weights.path

    # ---- LoRA pushes -----------------------------------------------------------------

    def served_lora_name(self, slot: int) -> str:
        """The name generation requests use for `slot` now (its latest version)."""
        if slot not in self._slots:
            raise KeyError(f"slot {slot} was never pushed to this engine")
        return engine_lora_name(slot, self._slots[slot].version, self.mode)

    def slots(self) -> dict[int, int]:
        """Slot -> version of the latest weights pushed (what a restart reloads)."""
        return {slot: weights.version for slot, weights in self._slots.items()}

    def update_group_joined(self) -> bool:
        """False until `init_weights_update_group` succeeds, and again after a restart; raises
        `EngineNotReadyError` while there is no server to join."""
        self.url()
        return self._group_joined

    async def push_lora(self, slot: int, version: int, peft_config: dict[str, Any],
                        tensors: dict[str, torch.Tensor] | ray.ObjectRef) -> str:
        """Write the adapter on this node and load it as (slot, version); return the served name."""
        self.url()
        weights: dict[str, torch.Tensor] = await tensors if isinstance(tensors, ray.ObjectRef) else tensors
        path = self._slot_dir(slot, version)

        async def load() -> str:
            # Written under the lock: a concurrent `sync_slots` prunes the slot's directories.
            await asyncio.to_thread(_write_peft_dir, path, weights, peft_config)
            return await self._load_version(slot, version, path)

        return await self._push(slot, _SlotWeights(version, peft_config, path=path), load)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> dict[str, Any]:
        """Join the sender's weights-update group (blocks until every rank joined). A server that
        died is restarted first, so the server that joins is the one that stays."""
        body = InitWeightsUpdateGroupRequest(master_address=master_address, master_port=master_port,
                                             rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                             backend=backend)
        for attempt in range(2):
            if self._process is not None and not self._process.alive():
                await self.recover()
            async with self._lock:
                try:
                    answer = await self._post("/init_weights_update_group", body)
                except httpx.TransportError:
                    if attempt or not await self._server_died():
                        raise
                    continue
                self._group_joined = True
                return answer
        raise AssertionError("unreachable")

    async def _server_died(self) -> bool:
        """After a request failed at the transport level: whether the server process is dead
        (its exit can show a moment after its socket closed)."""
        if self._process is None:
            return False
        for _ in range(40):
            if not self._process.alive():
                return True
            await asyncio.sleep(0.05)
        return False

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the group; a server that is not in it (e.g. just restarted) is fine."""
        self._group_joined = False
        with contextlib.suppress(EngineRequestFailed, EngineNotReadyError):
            await self._post("/destroy_weights_update_group", DestroyWeightsUpdateGroupRequest(group_name=group_name))

    async def push_lora_from_distributed(self, slot: int, version: int, peft_config: dict[str, Any],
                                         names: list[str], dtypes: list[str], shapes: list[list[int]],
                                         group_name: str, weights_ref: Sequence[ray.ObjectRef] = (),
                                         bucketed: bool = False) -> str:
        """In-place push: metadata over HTTP, tensors by the sender's broadcast; returns the served name.

        `weights_ref`: a one-element list holding the object-store reference of the same
        `{PEFT name: tensor}` dict (a list so Ray passes the reference, not the tensors);
        kept unfetched, so a restarted server can reload the slot. `bucketed`: the sender
        broadcasts one flat tensor per dtype (builtin engines only, `bucketed_pushes`).
        """
        if self.mode != "in_place":
            raise EngineConfigError("broadcast pushes replace a slot in place; this engine runs "
                                    "--engine-lora-update versioned: use push_lora")
        if bucketed and not self.bucketed_pushes():
            raise EngineConfigError(f"a {self.cfg.kind} server receives one tensor per name: push it unbucketed")
        name = engine_lora_name(slot, version, self.mode)
        body = LoadLoraFromDistributedRequest(lora_name=name, config_dict=peft_config, names=names, dtypes=dtypes,
                                              shapes=shapes, group_name=group_name, upsert=True)
        if bucketed:  # only set when true: SGLang's servers know no such field
            body.flattened_bucket = True

        async def load() -> str:
            await self._post("/load_lora_adapter_from_distributed", body)
            self._served[slot] = [version]
            return name

        return await self._push(slot, _SlotWeights(version, peft_config, weights_ref=list(weights_ref)), load)

    async def _push(self, slot: int, weights: _SlotWeights, load) -> str:
        """Run `load` under the lock and remember `weights`; if the server died meanwhile,
        the restart loads them instead, so the push still lands."""
        async with self._lock:
            try:
                served = await load()
            except httpx.TransportError:
                if not (weights.path or weights.weights_ref) or not await self._server_died():
                    raise
                served = None
            self._remember(slot, weights)
        if served is None:
            await self.recover()
            served = engine_lora_name(slot, weights.version, self.mode)
        return served

    async def unload_slot(self, slot: int) -> None:
        """Unload every version of `slot` and forget its weights (the adapter left)."""
        async with self._lock:
            await self._unload(slot)

    async def _unload(self, slot: int) -> None:
        for version in list(self._served.get(slot, [])):
            unload = UnloadLoraRequest(lora_name=engine_lora_name(slot, version, self.mode))
            await self._post("/unload_lora_adapter", unload)
            self._served[slot].remove(version)
        self._served.pop(slot, None)
        self._slots.pop(slot, None)
        shutil.rmtree(self.work_dir / "loras" / f"slot_{slot}", ignore_errors=True)

    async def sync_slots(self, pushes: Sequence[SlotPush]) -> dict[int, int]:
        """Serve exactly `pushes`: the latest push of every live slot and, in versioned mode,
        the one before it (a healthy engine keeps it for groups still in flight). Loads, from
        the object store, each slot whose latest version this server does not hold, and
        unloads every other slot. Returns slot -> latest version served. Used on a server the
        router does not list yet."""
        self.url()
        wanted: dict[int, list[SlotPush]] = {}
        for push in sorted(pushes, key=lambda p: (p.slot, p.version)):
            wanted.setdefault(push.slot, []).append(push)
        async with self._lock:
            for slot in sorted(set(self._slots) - set(wanted)):
                await self._unload(slot)
            for slot, chain in sorted(wanted.items()):
                have = self._slots.get(slot)
                if have is not None and have.version == chain[-1].version and slot in self._served:
                    continue
                for push in chain:
                    weights = _SlotWeights(push.version, push.peft_config, weights_ref=[push.tensors_ref])
                    path = await self._write_from_ref(slot, weights)
                    if self.mode == "in_place" and self.cfg.kind != "builtin" and self._served.get(slot):
                        # SGLang upserts only by broadcast; this server takes no requests yet: unload, then load.
                        await self._post("/unload_lora_adapter",
                                         UnloadLoraRequest(lora_name=engine_lora_name(slot, None, self.mode)))
                        self._served.pop(slot)
                    await self._load_version(slot, push.version, path)
                self._remember(slot, weights)
        return self.slots()

    async def _load_version(self, slot: int, version: int, path: Path) -> str:
        """Load (slot, version) from `path` into the running server (caller holds the lock)."""
        name = engine_lora_name(slot, version, self.mode)
        loaded = self._served.get(slot, [])
        body = LoadLoraRequest(lora_name=name, lora_path=str(path))
        if self.mode == "in_place":
            if loaded:
                if self.cfg.kind != "builtin":
                    raise EngineConfigError("SGLang replaces a loaded LoRA in place only by broadcast: "
                                            "push with push_lora_from_distributed")
                body.upsert = True
            await self._post("/load_lora_adapter", body)
            self._served[slot] = [version]
            return name
        # versioned: keep the version requests use now, drop older ones, then add the new one.
        for old in loaded[:-1]:  # `_served` follows each step, so a failure leaves it true
            unload = UnloadLoraRequest(lora_name=engine_lora_name(slot, old, self.mode))
            await self._post("/unload_lora_adapter", unload)
            self._served[slot] = [v for v in self._served[slot] if v != old]
        kept = loaded[-1:]
        if version not in kept:
            await self._post("/load_lora_adapter", body)
        self._served[slot] = sorted(set(kept) | {version})
        return name

    def _remember(self, slot: int, weights: _SlotWeights) -> None:
        self._slots[slot] = weights
        keep = {self._slot_dir(slot, v) for v in self._served.get(slot, [])} | {weights.path}
        slot_root = self.work_dir / "loras" / f"slot_{slot}"
        if slot_root.is_dir():
            for child in slot_root.iterdir():
                if child not in keep:
                    shutil.rmtree(child, ignore_errors=True)

    def _slot_dir(self, slot: int, version: int) -> Path:
        return self.work_dir / "loras" / f"slot_{slot}" / f"v{version}"

    # ---- compatibility: pushes addressed by the in-place slot name -------------------

    async def load_lora(self, lora_name: str, version: int, peft_config: dict[str, Any],
                        tensors: dict[str, torch.Tensor] | ray.ObjectRef) -> str:
        """`push_lora` for callers that address the slot by its engine-side name."""
        return await self.push_lora(engine_lora_slot(lora_name), version, peft_config, tensors)

    async def unload_lora(self, lora_name: str) -> None:
        await self.unload_slot(engine_lora_slot(lora_name))

    # ---- requests --------------------------------------------------------------------

    async def abort(self, prefix: str) -> dict[str, Any]:
        return await self._post("/abort_request", AbortRequest(rid=prefix, prefix=True))

    async def _post(self, route: str, body: BaseModel) -> dict[str, Any]:
        """POST the request model: only the fields set on it are sent (as a caller spells them
        out), so a server that does not know an optional field of ours never sees it."""
        payload = body.model_dump(mode="json", exclude_unset=True)
        response = await self._http.get().post(self.url() + route, json=payload)
        if response.status_code >= 400:
            raise EngineRequestFailed(f"{route} on {self._url} answered HTTP {response.status_code}: "
                                      f"{response.text[:500]}")
        try:
            answer = response.json()
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {"answer": answer}


def takes_bucketed_pushes(kind: str) -> bool:
    """Whether a server of this kind takes a broadcast push as one flat tensor per dtype (the
    builtin engine's `flattened_bucket`; SGLang's servers take one tensor per name)."""
    return kind == "builtin"


EngineActor = ray.remote(num_cpus=0)(EngineServer)
"""The Ray actor; on GPU give it `.options(num_gpus=tp_size)` so Ray assigns its devices."""
