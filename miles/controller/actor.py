"""The multi-LoRA controller: a named Ray actor that owns the registry and serves the API.

`MultiLoRAController` wraps a `MultiLoRABackend` (the lifecycle) and a
`MultiLoRAHTTPServer` (the control plane on `--multi-lora-api-host/port`); every method
is `async`, so actor calls and HTTP handlers share one event loop and never race. The
trainer creates it once, handing it the checks it cannot import itself, and passes the
handle to whoever needs it:

    hooks = ControllerHooks(validate_dataset=validate_dataset, validate_reward=validate_reward_spec)
    controller = create_multilora_controller(cfg, router_url=None, hooks=hooks)  # starts the server
    ray.get(controller.set_router_url.remote("http://127.0.0.1:30000"))
    snapshot = ray.get(controller.snapshot.remote())

It also runs without Ray (`python -m miles.main.control_plane`), as a plain object whose
`start()` serves on the running loop.

The registry is written through to `{--save or --run-dir}/controller/registry.sqlite`
(`miles/controller/store.py`). The actor is created with `max_restarts`: if it dies, Ray
starts it again, it reloads every adapter from that file and serves the API again on
the same port; calls in flight are retried (`max_task_retries`). A new trainer with the
same run directory finds its adapters there too.
"""

from __future__ import annotations

import inspect
import logging
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.controller.backend import BackendArgs, ControllerHooks, DatasetLimits, MultiLoRABackend
from miles.controller.http_server import HTTPServerConfig, MultiLoRAHTTPServer
from miles.controller.registry import AdapterAlreadyRegisteredError
from miles.controller.store import RegistryStore
from miles.controller.tinker.command_log import ErrorCategory
from miles.controller.tinker.gateway import GatewayConfig, TinkerGateway
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.arguments import DEFAULT_QUEUE_SIZE
from miles.utils.plugins import PluginError, load_subclass
from miles.utils.types import (
    AdapterGauges,
    AdapterState,
    AdapterStatus,
    ClientCommandBatch,
    ClientResult,
    MultiLoRASnapshot,
)
from miles.utils.types.lifecycle_ops import RequeueForNewTrainer, Transition

if TYPE_CHECKING:
    from miles.utils.arguments import MilesConfig

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "miles_multi_lora_controller"
CONTROLLER_NAMESPACE = "miles"
MAX_RESTARTS = 16
"""Times Ray restarts a controller actor that died; each restart reloads the registry file."""
MAX_TASK_RETRIES = 3
"""Times a call in flight when the actor died is sent again to the restarted actor."""
API_URL_LINE = re.compile(r"Multi-LoRA controller API at (http://\S+?:\d+)")
"""The line the driver logs once the control plane listens; with `--multi-lora-api-port 0` it is
how a launcher learns the port the OS picked."""


def registry_path_from_config(cfg: MilesConfig) -> Path | None:
    """`--multi-lora-registry-path`, else `{--save or --run-dir}/controller/registry.sqlite`;
    None ('none', or neither directory set): the registry lives in memory only."""
    if cfg.multi_lora_registry_path:
        return None if cfg.multi_lora_registry_path.lower() == "none" else Path(cfg.multi_lora_registry_path)
    root = cfg.save or cfg.run_dir
    return Path(root) / "controller" / "registry.sqlite" if root else None


