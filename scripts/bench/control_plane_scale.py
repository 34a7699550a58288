"""Control-plane latency, registry writes and the snapshot as the registry grows.

    python scripts/bench/control_plane_scale.py                  # 10, 1,000 and 10,000 registrations
    python scripts/bench/control_plane_scale.py --quick          # smoke run (10 and 300)

A long-running control plane keeps the records of finished adapters: the registry holds
every live adapter and the last `COMPLETED_RETENTION` (1,024) finished ones (an LRU:
reading one keeps it longer), all of them written through to its SQLite file, and
`GET /adapter_runs` returns every record it holds. This script builds registries as a
service would have them after 10, 1,000 and 10,000 registrations (driving the registry
in-process: register, push, one step, retire, free the slot; the last 32 stay ACTIVE),
writes each to its SQLite file, and starts one real controller per registry (registry,
store, FastAPI on uvicorn, the dataset and reward checks, a bearer token) on 127.0.0.1,
port 0. A fourth controller holds all 10,000 records (retention raised to 10,000): the
registry a service that kept every record would serve.

Measured, in one process, sizes alternating (forward, then reversed) in every repetition:

- latency of `POST /adapter_runs` (a registration: the dataset is read and the registry
  written through; then, untimed, the adapter is deregistered, retired and its slot freed
  in-process as the trainer would, so the next registration finds a free slot and the
  registry keeps its size), `GET /adapter_runs/{name}` (a random kept record),
  `GET /adapter_runs` (every record) and `GET /metrics` (a Prometheus scrape); figures: p99
  at 10,000 registrations ÷ p99 at 10, per repetition;
- the registry's write-through (`RegistryStore.write_through(registry)`, what every registry
  change costs the control plane's loop: the rows the change touched) after one record
  changed, a registration and a slot freed: saves/s;
- the snapshot the driver takes every iteration (`controller.snapshot.remote()`, a
  `MultiLoRASnapshot` serialised by Ray): its size and the time to build and serialise it
  with 8 and 1,000 live adapters (and 1,024 finished names).

Requests are sent one at a time from the benchmark's main thread (sync httpx) to servers
on one event loop in a second thread: latency without queueing. `--json PATH` writes the
figures for `run_all.py`; the printed table has p50 and p99 of every operation at every size.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, Figure, base_parser, report  # noqa: E402

sys.path.insert(0, str(ROOT))
from control_plane_load import TOKEN, percentile, write_datasets  # noqa: E402

from miles.controller.actor import ControllerConfig, MultiLoRAController  # noqa: E402
from miles.controller.backend import ControllerHooks  # noqa: E402
from miles.controller.http_server import HTTPServerConfig  # noqa: E402
from miles.controller.registry import COMPLETED_RETENTION, AdapterRegistry  # noqa: E402
from miles.controller.store import RegistryStore  # noqa: E402
from miles.rollout.datasets import validate_dataset  # noqa: E402
from miles.rollout.rewards import validate_reward_spec  # noqa: E402
from miles.utils.adapter_config import AdapterDefaults, resolve_adapter_config  # noqa: E402
from miles.utils.types.lifecycle_ops import FreeSlots, RetireAdapters  # noqa: E402

T = TypeVar("T")
LIVE = 32
"""Adapters left ACTIVE in every registry (of 64 slots); the rest are finished."""
SLOTS = 64
OPS = ("register", "status", "list", "list_all", "metrics")
PAGE = 100
"""Adapters per page of the paginated list (`GET /adapter_runs?limit=`)."""
OP_PATHS = {"register": "POST /adapter_runs", "status": "GET /adapter_runs/{name}",
            "list": f"GET /adapter_runs?limit={PAGE} (a page)", "list_all": "GET /adapter_runs (every record)",
            "metrics": "GET /metrics"}
TARGETS = {"register": "<= 2", "status": "<= 2", "list": "<= 2", "list_all": "report", "metrics": "<= 2"}
"""The control plane's latency should not depend on how long the service has run."""


