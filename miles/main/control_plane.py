"""Standalone control plane: the controller's HTTP API without a trainer (or Ray).

For client development and integration tests. It takes the trainer's flags (the ones it
does not need are accepted and ignored) and stops cleanly on SIGINT/SIGTERM:

    python -m miles.main.control_plane --multi-lora-n-adapters 4 --save runs/demo \\
        --rm-type math --multi-lora-api-port 8068
    curl -s localhost:8068/adapter_runs -d '{"name": "a", "config": {"data": "data.jsonl"}}'

Adapters registered here walk PENDING only (no trainer pushes weights); DELETE moves them
to RETIRING. Registrations get the trainer's checks: the dataset (read, its rows counted
into `num_step`), the reward, the plug-in paths (inside `--multi-lora-allowed-plugin-modules`,
callable as the rollout calls them) and the allowed roots, so a client developed against it
learns the trainer's contract. With `--sglang-router-ip/--sglang-router-port`, aborts reach
that router's workers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from miles.controller.actor import ControllerConfig, MultiLoRAController
from miles.main.registration_checks import controller_hooks
from miles.utils.arguments import MilesConfig, parse_args

logger = logging.getLogger("miles.controller")


_AUTH = ' -H "Authorization: Bearer $MILES_API_TOKEN"'
_USAGE = """Try it:
  curl -s{auth} -H 'Content-Type: application/json' {url}/adapter_runs \\
       -d '{{"name": "demo", "config": {{"data": "path/to/train.jsonl", "rm_type": "math"}}}}'
  curl -s{auth} '{url}/adapter_runs/state?names=demo'
  curl -s{auth} -X DELETE {url}/adapter_runs/demo
Stop with Ctrl-C."""


async def serve(cfg: MilesConfig) -> None:
    router_url = f"http://{cfg.sglang_router_ip}:{cfg.sglang_router_port}" if cfg.sglang_router_ip else None
    # The trainer's registration checks (its launcher hands the controller the same hooks).
    controller = MultiLoRAController(ControllerConfig.from_config(cfg, controller_hooks(cfg)), router_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    port = await controller.start()
    host = await controller.http_host()
    logger.info("Control plane listening on http://%s:%d (OpenAPI at /docs, dashboard at /ui)", host, port)
    logger.info(_USAGE.format(url=f"http://{host}:{port}", auth=_AUTH if cfg.multi_lora_api_token else ""))
    try:
        await stop.wait()
    finally:
        logger.info("Stopping the control plane")
        await controller.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    if cfg.multi_lora_n_adapters <= 0:
        print("miles.main.control_plane: error: set --multi-lora-n-adapters to the number of slots (> 0)",
              file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(cfg))
    except (RuntimeError, ValueError) as exc:  # cannot bind, or a bad --multi-lora-*-path
        print(f"miles.main.control_plane: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
