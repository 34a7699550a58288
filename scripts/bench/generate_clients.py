"""Generation throughput of the builtin engine with the producer's HTTP client vs httpx.

    python scripts/bench/generate_clients.py [--model DIR] [--requests 384] [--rounds 3]

Starts one builtin engine on 127.0.0.1 (the tiny base if built, else a tiny random
model), then sends the same burst of short generation requests (one adapter-step's
worth: 48 prompts x 8 samples) with `aiohttp` (what the rollout producer uses) and with
`httpx.AsyncClient`, alternating, and prints requests/s of each and their ratio. The
requests are identical; only the client differs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import httpx

from miles.rollout.engines.process import ServerProcess
from miles.rollout.engines.server_command import BUILTIN_URL_LINE, EngineServerConfig, build_builtin_command

PROMPT = "12+35="
PROMPT_IDS: list[int] = []  # PROMPT encoded with the model's tokenizer in run()


def payload() -> dict:
    return {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
            "rid": f"bench::{uuid.uuid4().hex}", "return_logprob": True}


async def burst_aiohttp(url: str, n: int) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            async with session.post(f"{url}/generate", json=payload()) as response:
                response.raise_for_status()
                await response.json()
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - start)


async def burst_httpx(url: str, n: int) -> float:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
        async def one() -> None:
            response = await client.post(f"{url}/generate", json=payload())
            response.raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - start)


def model_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    base = Path(".cache/tiny_base")
    if (base / "config.json").exists():
        return base
    from miles.recipes.tiny_model import write_tiny_model

    return write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0)


async def run(model: Path, n_requests: int, rounds: int) -> None:
    from transformers import AutoTokenizer

    PROMPT_IDS[:] = AutoTokenizer.from_pretrained(model)(PROMPT, add_special_tokens=False)["input_ids"]
    config = EngineServerConfig(kind="builtin", model_path=str(model), n_slots=1, max_lora_rank=8,
                                target_modules="all-linear", max_running_requests=n_requests)
    log_path = Path(tempfile.mkdtemp()) / "engine.log"
    server, url = await ServerProcess.start(build_builtin_command(config, "127.0.0.1", 0), log_path=log_path,
                                            url_line=BUILTIN_URL_LINE, timeout_s=120, what="builtin engine")
    try:
        await burst_aiohttp(url, n_requests)  # warm-up
        rates: dict[str, list[float]] = {"aiohttp": [], "httpx": []}
        for _ in range(rounds):
            rates["aiohttp"].append(await burst_aiohttp(url, n_requests))
            rates["httpx"].append(await burst_httpx(url, n_requests))
    finally:
        server.terminate()
    median = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        print(f"{name:8s} {median[name]:8.1f} requests/s (median of {', '.join(f'{v:.1f}' for v in values)})")
    print(f"ratio aiohttp/httpx: {median['aiohttp'] / median['httpx']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model directory (default: .cache/tiny_base or a tiny random model)")
    parser.add_argument("--requests", type=int, default=384, help="requests per burst")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per client")
    args = parser.parse_args()
    model = model_dir(args.model)
    print(f"model: {model}; {args.requests} concurrent requests of <= 8 new tokens per burst")
    asyncio.run(run(model, args.requests, args.rounds))


if __name__ == "__main__":
    main()