@dataclass(frozen=True)
class ControllerConfig:
    n_slots: int
    defaults: AdapterDefaults
    server: HTTPServerConfig
    queue_size: int = DEFAULT_QUEUE_SIZE
    """Registrations that may wait for a slot (`--multi-lora-queue-size`; 0: refused with 409)."""
    backend_path: str | None = None
    http_server_path: str | None = None
    hooks: ControllerHooks = field(default_factory=ControllerHooks)
    """Dataset and reward checks and the prefix abort, handed in at launch."""
    registry_path: Path | None = None
    """SQLite file the registry is written through to; None: memory only."""
    dataset_limits: DatasetLimits = field(default_factory=DatasetLimits)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The Tinker gateway's settings (the base model it serves, the slots' LoRA layout)."""
    flags: MilesConfig | None = None
    """The trainer's flags: the `args` of a backend subclass written in Miles' form."""

    @classmethod
    def from_config(cls, cfg: MilesConfig, hooks: ControllerHooks | None = None) -> ControllerConfig:
        if cfg.multi_lora_n_adapters <= 0:
            raise ValueError("the multi-LoRA controller needs slots: set --multi-lora-n-adapters > 0")
        return cls(
            n_slots=cfg.multi_lora_n_adapters, defaults=AdapterDefaults.from_config(cfg),
            server=HTTPServerConfig.from_config(cfg), queue_size=cfg.multi_lora_queue_size,
            backend_path=cfg.multi_lora_backend_path,
            http_server_path=cfg.multi_lora_http_server_path, hooks=hooks or ControllerHooks(),
            registry_path=registry_path_from_config(cfg),
            dataset_limits=DatasetLimits(max_bytes=cfg.multi_lora_max_dataset_bytes,
                                         timeout_s=cfg.multi_lora_dataset_timeout_s),
            gateway=GatewayConfig(base_model=cfg.hf_checkpoint, tokenizer_id=cfg.hf_checkpoint,
                                  target_modules=cfg.target_modules, lora_unembed=cfg.lora_unembed),
            flags=cfg,
        )


def _takes(cls: type, *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(cls).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def build_backend(cls: type[MultiLoRABackend], config: ControllerConfig, router_url: str | None,
                  store: RegistryStore | None) -> MultiLoRABackend:
    """`cls` built as this controller builds backends, or in Miles' form `cls(args, router_url)`;
    a constructor that takes neither is refused with both forms named."""
    ours = (config.n_slots, config.defaults, router_url, config.hooks)
    if _takes(cls, *ours, store=store, dataset_limits=config.dataset_limits, queue_size=config.queue_size):
        return cls(*ours, store=store, dataset_limits=config.dataset_limits, queue_size=config.queue_size)
    if _takes(cls, None, router_url):
        if config.flags is None:
            raise PluginError(f"--multi-lora-backend-path {cls.__qualname__}: its __init__(args, router_url) "
                              "needs the trainer's flags, and this controller was built without them")
        return cls.from_miles_args(BackendArgs(config.flags, config.hooks, store, config.dataset_limits), router_url)
    raise PluginError(
        f"--multi-lora-backend-path {cls.__qualname__}: __init__{inspect.signature(cls)} takes neither this "
        "trainer's arguments (n_slots, defaults, router_url, hooks, *, store, dataset_limits, queue_size) nor "
        "Miles' (args, router_url) (derive from miles.ray.multi_lora.backend.MultiLoRABackend for that one); "
        "take one of them and pass it on to super().__init__")


def build_server(cls: type[MultiLoRAHTTPServer], backend: MultiLoRABackend, config: HTTPServerConfig,
                 gateway: TinkerGateway) -> MultiLoRAHTTPServer:
    """`cls(backend, config=..., gateway=...)`, or in Miles' form `cls(backend, host, api_port=...)`
    and then `configure` (so the token and the limits hold for it too)."""
    if _takes(cls, backend, config=config, gateway=gateway):
        return cls(backend, config=config, gateway=gateway)
    if _takes(cls, backend, config.host, api_port=config.port):
        server = cls(backend, config.host, api_port=config.port)
        server.configure(config, gateway)
        return server
    raise PluginError(
        f"--multi-lora-http-server-path {cls.__qualname__}: __init__{inspect.signature(cls)} takes neither "
        "(backend, *, config, gateway) nor Miles' (backend, host, api_port); take one of them and pass it on "
        "to super().__init__")


class MultiLoRAController:
    def __init__(self, config: ControllerConfig, router_url: str | None = None) -> None:
        backend_cls = load_subclass(config.backend_path, MultiLoRABackend, "--multi-lora-backend-path")
        server_cls = load_subclass(config.http_server_path, MultiLoRAHTTPServer, "--multi-lora-http-server-path")
        self.config = config
        self.store = RegistryStore(config.registry_path) if config.registry_path is not None else None
        self.backend = build_backend(backend_cls, config, router_url, self.store)
        self.gateway = TinkerGateway(self.backend, config.gateway, self.store)
        self.server = build_server(server_cls, self.backend, config.server, self.gateway)
        self._backend_open = False
        self._restart_under_ray()

    def _restart_under_ray(self) -> None:
        """A controller actor that Ray restarted after a crash serves its API again by itself,
        on the port it had (kept in the store), and learns the router from it too."""
        import sys

        if "ray" not in sys.modules:
            return
        import ray

        if not ray.is_initialized():
            return
        context = ray.get_runtime_context()
        if context.get_actor_id() is None or not context.was_current_actor_reconstructed:
            return
        port = self.store.get_meta("http_port") if self.store is not None else None
        router_url = self.store.get_meta("router_url") if self.store is not None else None
        if router_url is not None and self.backend.router_url is None:
            self.backend.router_url = router_url
        logger.warning("Controller actor restarted; serving the control plane again on port %s", port)
        # Queued behind __init__; runs on the actor's event loop.
        context.current_actor.start.remote(port=port)

    # ---- serving -------------------------------------------------------------------

    async def start(self, port: int | None = None) -> int:
        """Start the HTTP control plane (on `port` instead of the configured one if given);
        returns the bound port. A second call returns the port already bound."""
        if self.server.serving:
            assert self.server.port is not None
            return self.server.port
        if not self._backend_open:
            await self.backend.init()
            self._backend_open = True
        bound = await self.server.start(port=port)
        if self.store is not None:
            self.store.set_meta("http_port", bound)
        return bound

    async def stop(self) -> None:
        await self.server.stop()
        await self.gateway.aclose()  # the Tinker samples still running, and the sampler's connections
        if self._backend_open:
            self._backend_open = False
            await self.backend.close()

    async def http_host(self) -> str:
        """Address clients should use (the node IP when bound to every interface)."""
        host = self.config.server.host
        if host not in ("0.0.0.0", "::", ""):
            return host
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
        return socket.gethostbyname(socket.gethostname())  # standalone, without Ray

    async def api_port(self) -> int | None:
        return self.server.port

    async def set_router_url(self, url: str | None) -> None:
        """The router starts after the controller; aborts go through it from now on."""
        self.backend.router_url = url
        if self.store is not None:
            self.store.set_meta("router_url", url)

    # ---- lifecycle ---------------------------------------------------------------------

    async def register_adapter(self, name: str, config: dict[str, Any] | None = None,
                               yaml_path: str | None = None, exist_ok: bool = True) -> int | None:
        """Register; returns the slot, or None when every slot is held and it was QUEUED. With
        `exist_ok` (the default: a trainer restarted over its saved registry registers its
        start-up adapters again), a name that is already PENDING, ACTIVE or QUEUED returns the
        slot it holds (None if queued) and keeps its recorded config; `exist_ok=False` raises
        `AdapterAlreadyRegisteredError` as the HTTP API does."""
        try:
            return await self.backend.register(name, config=config, yaml_path=yaml_path)
        except AdapterAlreadyRegisteredError:
            if not exist_ok:
                raise
            status = self.backend.adapter_status(name)
            where = f"slot {status.slot}" if status.slot is not None else f"queue position {status.queue_position}"
            logger.warning("Adapter '%s' is already registered (%s); it keeps its recorded config", name, where)
            return status.slot

    async def deregister_adapter(self, name: str) -> AdapterState | None:
        """PENDING/ACTIVE -> RETIRING; a QUEUED one is removed from the queue and forgotten (None)."""
        return self.backend.deregister(name)

    async def apply(self, op: Transition[Any]) -> MultiLoRASnapshot:
        """Apply one lifecycle transition (`miles.utils.types.lifecycle_ops`: retire, free, push,
        batch, resume, ...); answers the registry's snapshot after it."""
        await self.backend.apply(op)
        return self.backend.snapshot()

    async def requeue_for_new_trainer(self) -> list[str]:
        """A new trainer over a restored registry: live adapters wait for its first push, those
        the previous trainer was retiring are completed, and client commands it was running
        fail (their gradients died with it)."""
        failed = self.gateway.fail_running("the trainer restarted while this command ran; "
                                           "the model resumes from its last saved state, send it again")
        if failed:
            logger.warning("%d client commands were running in the previous trainer; failed", len(failed))
        return self.backend.apply_now(RequeueForNewTrainer())

    async def adapter_step(self, name: str) -> int:
        return self.backend.adapter_step(name)

    async def adapter_status(self, name: str) -> AdapterStatus:
        return self.backend.adapter_status(name)

    async def snapshot(self) -> MultiLoRASnapshot:
        return self.backend.snapshot()

    async def wait_for_registration(self, after: int, timeout_s: float) -> int:
        return await self.backend.wait_for_registration(after, timeout_s)

    async def observe_rollout(self, gauges: dict[str, AdapterGauges]) -> None:
        self.backend.observe_rollout(gauges)

    # ---- the driver's side of client-driven models (the Tinker command log, DESIGN §11) ----------

    async def take_client_commands(self, loaded: list[str] | None = None) -> ClientCommandBatch:
        """Each live client-driven model's runnable commands, in seq_id order up to its next
        barrier (optim_step, save, load), now RUNNING; empty when there are none. `loaded`:
        only those models (the trainer's: a model created since its last reconcile waits)."""
        return self.gateway.take_commands(loaded)

    async def wait_for_client_commands(self, timeout_s: float, loaded: list[str] | None = None) -> bool:
        """Until a client command of `loaded` (None: any model) is runnable, or `timeout_s`;
        whether one is. A driver with no sampleable RL adapter waits here instead of on a
        generate phase."""
        return await self.gateway.wait_for_commands(timeout_s, loaded)

    async def complete_client_command(self, future_id: str, result: ClientResult) -> None:
        """A command from `take_client_commands` finished; its client's future resolves to `result`.

        Completing an `optim_step` also steps the model in the registry (there is no separate
        step call), and a completed `save_state` / `load_state` becomes its resume point
        (`ClientAdapterRun.resume_from`)."""
        self.gateway.complete(future_id, result)

    async def idle_client_models(self, idle_s: float) -> list[str]:
        """The ACTIVE client-driven models with no command in flight, idle for `idle_s` or more
        (`--multi-lora-idle-evict-s`): the trainer may page them out of their slots."""
        return self.gateway.idle_models(idle_s)

    async def page_out_client(self, name: str, directory: str) -> bool:
        """The trainer wrote the model's whole state to `directory` and emptied its slot: PAGED,
        the slot free. False (nothing changes) if a command of it came in meanwhile: the trainer
        loads it back from `directory`."""
        return self.gateway.page_out(name, directory)

    async def fail_client_command(self, future_id: str, error: str, user_error: bool = False) -> None:
        """A command failed; its client's `.result()` raises with `error` (`user_error`: the
        client's input was at fault, e.g. a token out of the vocabulary)."""
        self.gateway.fail(future_id, error, ErrorCategory.USER if user_error else ErrorCategory.SERVER)


