"""Security of the control plane: the token guards every route but /health (the OpenAPI
pages too), binding beyond loopback without a token is logged loudly, and a pickle sent
to any route that takes a body is refused without being unpickled."""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.routing import Route

from miles.controller.backend import MultiLoRABackend
from miles.controller.http_server import (
    SIGNED_PATH_PREFIX,
    UNAUTHENTICATED_PATHS,
    HTTPServerConfig,
    MultiLoRAHTTPServer,
)
from miles.dashboard.routes import is_public
from miles.utils.adapter_config import AdapterDefaults
from tests.helpers.controller_fakes import ThreadedController, controller_config

TOKEN = "security-test-token"


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults) -> Iterator[ThreadedController]:
    controller = ThreadedController(controller_config(data_root, defaults, n_slots=2, token=TOKEN))
    yield controller
    controller.close()


def every_route(plane: ThreadedController) -> list[tuple[str, str]]:
    """(method, concrete path) of every route the app serves, docs included."""
    routes = []
    for route in plane.controller.server.app.routes:
        assert isinstance(route, Route), route
        for method in sorted(route.methods or []):
            if method != "HEAD":
                routes.append((method, route.path.replace("{name}", "someone").replace("{session_id}", "s-1")))
    return routes


def test_every_route_but_health_needs_the_token(plane: ThreadedController) -> None:
    routes = every_route(plane)
    paths = {path for _, path in routes}
    assert {"/health", "/docs", "/openapi.json", "/redoc", "/metrics", "/adapter_runs",
            "/api/v1/create_model", "/api/v1/retrieve_future"} <= paths
    assert UNAUTHENTICATED_PATHS == {"/health", "/api/v1/healthz"}
    with httpx.Client(base_url=plane.url, trust_env=False) as anonymous:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                            {"Authorization": f"Basic {TOKEN}"}, {"X-API-Key": "wrong"},
                            {"X-API-Key": f"Bearer {TOKEN}"}):
                response = anonymous.request(method, path, headers=headers)
                if path in UNAUTHENTICATED_PATHS:
                    assert response.status_code == 200
                elif is_public(path):  # the dashboard's page and files: no data, it asks for the token
                    assert response.status_code != 401, (method, path)
                elif path.startswith(SIGNED_PATH_PREFIX):  # a checkpoint download: its URL's signature
                    assert response.status_code == 401, (method, path, headers, response.status_code)
                else:
                    assert response.status_code == 401, (method, path, headers, response.status_code)
                    assert response.headers["www-authenticate"] == "Bearer"
    with httpx.Client(base_url=plane.url, trust_env=False, headers={"Authorization": f"Bearer {TOKEN}"}) as user:
        for method, path in routes:
            signed = path.startswith(SIGNED_PATH_PREFIX)  # the token does not replace a download's signature
            assert (user.request(method, path).status_code == 401) == signed, (method, path)
        assert user.get("/openapi.json").json()["info"]["title"] == "Miles Multi-LoRA Controller"
    with httpx.Client(base_url=plane.url, trust_env=False, headers={"X-API-Key": TOKEN}) as tinker_client:
        for method, path in routes:
            signed = path.startswith(SIGNED_PATH_PREFIX)
            assert (tinker_client.request(method, path).status_code == 401) == signed, (method, path)


class _RunsAShellCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickles_are_never_unpickled(plane: ThreadedController, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    payloads = [pickle.dumps(os.system), pickle.dumps(_RunsAShellCommand(marker)),
                pickle.dumps({"name": "x", "config": {"data": "a.jsonl"}})]
    body_routes = [(m, p) for m, p in every_route(plane) if m in ("POST", "PUT", "PATCH")]
    assert body_routes[0] == ("POST", "/adapter_runs")
    assert {p for _, p in body_routes[1:]} >= {"/api/v1/create_model", "/api/v1/forward_backward"}
    before = plane.fingerprint()
    with httpx.Client(base_url=plane.url, trust_env=False, headers={"Authorization": f"Bearer {TOKEN}"}) as user:
        for method, path in body_routes:
            for content_type in ("application/octet-stream", "application/python-pickle", "application/x-pickle",
                                 "application/json", "application/yaml"):
                for payload in payloads:
                    response = user.request(method, path, content=payload, headers={"Content-Type": content_type})
                    if path.startswith("/api/v1/") and response.status_code < 400:
                        # Tinker routes without a body of their own (client config, telemetry) ignore it.
                        assert path in ("/api/v1/client/config", "/api/v1/client/dynamic_config",
                                        "/api/v1/telemetry", "/api/v1/sessions/s-1/finish") or \
                            response.status_code != 200, (path, response.text)
                        continue
                    assert 400 <= response.status_code < 500, (path, content_type, response.status_code)
                    if path == "/adapter_runs":
                        assert "Malformed body" in response.text
        assert user.get("/health").status_code == 200
    assert plane.fingerprint() == before
    assert not marker.exists()


async def test_binding_beyond_loopback_without_a_token_warns_loudly(
        caplog: pytest.LogCaptureFixture, defaults: AdapterDefaults) -> None:
    """192.0.2.1 (TEST-NET-1) is never a local address: the bind fails after the warning,
    so nothing is exposed by this test."""
    backend = MultiLoRABackend(1, defaults)
    for host, token, warned in [("192.0.2.1", None, True), ("192.0.2.1", "t", False), ("127.0.0.1", None, False),
                                ("::1", None, False), ("localhost", None, False)]:
        caplog.clear()
        server = MultiLoRAHTTPServer(backend, config=HTTPServerConfig(host=host, port=0, token=token))
        with caplog.at_level(logging.WARNING, logger="miles.controller.http_server"):
            try:
                await server.start()
            except RuntimeError as exc:
                assert host == "192.0.2.1" and "cannot bind" in str(exc)
            else:
                await server.stop()
        messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("SECURITY WARNING" in m and "WITHOUT a token" in m for m in messages) is warned, (host, messages)