@dataclass(frozen=True)
class Case:
    registrations: int
    retention: int

    @property
    def kept(self) -> int:
        """Records the registry holds: the live ones and the newest `retention` finished ones."""
        live = min(LIVE, self.registrations // 4)
        return live + min(self.registrations - live, self.retention)

    @property
    def label(self) -> str:
        return f"{self.registrations:,} registrations ({self.kept:,} records kept)"


def defaults_for(workdir: Path) -> AdapterDefaults:
    return AdapterDefaults(lora_rank=8, rollout_batch_size=4, n_samples_per_prompt=2, save=str(workdir / "save"),
                           rm_type="math", max_adapter_global_batch_size=64)


def fill_registry(case: Case, defaults: AdapterDefaults, data: str) -> AdapterRegistry:
    """The registry after `case.registrations` registrations: all but the last `LIVE` ran one
    step and finished (the registry keeps the newest `case.retention` of them)."""
    registry = AdapterRegistry(SLOTS, completed_retention=case.retention)
    live = min(LIVE, case.registrations // 4)
    for i in range(case.registrations):
        name = f"adapter-{i:05d}"
        registry.register(name, resolve_adapter_config(name, {"data": data, "num_step": 1}, defaults))
        registry.record_weight_update([name])
        if i >= case.registrations - live:
            continue
        registry.record_batch_adapters(i, {name: 4}, [name])
        registry.mark_batch_trained(i)  # num_step 1: RETIRING
        registry.retire_adapters()
        registry.free_slot(name)
    return registry


@dataclass
class Plane:
    """One controller serving one pre-filled registry."""

    case: Case
    controller: MultiLoRAController
    names: list[str]
    data: str
    """The dataset registrations name."""
    url: str = ""


def start_plane(case: Case, workdir: Path, data: str) -> Plane:
    workdir.mkdir(parents=True)
    defaults = defaults_for(workdir)
    registry = fill_registry(case, defaults, data)
    store = RegistryStore(workdir / "registry.sqlite")
    store.save(registry.export_state())
    store.close()
    config = ControllerConfig(
        n_slots=SLOTS, defaults=defaults,
        server=HTTPServerConfig(host="127.0.0.1", port=0, token=TOKEN, allowed_roots=(workdir.parent.resolve(),)),
        hooks=ControllerHooks(validate_dataset=validate_dataset, validate_reward=validate_reward_spec),
        registry_path=workdir / "registry.sqlite",
    )
    controller = MultiLoRAController(config)
    if case.retention != COMPLETED_RETENTION:  # the controller's registry keeps the default
        assert controller.store is not None
        state = controller.store.load()
        assert state is not None
        controller.backend.registry = AdapterRegistry.from_state(state, SLOTS, completed_retention=case.retention)
    kept = controller.backend.registry.statuses()
    assert len(kept) == case.kept, (len(kept), case)
    return Plane(case, controller, [s.name for s in kept], data)


class LoopThread:
    """An event loop in a thread: the controllers serve from it, the main thread sends requests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="control-planes", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def request_once(plane: Plane, http: httpx.Client, loop: LoopThread, op: str, data: str,
                 rng: random.Random) -> float:
    """Seconds of one request of `op` (asserting its status); a registration is undone after."""
    if op == "register":
        body = {"name": "probe", "config": {"data": data, "num_step": 1}}
        start = time.perf_counter()
        response = http.post("/adapter_runs", json=body)
        elapsed = time.perf_counter() - start
        response.raise_for_status()
        loop.call(release_probe(plane.controller))
        return elapsed
    path = {"status": f"/adapter_runs/{rng.choice(plane.names)}", "list_all": "/adapter_runs",
            "list": f"/adapter_runs?limit={PAGE}&offset={rng.randrange(0, len(plane.names), PAGE)}",
            "metrics": "/metrics"}[op]
    start = time.perf_counter()
    response = http.get(path)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed


async def release_probe(controller: MultiLoRAController) -> None:
    """What DELETE and the trainer's next reconcile do: RETIRING, CLEANUP, slot freed (COMPLETED)."""
    await controller.deregister_adapter("probe")
    await controller.apply(RetireAdapters())
    await controller.apply(FreeSlots(["probe"]))


def time_http(planes: list[Plane], loop: LoopThread, data: str, per_rep: dict[str, int], reps: int,
              ) -> dict[tuple[str, int], list[list[float]]]:
    """Per (op, plane index): one list of latencies per repetition; planes alternate order."""
    rng = random.Random(0)
    out: dict[tuple[str, int], list[list[float]]] = {(op, i): [] for i in range(len(planes)) for op in OPS}
    clients = [httpx.Client(base_url=p.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120,
                            trust_env=False) for p in planes]
    try:
        for i, plane in enumerate(planes):  # warm-up: connections, routes, caches
            for op in OPS:
                request_once(plane, clients[i], loop, op, data, rng)
        for rep in range(reps):
            order = list(range(len(planes)))
            order = order if rep % 2 == 0 else order[::-1]
            for i in order:
                for op in OPS:
                    out[(op, i)].append([request_once(planes[i], clients[i], loop, op, data, rng)
                                         for _ in range(per_rep[op])])
    finally:
        for client in clients:
            client.close()
    return out


WRITES = ("change", "register", "free")
"""The write-through (`RegistryStore.write_through`, what the backend calls after every change)
after one record's step changed, after a registration, and after that adapter's slot was
freed (the change moves a record between the live and the finished lists)."""


def time_saves(planes: list[Plane], loop: LoopThread, per_rep: tuple[int, int],
               reps: int) -> dict[int, list[dict[str, float]]]:
    """Per plane, per repetition: the median seconds of each of `WRITES` (`per_rep`: step
    changes, registrations); run on the controllers' loop, as the backend persists."""
    out: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(planes))}

    async def saves(plane: Plane) -> dict[str, float]:
        backend, store = plane.controller.backend, plane.controller.store
        registry = backend.registry
        assert store is not None
        times: dict[str, list[float]] = {part: [] for part in WRITES}

        def write(part: str) -> None:
            start = time.perf_counter()
            store.write_through(registry)
            times[part].append(time.perf_counter() - start)

        store.write_through(registry)  # in step with this registry (a replaced one is written whole once)
        name = next(iter(registry.live_slots()))
        for _ in range(per_rep[0]):
            registry.set_step(name, registry.step(name) + 1)
            write("change")
        config = resolve_adapter_config("probe", {"data": plane.data, "num_step": 1}, backend.defaults)
        for _ in range(per_rep[1]):
            registry.register("probe", config)
            write("register")
            registry.deregister("probe")
            registry.retire_adapters()
            registry.free_slot("probe")
            write("free")
        return {part: statistics.median(values) for part, values in times.items()}

    for rep in range(reps):
        order = list(range(len(planes)))
        for i in order if rep % 2 == 0 else order[::-1]:
            out[i].append(loop.call(saves(planes[i])))
    return out