_cached_handle: Any = None


def create_multilora_controller(config: MilesConfig, router_url: str | None = None, *,
                                hooks: ControllerHooks | None = None) -> Any:
    """Create the named controller actor on this (the head) node, start its server, return it.

    `hooks` carries the dataset and reward checks (see `ControllerHooks`). A controller
    left over from an earlier run in the same Ray session is replaced.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    global _cached_handle
    controller_config = ControllerConfig.from_config(config, hooks)
    try:
        stale = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        stale = None
    if stale is not None:
        logger.warning("Replacing a running %s actor left over from an earlier run", CONTROLLER_NAME)
        ray.kill(stale, no_restart=True)
    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    handle: Any = ray.remote(MultiLoRAController).options(
        name=CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE, num_cpus=0, scheduling_strategy=node,
        max_restarts=MAX_RESTARTS, max_task_retries=MAX_TASK_RETRIES,
    ).remote(controller_config, router_url)
    port = ray.get(handle.start.remote())
    host = ray.get(handle.http_host.remote())
    logger.info("Multi-LoRA controller API at http://%s:%d (OpenAPI at /docs, dashboard at /ui)", host, port)
    _cached_handle = handle
    return handle


def get_multi_lora_controller() -> Any:
    """The controller actor's handle (looked up by name once per process)."""
    import ray

    global _cached_handle
    if _cached_handle is None:
        _cached_handle = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    return _cached_handle


def destroy_multi_lora_controller() -> None:
    """Stop the server and kill the actor (end of a run or of a test)."""
    import ray

    global _cached_handle
    try:
        handle = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        _cached_handle = None
        return
    ray.get(handle.stop.remote())
    ray.kill(handle, no_restart=True)
    _cached_handle = None
    _wait_until_name_is_free(ray)


def _wait_until_name_is_free(ray: Any, timeout_s: float = 30.0) -> None:
    """ray.kill returns before the GCS drops the actor's name; a controller created
    right after would collide with the dying one, so wait for the name to go."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    logger.warning("The controller name %r is still registered %.0f s after the kill", CONTROLLER_NAME, timeout_s)
