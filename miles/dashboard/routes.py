"""The dashboard's routes: the page at `/ui` and the JSON it polls under `/ui/api`.

    install_dashboard(app, RunFiles(run_dir, dump_dir), mode="live", controls=True)

The page (`static/`) is public: it holds no data, and asks for the API token in a login
field. Every `/ui/api` route needs the token as the rest of the API does (the server's own
middleware checks it). Each `/ui` answer carries a Content-Security-Policy that lets the
page load and call only its own origin, so no model output it shows can run a script or
reach another host.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse, RedirectResponse

from miles.dashboard.data import DEFAULT_LIMIT, MAX_LIMIT, RunFiles, UnknownRolloutError

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PATH = "/ui"
STATIC_PREFIX = "/ui/static/"
API_PREFIX = "/ui/api/"
POLL_MS = 1000

CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}

Mode = Literal["live", "run_dir"]


def is_public(path: str) -> bool:
    """The page and its files: served without the token (the data they fetch needs it)."""
    return path in (PAGE_PATH, PAGE_PATH + "/") or path.startswith(STATIC_PREFIX)


def install_dashboard(app: FastAPI, files: RunFiles, *, mode: Mode, controls: bool) -> None:
    """Serve the page and its data on `app`. `controls`: the page offers register and retire
    (the app serves `POST /adapter_runs` and `DELETE /adapter_runs/{name}`)."""
    static = {p.name: p for p in STATIC_DIR.glob("*") if p.is_file() and p.suffix in MEDIA_TYPES}

    @app.middleware("http")
    async def secure_ui(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        if request.url.path == PAGE_PATH or request.url.path.startswith(PAGE_PATH + "/"):
            response.headers.update(SECURITY_HEADERS)
        return response

    @app.get(PAGE_PATH, include_in_schema=False)
    async def page() -> FileResponse:
        return await static_file("index.html")

    @app.get(PAGE_PATH + "/", include_in_schema=False)
    async def page_slash() -> RedirectResponse:
        return RedirectResponse(PAGE_PATH)

    @app.get(STATIC_PREFIX + "{name}", include_in_schema=False)
    async def static_file(name: str) -> FileResponse:
        path = static.get(name)  # only the files the package ships: no path from the URL reaches the disk
        if path is None:
            raise HTTPException(404, f"No dashboard file {name!r}")
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix])

    @app.get(API_PREFIX + "info", tags=["dashboard"])
    async def info() -> dict[str, Any]:
        """What the page shows: the run directory, whether rollouts are dumped, whether it may register and retire."""
        return {"mode": mode, "run_dir": None if files.run_dir is None else str(files.run_dir),
                "dump_dir": None if files.dump_dir is None else str(files.dump_dir),
                "controls": controls, "poll_ms": POLL_MS}

    @app.get(API_PREFIX + "records", tags=["dashboard"])
    async def records(offset: int = Query(0, ge=0), limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT)
                      ) -> dict[str, Any]:
        """The records of `metrics.jsonl` from byte `offset` (the `offset` of the previous answer)."""
        return await asyncio.to_thread(files.records, offset, limit)

    @app.get(API_PREFIX + "rollouts", tags=["dashboard"])
    async def rollouts(adapter: str) -> dict[str, Any]:
        """The dumped rollouts of an adapter (`--dump-details`), oldest first."""
        try:
            listed = await asyncio.to_thread(files.rollouts, adapter)
        except UnknownRolloutError as exc:
            raise HTTPException(404, str(exc)) from None
        return {"adapter": adapter, "rollouts": listed}

    @app.get(API_PREFIX + "rollouts/{adapter}/{rollout_id}", tags=["dashboard"])
    async def rollout(adapter: str, rollout_id: int) -> dict[str, Any]:
        """One dumped rollout of an adapter: its prompt groups, responses, rewards and tokens."""
        try:
            return await asyncio.to_thread(files.rollout, adapter, rollout_id)
        except UnknownRolloutError as exc:
            raise HTTPException(404, str(exc)) from None
