"""Shared pieces of the control-plane tests: datasets, resolved configs, a loopback
stand-in for the sglang-router and its workers, a controller served from a background
loop. Fixtures wrapping them are in conftest.py."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from miles.controller.actor import ControllerConfig, MultiLoRAController
from miles.controller.backend import ControllerHooks
from miles.controller.http_server import HTTPServerConfig
from miles.rollout.datasets import validate_dataset
from miles.rollout.generate import validate_rollout_plugins
from miles.rollout.rewards import validate_reward_spec
from miles.utils.adapter_config import AdapterDefaults, AdapterRunConfig

ROLLOUT_HOOKS = ControllerHooks(validate_dataset=validate_dataset, validate_reward=validate_reward_spec,
                                validate_plugins=validate_rollout_plugins)
"""The checks the trainer hands the controller at launch."""


def write_dataset(path: Path, rows: int = 4) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(rows)))
    return path


def make_config(name: str, root: Path = Path("/runs"), **overrides: Any) -> AdapterRunConfig:
    """A fully resolved config built directly (the registry never reads files)."""
    values: dict[str, Any] = dict(
        data=str(root / f"{name}.jsonl"), rank=4, alpha=8.0, rollout_batch_size=4, n_samples_per_prompt=2,
        save=root / "adapters" / name, input_key="text", label_key="label", metadata_key="metadata",
        rm_type="math", custom_rm_path=None, num_step=None, num_epoch=None, metadata={},
        lr=1e-4, weight_decay=0.0, lr_decay_style="constant", lr_warmup_steps=0,
    )
    values.update(overrides)
    return AdapterRunConfig(**values)


WORKER_INFO_PATHS: dict[str, Any] = {
    "/health": {}, "/health_generate": {},
    "/get_model_info": {"model_path": "tiny", "is_generation": True},
    "/get_server_info": {"model_path": "tiny", "max_total_num_tokens": 1024},
}


class LoopbackRouter:
    """A real HTTP server on 127.0.0.1 playing the router and/or a worker.

    `mode` picks how it lists workers: "list_workers" (`{"urls"}`), "workers"
    (`{"workers": [{"url"}]}`, /list_workers answers 404) or "none" (both 404).
    Every POST /abort_request body is recorded; `abort_status` is what it answers.
    """

    def __init__(self, mode: str = "list_workers", workers: list[str] | None = None, abort_status: int = 200) -> None:
        self.mode = mode
        self.workers = workers
        self.abort_status = abort_status
        self.aborts: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                urls = owner.workers if owner.workers is not None else [owner.url]
                if self.path in WORKER_INFO_PATHS:  # what a router asks a worker before adding it
                    self._send(200, WORKER_INFO_PATHS[self.path])
                elif self.path == "/list_workers" and owner.mode == "list_workers":
                    self._send(200, {"urls": urls})
                elif self.path == "/workers" and owner.mode == "workers":
                    self._send(200, {"workers": [{"url": u, "model_id": "m"} for u in urls], "total": len(urls)})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/abort_request":
                    owner.aborts.append(body)
                    self._send(owner.abort_status, {})
                else:
                    self._send(404, {})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class ThreadedController:
    """A `MultiLoRAController` (no Ray) whose loop runs in a background thread, so sync
    tests can talk to its real uvicorn server and inspect its registry safely."""

    def __init__(self, config: ControllerConfig, router_url: str | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.controller = MultiLoRAController(config, router_url)
        self.port = self.call(self.controller.start())
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def fingerprint(self) -> Any:
        """Everything a rejected request must leave untouched."""
        async def read() -> Any:
            backend = self.controller.backend
            return (backend.snapshot(), [s.model_dump() for s in backend.statuses()],
                    backend.registry.free_slots, backend.registry.slot_versions, backend.registrations_total)
        return self.call(read())

    def close(self) -> None:
        self.call(self.controller.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def controller_config(data_root: Path, defaults: AdapterDefaults, n_slots: int = 2, token: str | None = None,
                      hooks: ControllerHooks = ROLLOUT_HOOKS, **extra: Any) -> ControllerConfig:
    server = HTTPServerConfig(host="127.0.0.1", port=0, token=token, allowed_roots=(data_root.resolve(),),
                              **{k: extra.pop(k) for k in ["max_body_bytes", "plugin_modules", "run_dir", "dump_dir"]
                                 if k in extra})
    return ControllerConfig(n_slots=n_slots, defaults=defaults, server=server, hooks=hooks, **extra)
