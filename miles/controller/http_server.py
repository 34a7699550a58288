"""The control-plane HTTP API (DESIGN §3): FastAPI on uvicorn, in the controller's loop.

Routes: `GET /health`, `GET /adapter_runs`, `GET /adapter_runs/state?names=..`,
`GET /adapter_runs/{name}`, `POST /adapter_runs`, `DELETE /adapter_runs/{name}`,
`GET /metrics` (Prometheus); OpenAPI at `/docs` (with the adapter config's schema); the
dashboard at `/ui` and its data under `/ui/api` (`miles/dashboard/`); and, given a
`TinkerGateway`, the Tinker protocol under `/api/v1` (`miles/controller/tinker/`).
A registration that finds every slot held is QUEUED (`{"slot": null, "state": "QUEUED",
"queue_position": n}`, 1 for the head) unless `--multi-lora-queue-size` is 0 or the queue is
full. Errors map by exception type: validation → 400, unknown adapter → 404, no free slot
and no room in the queue → 409, body over `max_body_bytes` → 413, malformed body or a config
field of the wrong type → 422 (naming the field), missing or wrong bearer token → 401, every
dataset-check worker busy → 429. With a token, every route but `/health` and the dashboard's page
files needs it, `/docs`, `/redoc`, `/openapi.json` and `/ui/api` included (docs/RELIABILITY.md).

    curl -s localhost:8068/adapter_runs -H "Authorization: Bearer $MILES_API_TOKEN" \\
         -d '{"name": "math", "config": {"data": "data/math.jsonl"}}'

Handlers are `async def`, so they run on the same event loop as the controller actor's
methods; a registration reads its dataset in a worker thread, so the server keeps
answering meanwhile. YAML bodies are parsed without anchors or aliases. Subclasses may override
`create_app()` and `add_routes(app)`; select one with `--multi-lora-http-server-path`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
import yaml
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError
from starlette.routing import Match

from miles.controller.backend import ControlPlaneBusyError, MultiLoRABackend
from miles.controller.registry import AdapterNotFoundError, AdapterValidationError, NoFreeSlotError
from miles.controller.tinker.checkpoints import FILES_ROUTE
from miles.controller.tinker.gateway import TinkerGateway
from miles.controller.tinker.routes import install_tinker_routes
from miles.dashboard.data import DUMP_SUBDIR, RunFiles
from miles.dashboard.routes import install_dashboard, is_public
from miles.utils.adapter_config import AdapterRunConfig
from miles.utils.network import tcp_listener
from miles.utils.safe_yaml import load_yaml
from miles.utils.types import AdapterKind, AdapterState, RegisterAdapterRequest, RegisterAdapterResponse

if TYPE_CHECKING:
    from miles.utils.arguments import MilesConfig

logger = logging.getLogger(__name__)

UNAUTHENTICATED_PATHS = frozenset({"/health", "/api/v1/healthz"})
SIGNED_PATH_PREFIX = FILES_ROUTE + "/"
"""Checkpoint downloads: each URL carries its own signature (checked by its route), not the token."""
MAX_BODY_BYTES = 1024 * 1024
MAX_PAGE = 1000
"""The most adapters one page of `GET /adapter_runs?limit=` holds."""


class RequestBodyTooLargeError(Exception):
    """A request body over the server's `max_body_bytes` (HTTP 413)."""


class RegisterAdapterBody(RegisterAdapterRequest):
    """`POST /adapter_runs` as received: the inline config is checked field by field."""

    config: AdapterRunConfig | None = None  # type: ignore[assignment]  # the schema of the dict the base takes


