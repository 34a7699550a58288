"""SkyRL's Tinker server (skyrl 0.3.0, JAX backend) on loopback, on a port the OS picks.

    <skyrl venv>/bin/python scripts/bench/skyrl_server.py --base-model DIR [SkyRL's EngineConfig flags]

`tinker_vs_skyrl.py` runs this with the interpreter of a virtualenv that holds
`skyrl[tinker,jax]==0.3.0`; it imports nothing of ours. It serves SkyRL's FastAPI app as
`python -m skyrl.tinker.api` does, except for three things:

- It binds 127.0.0.1, port 0, and prints `SkyRL Tinker server listening at http://...` once
  bound (skyrl's own entry point takes a fixed port and binds 0.0.0.0 by default).
- skyrl 0.3.0 declares Python >= 3.11, but `skyrl/tinker/types.py` puts a `typing.TypedDict`
  in a pydantic model, which pydantic refuses below Python 3.12 ("Please use
  `typing_extensions.TypedDict`"). The two are swapped before skyrl is imported, in the API
  process and in the engine process (both import that module).
- skyrl 0.3.0's API server starts its engine subprocess as `uv run <the uv flags read from
  its parent's command line> -m skyrl.tinker.engine ...`; outside `uv run` that raises
  ValueError at startup. The engine runs instead as this interpreter with this file and
  `engine` first (`python skyrl_server.py engine ARGS` is `python -m skyrl.tinker.engine ARGS`).
"""

from __future__ import annotations

import sys
import typing

import typing_extensions

if sys.version_info < (3, 12):  # skyrl 0.3.0 on Python 3.11: see the docstring
    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

LISTENING = "SkyRL Tinker server listening at "


def serve(argv: list[str]) -> None:
    import argparse
    import socket

    import uvicorn
    from skyrl.tinker import api
    from skyrl.tinker.config import EngineConfig, add_model, config_to_argv
    from skyrl.utils.log import get_uvicorn_log_config

    def engine_command(parent_cmd: list[str], config: EngineConfig) -> list[str]:
        return [sys.executable, __file__, "engine", *config_to_argv(config)]

    api._build_uv_run_cmd_engine = engine_command
    parser = argparse.ArgumentParser(description="SkyRL's Tinker server on 127.0.0.1, port 0")
    add_model(parser, EngineConfig)
    args = parser.parse_args(argv)
    api.app.state.engine_config = EngineConfig.model_validate(
        {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    print(f"{LISTENING}http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(api.app, log_config=get_uvicorn_log_config())).run(sockets=[sock])


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        from skyrl.tinker.engine import main

        sys.argv = [sys.argv[0], *sys.argv[2:]]
        main()
    else:
        serve(sys.argv[1:])