def snapshot_registry(n_live: int, defaults: AdapterDefaults, data: str) -> AdapterRegistry:
    """`n_live` ACTIVE adapters (one slot each) and `COMPLETED_RETENTION` finished names."""
    registry = AdapterRegistry(n_live + 1)
    config = resolve_adapter_config("snap", {"data": data, "num_step": 1}, defaults)
    for i in range(COMPLETED_RETENTION):
        name = f"done-{i:05d}"
        registry.register(name, config.model_copy(update={"save": f"{config.save}-{name}"}))
        registry.deregister(name)
        registry.retire_adapters()
        registry.free_slot(name)
    for i in range(n_live):
        name = f"live-{i:05d}"
        registry.register(name, config.model_copy(update={"save": f"{config.save}-{name}"}))
    registry.record_weight_update([f"live-{i:05d}" for i in range(n_live)])
    return registry


def time_snapshots(sizes: list[int], defaults: AdapterDefaults, data: str, per_rep: int,
                   reps: int) -> tuple[dict[int, int], dict[int, list[float]]]:
    """Bytes of the snapshot as Ray serialises it, and seconds to build and serialise it."""
    from ray import cloudpickle  # what Ray pickles task arguments and return values with

    registries = {n: snapshot_registry(n, defaults, data) for n in sizes}
    nbytes = {n: len(cloudpickle.dumps(r.snapshot(), protocol=pickle.HIGHEST_PROTOCOL)) for n, r in registries.items()}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps):
        for n in sizes if rep % 2 == 0 else sizes[::-1]:
            samples = []
            for _ in range(per_rep):
                start = time.perf_counter()
                pickle.loads(cloudpickle.dumps(registries[n].snapshot(), protocol=pickle.HIGHEST_PROTOCOL))
                samples.append(time.perf_counter() - start)
            times[n].append(statistics.median(samples))
    return nbytes, times