@dataclass(frozen=True)
class HTTPServerConfig:
    host: str = "127.0.0.1"
    port: int = 8068
    """0 picks a free port; `start()` returns the bound one."""
    token: str | None = None
    allowed_roots: tuple[Path, ...] = ()
    """Paths in requests must resolve inside one of these (default: cwd and --save)."""
    plugin_modules: tuple[str, ...] = ("miles",)
    """Modules whose functions a registration may name as a plug-in (`--multi-lora-allowed-plugin-modules`)."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Larger request bodies are refused with 413 before they are parsed."""
    run_dir: Path | None = None
    """The run directory whose `metrics.jsonl` the dashboard (`/ui`) shows; None: no records."""
    dump_dir: Path | None = None
    """Where `--dump-details` writes the rollouts the dashboard shows; None: not dumped."""

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> HTTPServerConfig:
        roots = [Path(r) for r in cfg.multi_lora_allowed_roots]
        if not roots:
            roots = [Path.cwd()] + ([Path(cfg.save)] if cfg.save else [])
        return cls(
            host=cfg.multi_lora_api_host, port=cfg.multi_lora_api_port,
            token=cfg.multi_lora_api_token or os.environ.get("MILES_API_TOKEN") or None,
            allowed_roots=tuple(r.expanduser().resolve() for r in roots), plugin_modules=cfg.plugin_modules,
            run_dir=cfg.resolved_run_dir,
            dump_dir=Path(cfg.dump_details) / DUMP_SUBDIR if cfg.dump_details else None,
        )


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the owning process decides how to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _BackendCollector:
    """Adapter counts, registration totals and per-adapter gauges, read from the backend at
    scrape time. Per-adapter series exist only for adapters holding a slot, so the adapter
    label takes at most `n_slots` values at once; `miles_adapter_info` says each one's kind
    (one series per adapter, so the kind adds no series)."""

    def __init__(self, backend: MultiLoRABackend, pending_commands: Callable[[str], int] | None = None) -> None:
        self.backend = backend
        self.pending_commands = pending_commands
        """A client-driven model's logged commands not yet handed to the trainer (the Tinker
        command log's count); None: no Tinker gateway, no such series."""

    def collect(self) -> Iterator[Any]:
        adapters = GaugeMetricFamily("miles_controller_adapters", "Adapters per lifecycle state", labels=["state"])
        counts = self.backend.registry.state_counts()
        statuses = self.backend.registry.slot_statuses()  # a scrape costs the same with 10,000 records kept
        for state, count in counts.items():
            adapters.add_metric([state.value], count)
        yield adapters
        yield GaugeMetricFamily("miles_adapter_queue_length", "Registrations QUEUED for a slot (every slot is held)",
                                value=counts[AdapterState.QUEUED])
        yield GaugeMetricFamily("miles_adapter_client_paged", "Client-driven models PAGED out of their slots while "
                                "idle (--multi-lora-idle-evict-s); the next command pages one back in",
                                value=counts[AdapterState.PAGED])
        info = GaugeMetricFamily("miles_adapter_info", "1 per adapter holding a slot; kind: server (RL on its "
                                 "dataset) or client (a Tinker model)", labels=["adapter", "kind"])
        step = GaugeMetricFamily("miles_adapter_step", "Optimizer steps the adapter has taken", labels=["adapter"])
        version = GaugeMetricFamily("miles_adapter_version", "Slot version of the weights the engines serve",
                                    labels=["adapter"])
        reward = GaugeMetricFamily("miles_adapter_reward", "Mean raw reward of the adapter's latest optimizer step",
                                   labels=["adapter"])
        buffered = GaugeMetricFamily("miles_adapter_groups_buffered",
                                     "Prompt groups generated and waiting for a train batch", labels=["adapter"])
        loss = GaugeMetricFamily("miles_adapter_client_loss", "Client-driven adapters: loss:sum of the "
                                 "forward_backward calls of the latest optimizer step", labels=["adapter"])
        pending = GaugeMetricFamily("miles_adapter_client_commands_pending", "Client-driven adapters: commands "
                                    "logged and not yet taken by the trainer", labels=["adapter"])
        gauges = self.backend.rollout_gauges
        for status in statuses:
            if not status.state.holds_slot:
                continue
            info.add_metric([status.name, status.kind.value], 1)
            step.add_metric([status.name], status.step)
            if status.version is not None:
                version.add_metric([status.name], status.version)
            if status.kind is AdapterKind.CLIENT and self.pending_commands is not None:
                pending.add_metric([status.name], self.pending_commands(status.name))
            seen = gauges.get(status.name)
            if seen is None or seen.registration_id != status.registration_id:
                continue
            if seen.raw_reward_mean is not None:
                reward.add_metric([status.name], seen.raw_reward_mean)
            if seen.groups_buffered is not None:
                buffered.add_metric([status.name], seen.groups_buffered)
            if seen.client_loss is not None:
                loss.add_metric([status.name], seen.client_loss)
        yield from (info, step, version, reward, buffered, loss, pending)
        yield CounterMetricFamily("miles_controller_registrations", "Adapters registered",
                                  value=self.backend.registrations_total)
        yield CounterMetricFamily("miles_controller_deregistrations",
                                  "Adapters deregistered (moved to RETIRING, or out of the queue, by DELETE)",
                                  value=self.backend.deregistrations_total)


