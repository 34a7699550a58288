"""Load test of the control plane on loopback: reads, registrations and deletions at once.

A controller (the real `MultiLoRAController`: registry, SQLite store, FastAPI on
uvicorn, dataset checks) serves on 127.0.0.1 from its own thread, with a stand-in for
the trainer's calls on the same loop (push, retire, free slots, record and commit
batches) so slots churn as in a run. The client sends `--requests` requests with
`--concurrency` in flight: 60% reads (health, list, state, status, metrics), 25%
registrations of small datasets, 15% deletions. A registration that finds every slot held
is QUEUED (a 200 with `"state": "QUEUED"`, counted apart) unless `--queue-size 0`, when it
is a 409. Afterwards the registry's invariants are checked (no slot held twice, every live
adapter holds a slot, free and held slots partition the table, queued adapters hold none
and wait only while every slot is held, counts match the accepted requests).

    python scripts/bench/control_plane_load.py --requests 2000 --concurrency 32
    python scripts/bench/control_plane_load.py --requests 300 --json out.json   # as the test runs it

With `--url`, the same load goes to a control plane that is already serving, such as a
running trainer's (`--token`, `--data-dir` with small `.jsonl` files inside its allowed
roots); the checks are then made over HTTP (`check_http_invariants`).
`scripts/bench/trainer_service.py` runs this load against a real trainer it starts, while
the trainer trains, and checks the trainer kept stepping and leaked no slot.

Prints requests/s, p50/p99 latency per kind and the 5xx count; exits 1 on a 5xx or a
broken invariant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from miles.controller.actor import ControllerConfig, MultiLoRAController  # noqa: E402
from miles.controller.backend import ControllerHooks  # noqa: E402
from miles.controller.http_server import HTTPServerConfig  # noqa: E402
from miles.rollout.datasets import validate_dataset  # noqa: E402
from miles.rollout.rewards import validate_reward_spec  # noqa: E402
from miles.utils.adapter_config import AdapterDefaults  # noqa: E402
from miles.utils.arguments import DEFAULT_QUEUE_SIZE  # noqa: E402
from miles.utils.types import AdapterState  # noqa: E402
from miles.utils.types.lifecycle_ops import FreeSlots, MarkBatchTrained, RecordBatch, RecordWeightUpdate, RetireAdapters  # noqa: E402

TOKEN = "load-test-token"


def write_datasets(data: Path, n: int = 4, rows: int = 64) -> list[Path]:
    """Small arithmetic datasets (`{"text": "j+i=", "label": "i+j"}`) for the registrations."""
    data.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = data / f"d{i}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{j}+{i}=", "label": str(i + j)}) + "\n" for j in range(rows)))
        paths.append(path)
    return paths


def make_controller(workdir: Path, n_slots: int, queue_size: int = DEFAULT_QUEUE_SIZE) -> MultiLoRAController:
    write_datasets(workdir / "data")
    defaults = AdapterDefaults(lora_rank=8, rollout_batch_size=4, n_samples_per_prompt=2, save=str(workdir / "save"),
                               rm_type="math", max_adapter_global_batch_size=64)
    config = ControllerConfig(
        n_slots=n_slots, defaults=defaults, queue_size=queue_size,
        server=HTTPServerConfig(host="127.0.0.1", port=0, token=TOKEN, allowed_roots=(workdir.resolve(),)),
        hooks=ControllerHooks(validate_dataset=validate_dataset, validate_reward=validate_reward_spec),
        registry_path=workdir / "controller" / "registry.sqlite",
    )
    return MultiLoRAController(config)


async def trainer_stand_in(controller: MultiLoRAController, stop: asyncio.Event) -> int:
    """What the driver does each iteration, every 20 ms: retire, free, push, train a batch."""
    rollout_id = 0
    while not stop.is_set():
        snapshot = await controller.apply(RetireAdapters())
        if snapshot.cleanup:
            snapshot = await controller.apply(FreeSlots(sorted(snapshot.cleanup)))
        if snapshot.pending:
            await controller.apply(RecordWeightUpdate(sorted(snapshot.pending)))
        live = sorted({**snapshot.active, **snapshot.retiring})
        if live:
            await controller.apply(RecordBatch(rollout_id, {n: 4 for n in live}, live))
            await controller.apply(MarkBatchTrained(rollout_id))
            rollout_id += 1
        try:
            await asyncio.wait_for(stop.wait(), 0.02)
        except TimeoutError:
            pass
    return rollout_id


def check_invariants(controller: MultiLoRAController, accepted: int, n_slots: int) -> list[str]:
    backend = controller.backend
    registry = backend.registry
    problems = []
    queued = backend.snapshot().queued
    if queued and registry.free_slots:
        problems.append(f"{list(queued)} wait in the queue while slots {registry.free_slots} are free")
    if set(queued) & set(registry.live_slots()):
        problems.append(f"a queued adapter holds a slot: {sorted(set(queued) & set(registry.live_slots()))}")
    if len(queued) > registry.queue_size:
        problems.append(f"{len(queued)} adapters queued, over the queue size {registry.queue_size}")
    live = registry.live_slots()
    held = list(live.values())
    if len(held) != len(set(held)):
        problems.append(f"a slot is held twice: {live}")
    if any(not 0 <= slot < n_slots for slot in held):
        problems.append(f"a live adapter holds no valid slot: {live}")
    if sorted(held + registry.free_slots) != list(range(n_slots)):
        problems.append(f"free {registry.free_slots} and held {sorted(held)} slots do not partition the table")
    if backend.registrations_total != accepted:
        problems.append(f"{accepted} registrations answered 200 but the registry counted {backend.registrations_total}")
    snapshot = backend.snapshot()
    n_live = len(snapshot.live) + len(snapshot.cleanup)
    if n_live != len(live):
        problems.append(f"snapshot has {n_live} live adapters, the slot table {len(live)}")
    reopened = type(backend)(n_slots, backend.defaults, store=type(controller.store)(controller.store.path),
                             queue_size=registry.queue_size)
    if reopened.snapshot() != snapshot:
        problems.append("the registry file does not hold the final registry")
    return problems


async def run_load(url: str, n_requests: int, concurrency: int, seed: int, datasets: list[str], *,
                   token: str = TOKEN, register_config: dict[str, Any] | None = None,
                   name_prefix: str = "a") -> dict[str, Any]:
    """`n_requests` requests, `concurrency` in flight: 60% reads, 25% registrations (names
    `{name_prefix}{i}`, one of `datasets`, `register_config` added), 15% deletions."""
    rng = random.Random(seed)
    names: list[str] = []
    latencies: dict[str, list[float]] = {}
    statuses: Counter[str] = Counter()
    accepted = queued = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        nonlocal accepted, queued
        roll = rng.random()
        if roll < 0.25:
            kind, name = "register", f"{name_prefix}{i}"
            request = http.post("/adapter_runs", json={"name": name, "config": {
                **(register_config or {}), "data": datasets[i % len(datasets)], "num_step": rng.randint(1, 5)}})
        elif roll < 0.40 and names:
            kind = "delete"
            request = http.delete(f"/adapter_runs/{rng.choice(names)}")
        else:
            kind, path = rng.choice([("health", "/health"), ("list", "/adapter_runs"), ("metrics", "/metrics"),
                                     ("state", "/adapter_runs/state"), ("status", "/adapter_runs/{}")])
            if kind == "state":
                request = http.get(path, params={"names": rng.sample(names, min(3, len(names))) + ["ghost"]})
            elif kind == "status":
                request = http.get(path.format(rng.choice(names) if names else "ghost"))
            else:
                request = http.get(path)
        start = time.perf_counter()
        response = await request
        latencies.setdefault(kind, []).append(time.perf_counter() - start)
        statuses[f"{kind} {response.status_code}"] += 1
        if kind == "register" and response.status_code == 200:
            names.append(name)
            accepted += 1
            queued += response.json().get("state") == AdapterState.QUEUED.value

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            await one(http, queue.get_nowait())

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, limits=limits,
                                 timeout=60, trust_env=False) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    every = [x for values in latencies.values() for x in values]
    return {
        "requests": n_requests, "concurrency": concurrency, "seconds": elapsed,
        "requests_per_s": n_requests / elapsed,
        "p50_ms": percentile(every, 50), "p99_ms": percentile(every, 99),
        "by_kind": {k: {"n": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)}
                    for k, v in sorted(latencies.items())},
        "statuses": dict(sorted(statuses.items())),
        "server_errors": sum(n for key, n in statuses.items() if key.split()[1].startswith("5")),
        "accepted_registrations": accepted, "queued_registrations": queued, "registered_names": names,
    }


def load_in_process(url: str, n_requests: int, concurrency: int, seed: int, datasets: list[str],
                    **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(run_load(url, n_requests, concurrency, seed, datasets, **kwargs))


def load_in_subprocess(url: str, n_requests: int, concurrency: int, seed: int, datasets: list[str],
                       **kwargs: Any) -> dict[str, Any]:
    """The client in its own process, so that it does not share a GIL with the server or the caller."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client:
        return client.submit(load_in_process, url, n_requests, concurrency, seed, datasets, **kwargs).result()