def p99s(samples: list[list[float]]) -> list[float]:
    return [percentile(rep, 99) for rep in samples]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], default_reps=3)
    parser.add_argument("--sizes", default="10,1000,10000", help="registrations made before the measurement")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.sizes = 1, "10,100"
    sizes = [int(s) for s in args.sizes.split(",")]
    small, big = sizes[0], sizes[-1]
    cases = [Case(n, COMPLETED_RETENTION) for n in sizes]
    if big > COMPLETED_RETENTION:
        cases.append(Case(big, big))
    per_rep = ({"register": 3, "status": 10, "list": 2, "list_all": 2, "metrics": 2} if args.quick
               else {"register": 8, "status": 50, "list": 20, "list_all": 10, "metrics": 10})
    save_reps, snapshot_reps = ((3, 1), 3) if args.quick else ((30, 2), 20)
    snapshot_sizes = [8, 64] if args.quick else [8, 1000]

    workdir = Path(tempfile.mkdtemp(prefix="control_plane_scale_"))
    data = str(write_datasets(workdir / "data", n=1)[0])
    loop = LoopThread()
    started = time.perf_counter()
    planes = [start_plane(case, workdir / f"plane{i}", data) for i, case in enumerate(cases)]
    for plane in planes:
        port = loop.call(plane.controller.start())
        plane.url = f"http://127.0.0.1:{port}"
    print(f"{len(planes)} control planes filled and serving in {time.perf_counter() - started:.1f} s: "
          + ", ".join(p.case.label for p in planes), flush=True)
    try:
        latencies = time_http(planes, loop, data, per_rep, args.reps)
        saves = time_saves(planes, loop, save_reps, args.reps)
    finally:
        for plane in planes:
            loop.call(plane.controller.stop())
        loop.close()
    nbytes, snapshot_times = time_snapshots(snapshot_sizes, defaults_for(workdir), data, snapshot_reps, args.reps)

    figures: list[Figure] = []
    print_table(planes, latencies, saves, nbytes, snapshot_times)
    for i, plane in enumerate(planes):
        if plane.case.registrations != big or i == 0:
            continue
        for op in OPS:
            figures.append(Figure(
                figure=f"control plane p99 latency of {OP_PATHS[op]}, {plane.case.label} ÷ {small:,} registrations",
                model=args.model, ours_label=f"{plane.case.kept:,} records", baseline_label=f"{small:,} records",
                ours=p99s(latencies[(op, i)]), baseline=p99s(latencies[(op, 0)]), unit="ms",
                ratio_of="ours/baseline", target=TARGETS[op],
                params={"requests_per_repetition": per_rep[op], "records_kept": plane.case.kept,
                        "retention": plane.case.retention,
                        **{f"p{q}_ms": {str(planes[j].case.kept): percentile(pooled(latencies[(op, j)]), q)
                                        for j in (0, i)} for q in (50, 99)}}))
        for part, what in (("change", "one record changed"), ("register", "a registration"),
                           ("free", "a slot freed")):
            ms = {j: [rep[part] * 1e3 for rep in saves[j]] for j in (0, i)}
            figures.append(Figure(
                figure=f"registry write-through (RegistryStore.write_through) after {what}, "
                       f"{plane.case.label} ÷ {small:,} registrations",
                model=args.model, ours_label=f"{plane.case.kept:,} records", baseline_label=f"{small:,} records",
                ours=ms[i], baseline=ms[0], unit="ms", ratio_of="ours/baseline", target="report",
                params={"records_kept": plane.case.kept, "retention": plane.case.retention,
                        "saves_per_s": {str(planes[j].case.kept): 1e3 / statistics.median(ms[j]) for j in ms}}))
    lo, hi = snapshot_sizes
    figures.append(Figure(
        figure=f"driver snapshot (build + Ray's cloudpickle + unpickle), {hi:,} live adapters ÷ {lo:,}",
        model=args.model, ours_label=f"{hi:,} live, {nbytes[hi]:,} bytes", baseline_label=f"{lo:,} live, "
        f"{nbytes[lo]:,} bytes", ours=[t * 1e3 for t in snapshot_times[hi]],
        baseline=[t * 1e3 for t in snapshot_times[lo]], unit="ms", ratio_of="ours/baseline", target="report",
        params={"bytes": {str(n): b for n, b in nbytes.items()}, "finished_names": COMPLETED_RETENTION,
                "bytes_per_live_adapter": (nbytes[hi] - nbytes[lo]) / (hi - lo)}))
    report(figures, args.json, sys.argv)


def pooled(samples: list[list[float]]) -> list[float]:
    return list(itertools.chain.from_iterable(samples))


def print_table(planes: list[Plane], latencies: dict[tuple[str, int], list[list[float]]],
                saves: dict[int, list[dict[str, float]]], nbytes: dict[int, int],
                snapshot_times: dict[int, list[float]]) -> None:
    for i, plane in enumerate(planes):
        cells = [f"{op} " + "/".join(f"{percentile(pooled(latencies[(op, i)]), q):.2f}" for q in (50, 99))
                 for op in OPS]
        print(f"{plane.case.label}: p50/p99 ms " + ", ".join(cells))
    for i, plane in enumerate(planes):
        ms = {part: statistics.median(rep[part] for rep in saves[i]) * 1e3 for part in WRITES}
        print(f"registry write-through, {plane.case.kept:,} records kept: one record changed {ms['change']:.2f} ms "
              f"({1e3 / ms['change']:.0f} saves/s); a registration {ms['register']:.2f} ms; a slot freed "
              f"{ms['free']:.2f} ms")
    for n, size in nbytes.items():
        print(f"snapshot with {n:,} live adapters and {COMPLETED_RETENTION:,} finished names: {size:,} bytes, "
              f"build + serialise + deserialise {statistics.median(snapshot_times[n]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