class MultiLoRAHTTPServer:
    """The control plane's HTTP API over a `MultiLoRABackend` (and the Tinker gateway's routes).

    Subclass it to add routes (override `add_routes(app)`, calling the base class's) and select
    the subclass with `--multi-lora-http-server-path`. The controller builds it as
    `cls(backend, config=..., gateway=...)`; a subclass written for Miles, whose `__init__`
    takes `(backend, host="127.0.0.1", api_port=0)` and calls `super().__init__(backend, host,
    api_port)`, is built that way and then handed the rest by `configure` (the token, the
    allowed roots and plug-in modules, the gateway) before it serves anything.
    """

    def __init__(self, backend: MultiLoRABackend, host: str = "127.0.0.1", api_port: int = 0, *,
                 config: HTTPServerConfig | None = None, gateway: TinkerGateway | None = None) -> None:
        self.backend = backend
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.configure(config or HTTPServerConfig(host=host, port=api_port, allowed_roots=(Path.cwd().resolve(),)),
                       gateway)

    def configure(self, config: HTTPServerConfig, gateway: TinkerGateway | None = None) -> None:
        """Its settings and the Tinker gateway; the app is built again from them."""
        if self.serving:
            raise RuntimeError("configure the control plane before it serves")
        self.config = config
        self.gateway = gateway
        """The Tinker protocol's gateway: its routes are served under `/api/v1` when given."""
        self.metrics = CollectorRegistry(auto_describe=True)
        self.metrics.register(_BackendCollector(self.backend,
                                                gateway.log.pending_count if gateway is not None else None))
        self.requests_total = Counter("miles_controller_requests", "HTTP requests by route and status",
                                      ["route", "method", "status"], registry=self.metrics)
        self.app = self.create_app()

    # ---- app -------------------------------------------------------------------------

    def create_app(self) -> FastAPI:
        app = FastAPI(title="Miles Multi-LoRA Controller", version="1.0")
        self._add_error_handlers(app)
        self.add_routes(app)
        if self.gateway is not None:
            install_tinker_routes(app, self.gateway)
        install_dashboard(app, RunFiles(self.config.run_dir, self.config.dump_dir), mode="live", controls=True)
        # Added last, so outermost: requests refused by the token check are counted too.
        app.middleware("http")(self._check_token)
        app.middleware("http")(self._count_request)
        return app

    def _add_error_handlers(self, app: FastAPI) -> None:
        def handler(status: int):
            async def respond(request: Request, exc: Exception) -> JSONResponse:
                return JSONResponse(status_code=status, content={"detail": str(exc)})
            return respond

        app.add_exception_handler(AdapterValidationError, handler(400))
        app.add_exception_handler(AdapterNotFoundError, handler(404))
        app.add_exception_handler(NoFreeSlotError, handler(409))
        app.add_exception_handler(RequestBodyTooLargeError, handler(413))
        app.add_exception_handler(ControlPlaneBusyError, handler(429))

    async def _check_token(self, request: Request, call_next: Any) -> Response:
        token = self.config.token
        path = request.url.path
        if token and path not in UNAUTHENTICATED_PATHS and not path.startswith(SIGNED_PATH_PREFIX) \
                and not is_public(path):
            # The Tinker SDK sends its API key as X-API-Key; either header carries the same token.
            scheme, _, value = request.headers.get("authorization", "").partition(" ")
            given = value.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                return JSONResponse(
                    status_code=401, headers={"WWW-Authenticate": "Bearer", "x-should-retry": "false"},
                    content={"detail": "Missing or invalid token: send 'Authorization: Bearer <token>' "
                                       "(or 'X-API-Key: <token>' from a Tinker client)"},
                )
        return await call_next(request)

    async def _count_request(self, request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        self.requests_total.labels(_route_label(request), request.method, str(response.status_code)).inc()
        return response

    def add_routes(self, app: FastAPI) -> None:
        backend = self.backend

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "healthy"}

        @app.get("/adapter_runs")
        async def list_adapters(limit: int | None = Query(default=None, ge=1, le=MAX_PAGE),
                                offset: int = Query(default=0, ge=0)) -> Response:
            """Every adapter (Miles' answer), or with `limit` one page of that list: live ones
            by slot, then QUEUED ones, then finished ones; `next_offset` is the next page's
            `offset`, null after the last. A page costs the same whatever the registry holds."""
            total = backend.registry.record_count
            page = backend.registry.status_texts(min(offset, total), limit)  # JSON texts, cached per status
            tail: dict[str, int | None] = {"total": total}
            if limit is not None:
                more = offset + len(page) < total
                tail.update(offset=offset, next_offset=offset + len(page) if more else None)
            return Response('{"adapters":[' + ",".join(page) + "]," + json.dumps(tail)[1:],
                            media_type="application/json")

        @app.get("/adapter_runs/state")
        async def adapter_states(names: list[str] = Query(default=[])) -> dict[str, Any]:
            states = backend.states(names)
            return {"states": {n: (s.value if s is not None else None) for n, s in states.items()}}

        @app.get("/adapter_runs/{name}")
        async def adapter_status(name: str) -> dict[str, Any]:
            return backend.adapter_status(name).model_dump(mode="json")

        @app.post("/adapter_runs", openapi_extra=_register_openapi(), response_model=RegisterAdapterResponse)
        async def register(request: Request) -> RegisterAdapterResponse:
            """Register an adapter: PENDING in a free slot, or QUEUED (`slot` null, `queue_position`
            1 for the head) when every slot is held; 409 when it cannot wait (queue full or off)."""
            body = await self._parse_register_body(request)
            slot = await backend.register(body.name, config=body.config, yaml_path=body.yaml_path,
                                          allowed_roots=list(self.config.allowed_roots),
                                          plugin_modules=self.config.plugin_modules, priority=body.priority)
            if slot is not None:
                return RegisterAdapterResponse(name=body.name, slot=slot, state=AdapterState.PENDING)
            position = backend.adapter_status(body.name).queue_position
            return RegisterAdapterResponse(name=body.name, slot=None, state=AdapterState.QUEUED,
                                           queue_position=position)

        @app.delete("/adapter_runs/{name}")
        async def deregister(name: str) -> dict[str, str | None]:
            """PENDING/ACTIVE → RETIRING (`state` after it); a QUEUED adapter is taken out of the
            queue and forgotten (`state` null), leaving every slot as it was."""
            state = backend.deregister(name)
            return {"status": "ok", "name": name, "state": None if state is None else state.value}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics), media_type=CONTENT_TYPE_LATEST)

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused as soon as it passes `max_body_bytes` (declared or streamed)."""
        limit = self.config.max_body_bytes
        too_large = RequestBodyTooLargeError(
            f"Request body larger than {limit} bytes; send a smaller config (or put large settings in a yaml_path file)"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse_register_body(self, request: Request) -> RegisterAdapterBody:
        """JSON, or YAML when the content type says so; both parsed safely, never unpickled."""
        raw = await self._read_body(request)
        content_type = request.headers.get("content-type", "")
        try:
            data = load_yaml(raw) if "yaml" in content_type else json.loads(raw or b"null")
        except (ValueError, yaml.YAMLError) as exc:
            raise RequestValidationError(
                [{"type": "value_error", "loc": ("body",), "msg": f"Malformed body: {exc}", "input": None}]
            ) from None
        try:
            return RegisterAdapterBody.model_validate(data)
        except ValidationError as exc:
            # No `input` in the answer: it would echo the (possibly large) body back.
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None

    # ---- serving -----------------------------------------------------------------------

    async def start(self, port: int | None = None) -> int:
        """Bind and serve on the running event loop (on `port` instead of the configured
        one if given); returns the bound port."""
        port = self.config.port if port is None else port
        warn_if_exposed(self.config.host, self.config.token)
        try:
            sock = tcp_listener(self.config.host, port)
        except OSError as exc:
            raise RuntimeError(
                f"Control plane cannot bind {self.config.host}:{port} ({exc}); "
                "pick another --multi-lora-api-port (0 = any free port)"
            ) from exc
        self.port = sock.getsockname()[1]
        uv_config = uvicorn.Config(self.app, log_level="warning", log_config=None, access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=2)
        self._server = _EmbeddedUvicorn(uv_config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="control-plane-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("Control plane HTTP server stopped before it started")
            await asyncio.sleep(0.01)
        logger.debug("Control plane HTTP server bound to %s", self.url)
        return self.port

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._server = self._task = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def warn_if_exposed(host: str, token: str | None) -> None:
    """Binding beyond loopback without a token lets anyone who can reach the port
    register adapters that read files on this machine: say so loudly."""
    if token or is_loopback(host):
        return
    logger.warning(
        "SECURITY WARNING: the control plane binds %s WITHOUT a token: anyone who can reach this port can "
        "register and delete adapters. Set --multi-lora-api-token (or MILES_API_TOKEN), or bind 127.0.0.1.",
        host,
    )


def _route_label(request: Request) -> str:
    """The route template (`/adapter_runs/{name}`), also for requests refused before
    routing; unknown paths share one label so scanning URLs cannot grow the metrics."""
    route = request.scope.get("route")
    if route is None:
        route = next((r for r in request.app.router.routes if r.matches(request.scope)[0] is Match.FULL), None)
    return getattr(route, "path", "unmatched")


def _register_openapi() -> dict[str, Any]:
    schema = _inline_refs(RegisterAdapterBody.model_json_schema())
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema},
                                                          "application/yaml": {"schema": schema}}}}


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its `$defs` substituted in place (an OpenAPI request body cannot
    carry `$defs` of its own)."""
    defs = schema.pop("$defs", {})

    def expand(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return expand(defs[ref.removeprefix("#/$defs/")])
            return {key: expand(value) for key, value in node.items()}
        if isinstance(node, list):
            return [expand(item) for item in node]
        return node

    return expand(schema)
