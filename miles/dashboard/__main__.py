"""The dashboard over a run directory, with no trainer: a finished run, or one still
writing (the page follows `metrics.jsonl` as it grows).

    python -m miles.dashboard runs/demo                      # http://127.0.0.1:8069/ui
    python -m miles.dashboard runs/demo --dump-details runs/demo/details --port 0

It reads `RUN_DIR/metrics.jsonl`, the rollout dump (`--dump-details`, default
`RUN_DIR/details` when that folder exists) and the adapters of the run's registry file
(`RUN_DIR/controller/registry.sqlite`, else the adapters the records name). Read only: no
register or retire. With `--token` (or `MILES_API_TOKEN`) its data needs the token, as
the trainer's own `/ui` does.
"""

from __future__ import annotations

import hmac
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from miles.controller.store import registry_statuses
from miles.dashboard.data import DUMP_SUBDIR, RunFiles, adapters_from_records
from miles.dashboard.routes import PAGE_PATH, install_dashboard, is_public
from miles.utils.network import tcp_listener

logger = logging.getLogger("miles.dashboard")

DEFAULT_PORT = 8069


class RecordedAdapters:
    """The adapters the records name, read incrementally (the file only grows)."""

    def __init__(self, files: RunFiles) -> None:
        self.files = files
        self.offset = 0
        self.latest: dict[str, dict[str, Any]] = {}

    def read(self) -> list[dict[str, Any]]:
        while True:
            page = self.files.records(self.offset)
            if page["reset"]:
                self.latest = {}
            self.offset = page["offset"]
            for entry in adapters_from_records(page["records"]):
                self.latest[entry["name"]] = entry
            if not page["more"]:
                return [self.latest[name] for name in sorted(self.latest)]


def create_app(run_dir: Path, dump_dir: Path | None = None, token: str | None = None) -> FastAPI:
    files = RunFiles(run_dir, dump_dir)
    registry_file = run_dir / "controller" / "registry.sqlite"
    recorded = RecordedAdapters(files)
    app = FastAPI(title="miles dashboard", docs_url=None, redoc_url=None)

    if token:
        @app.middleware("http")
        async def check_token(request: Request, call_next: Any) -> Response:
            scheme, _, value = request.headers.get("authorization", "").partition(" ")
            given = value.strip() if scheme.lower() == "bearer" else ""
            if not is_public(request.url.path) and not hmac.compare_digest(given.encode(), token.encode()):
                return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                                    content={"detail": "Missing or invalid token: send 'Authorization: Bearer "
                                                       "<token>' (the one given with --token or MILES_API_TOKEN)"})
            return await call_next(request)

    install_dashboard(app, files, mode="run_dir", controls=False)

    @app.get("/adapter_runs", tags=["dashboard"])
    def list_adapters() -> dict[str, Any]:
        """The run's adapters: from its registry file when it has one, else from its records."""
        statuses = registry_statuses(registry_file)
        return {"adapters": statuses if statuses is not None else recorded.read()}

    return app


def main(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (holds metrics.jsonl).")],
    dump_details: Annotated[Path | None, typer.Option(help="The trainer's --dump-details DIR "
                                                           "(default: RUN_DIR/details if it exists).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one.")] = DEFAULT_PORT,
    token: Annotated[str | None, typer.Option(envvar="MILES_API_TOKEN",
                                              help="Token the page's data needs (none by default).")] = None,
) -> None:
    """Serve the dashboard of a run directory at http://HOST:PORT/ui."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (run_dir / "metrics.jsonl").is_file():
        typer.echo(f"miles.dashboard: error: {run_dir / 'metrics.jsonl'} does not exist: give the trainer's "
                   "--run-dir (or --save) directory", err=True)
        raise typer.Exit(2)
    if dump_details is None and (run_dir / "details").is_dir():
        dump_details = run_dir / "details"
    dump_dir = None if dump_details is None else dump_details / DUMP_SUBDIR
    if dump_dir is not None and not dump_dir.is_dir():
        typer.echo(f"miles.dashboard: error: {dump_dir} does not exist: give the trainer's --dump-details DIR",
                   err=True)
        raise typer.Exit(2)
    app = create_app(run_dir, dump_dir, token)
    try:
        sock = tcp_listener(host, port)
    except OSError as exc:
        typer.echo(f"miles.dashboard: error: cannot bind {host}:{port} ({exc}): pick another --port (0: any free one)",
                   err=True)
        raise typer.Exit(1) from None
    logger.info("Dashboard of %s at http://%s:%d%s (Ctrl-C stops it)", run_dir, host, sock.getsockname()[1],
                PAGE_PATH)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def cli() -> int:
    try:
        typer.run(main)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(cli())