def check_http_invariants(url: str, token: str, n_slots: int, registrations: int | None = None) -> list[str]:
    """The registry as a running control plane serves it: every adapter that holds a slot
    holds its own, valid one; `/metrics` counts what it lists; with `registrations`, the
    registration counter equals the registrations answered 200."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60, trust_env=False) as http:
        runs = http.get("/adapter_runs").raise_for_status().json()
        metrics = http.get("/metrics").raise_for_status().text
    runs = runs["adapters"] if isinstance(runs, dict) else runs
    problems = []
    holding = {r["name"]: r["slot"] for r in runs if AdapterState(r["state"]).holds_slot}
    held = list(holding.values())
    queued = [r for r in runs if r["state"] == AdapterState.QUEUED.value]
    if any(r["slot"] is not None for r in queued):
        problems.append(f"a queued adapter lists a slot: {[(r['name'], r['slot']) for r in queued]}")
    if queued and len(held) < n_slots:
        problems.append(f"{len(queued)} adapters queued while only {len(held)} of {n_slots} slots are held")
    if sorted(r["queue_position"] for r in queued) != list(range(1, len(queued) + 1)):
        problems.append(f"queue positions are not 1..{len(queued)}: {[r['queue_position'] for r in queued]}")
    if len(held) != len(set(held)):
        problems.append(f"a slot is held twice: {holding}")
    if any(not 0 <= slot < n_slots for slot in held):
        problems.append(f"an adapter holds no valid slot: {holding}")
    counted = {line.split('state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line.startswith("miles_controller_adapters{")}
    by_state = Counter(r["state"] for r in runs)
    if any(counted.get(state, 0.0) != n for state, n in by_state.items()):
        problems.append(f"/metrics counts {counted}, /adapter_runs lists {dict(by_state)}")
    queue_length = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("miles_adapter_queue_length ")]
    if queue_length != [float(len(queued))]:
        problems.append(f"/metrics says {queue_length} queued, /adapter_runs lists {len(queued)}")
    if registrations is not None:
        total = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("miles_controller_registrations_total ")]
        if total != [float(registrations)]:
            problems.append(f"{registrations} registrations answered 200 but /metrics counts {total}")
    return problems


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE,
                        help="registrations that may wait for a slot (0: a full table answers 409)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--url", help="load a control plane that is already serving (e.g. a running trainer's)")
    parser.add_argument("--token", default=TOKEN, help="its bearer token (with --url)")
    parser.add_argument("--data-dir", type=Path,
                        help="with --url: where to write the small datasets (inside the server's allowed roots)")
    args = parser.parse_args(argv)
    if args.url:
        return load_running(args)

    workdir = Path(tempfile.mkdtemp(prefix="control_plane_load_"))
    controller = make_controller(workdir, args.slots, args.queue_size)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="controller-loop", daemon=True)
    thread.start()
    call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=120)  # noqa: E731
    port = call(controller.start())
    stop = asyncio.Event()
    trainer = asyncio.run_coroutine_threadsafe(trainer_stand_in(controller, stop), loop)
    try:
        datasets = [str(workdir / "data" / f"d{i}.jsonl") for i in range(4)]
        result = load_in_subprocess(f"http://127.0.0.1:{port}", args.requests, args.concurrency, args.seed, datasets)
    finally:
        loop.call_soon_threadsafe(stop.set)
        result_iterations = trainer.result(timeout=60)
        call(controller.stop())

    async def invariants() -> list[str]:
        return check_invariants(controller, result["accepted_registrations"], args.slots)

    result["trainer_iterations"] = result_iterations
    result["invariant_problems"] = call(invariants())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)

    print_result(result)
    print(f"  trainer stand-in iterations: {result_iterations}; invariants: "
          f"{'hold' if not result['invariant_problems'] else result['invariant_problems']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if result["server_errors"] or result["invariant_problems"] else 0


def load_running(args: argparse.Namespace) -> int:
    """The load against a control plane that is already serving; checks over HTTP only."""
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="control_plane_load_data_"))
    datasets = [str(p.resolve()) for p in write_datasets(data_dir)]
    result = load_in_subprocess(args.url, args.requests, args.concurrency, args.seed, datasets, token=args.token)
    result["invariant_problems"] = check_http_invariants(args.url, args.token, args.slots)
    print_result(result)
    print(f"  invariants: {'hold' if not result['invariant_problems'] else result['invariant_problems']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if result["server_errors"] or result["invariant_problems"] else 0


def print_result(result: dict[str, Any]) -> None:
    print(f"{result['requests']} requests at concurrency {result['concurrency']} in {result['seconds']:.1f} s: "
          f"{result['requests_per_s']:.0f} requests/s, p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, "
          f"5xx: {result['server_errors']}")
    for kind, row in result["by_kind"].items():
        print(f"  {kind:9s} n={row['n']:5d}  p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms")
    print(f"  statuses: {result['statuses']} ({result['queued_registrations']} registrations were queued)")


if __name__ == "__main__":
    sys.exit(main())
