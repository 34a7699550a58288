"""A discrete-event simulation of the multi-LoRA loop and its control plane, driven by measured costs.

    python scripts/scaling_sim.py                                   # N 8..4096 adapters, E 1..256 engines
    python scripts/scaling_sim.py --adapters 8,64 --engines 1,4 --iterations 5 --json out.json
    python scripts/scaling_sim.py --train-s 30 --generate-s 30 --adapter-mb 161 --link-gbps 100  # a cluster

What is simulated (docs/SCALING.md says why each piece is there):

- the driver loop, one iteration after another: snapshot, reconcile, push the adapters
  that stepped to E engines, generate, train, commit, save. Every controller call queues
  at the controller; the push runs behind generate and train (`--overlap-weight-push`,
  the default), so the iteration waits only for what is left of it;
- the controller: one event loop, one request at a time (FIFO). Its clients: the driver's
  calls (each builds and serialises a snapshot of N live adapters and writes the registry
  through to SQLite), the producer's snapshot poll every 0.1 s, and HTTP users:
  registrations (each followed, when its adapter finishes, by a slot release), status
  reads, listings, and a Prometheus scrape every 15 s;
- the push: `in_place` sends each stepped adapter over one weights-update group per
  engine, in turn, from the exporting train rank (E x the bytes through its link);
  `versioned` puts the tensors in Ray's object store once and every engine pulls them and
  loads a PEFT directory (the bytes reach E engines in about log2(E + 1) rounds of copies).

Costs are read from docs/benchmarks.json (the figures of scripts/bench/trainer_service.py
and scripts/bench/control_plane_scale.py) where present, else the defaults below, each
naming the figure it came from. Costs that grow with the registry are linear fits through
the two sizes each benchmark measured. Prints, per push mode and mitigation, the first
grid point where the loop's overhead exceeds 5 % of an iteration (the benchmarks' target)
or the controller is busy more than 80 % of the time, and what dominated there.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OVERHEAD_TARGET = 0.05
CONTROLLER_BUSY_LIMIT = 0.8
MITIGATIONS = ("none", "incremental_store", "incremental_snapshot", "parallel_push", "all")


@dataclass(frozen=True)
class Line:
    """A cost `fixed + per_unit * n` (seconds or bytes), and where it was measured."""

    fixed: float
    per_unit: float
    source: str

    def at(self, n: float) -> float:
        return max(0.0, self.fixed + self.per_unit * n)

    @classmethod
    def through(cls, n0: float, y0: float, n1: float, y1: float, source: str) -> Line:
        slope = (y1 - y0) / (n1 - n0)
        return cls(y0 - slope * n0, slope, source)


@dataclass(frozen=True)
class Costs:
    """Measured costs (defaults: the figures in docs/benchmarks.json on the 2-core CPU machine)."""

    generate_s: float = 0.256
    """the rest of an iteration, tiny demo: perf/iteration_time 0.632 - train 0.361 - loop overhead
    0.0154 s (trainer_service.py --model tiny: generate and the wait for a full batch)."""
    train_s: float = 0.361
    """train stage, tiny demo (same run: perf/train_time median)."""
    stepped_per_iteration: int = 3
    """adapters stepped per iteration, tiny demo (bytes pushed 0.836 MB ÷ 0.279 MB per adapter)."""
    adapter_bytes: float = 278_528
    """LoRA bytes of one tiny-demo adapter (trainer_service.py: params.adapter_bytes)."""
    push_bytes_per_s: float = 0.836e6 / 0.577
    """in_place push to one engine: 0.836 MB in perf/push_time 0.577 s (gloo on CPU, tiny demo)."""
    versioned_load_s: float = 0.0
    """per adapter per engine on top of the bytes (writing and loading a PEFT directory); not
    measured: 0 unless given."""
    loop_stage_s: float = 0.0015 + 0.0057
    """reconcile + commit stages with 3 adapters (trainer_service.py: perf/reconcile_time, commit_time)."""
    snapshot: Line = Line(0.0006, 1.2e-5, "control_plane_scale.py: snapshot build+pickle+unpickle, 8 vs 64 live")
    """seconds per controller call that returns a snapshot, by live adapters."""
    snapshot_bytes: Line = Line(14_500, 330, "control_plane_scale.py --quick: cloudpickle bytes, 8 vs 64 live")
    """bytes of one snapshot as Ray serialises it, by live adapters (1,024 finished names in it)."""
    write_through: Line = Line(0.0001, 2.0e-6, "control_plane_scale.py: export_state + save, one record changed")
    """seconds per registry change, by records kept."""
    register: Line = Line(0.008, 6.0e-4, "control_plane_scale.py: POST /adapter_runs p50 (quick run)")
    """seconds of a registration at the controller, by records kept (write-through included)."""
    release: Line = Line(0.0004, 7.0e-5, "control_plane_scale.py: write-through after a slot freed")
    """seconds of the slot release when a registered adapter finishes, by records kept."""
    status_s: float = 0.003
    """GET /adapter_runs/{name} p50 (control_plane_scale.py)."""
    listing: Line = Line(0.003, 7.0e-5, "control_plane_scale.py: GET /adapter_runs p50")
    metrics: Line = Line(0.006, 6.0e-5, "control_plane_scale.py: GET /metrics p50")
    sources: dict[str, str] = field(default_factory=dict)
    """Which defaults were replaced by figures read from a benchmarks.json."""


@dataclass(frozen=True)
class Load:
    """What the users and the loop ask of the controller (not measured: the scenario)."""

    registrations_per_s: float = 0.1
    status_per_s: float = 5.0
    list_per_s: float = 0.2
    metrics_period_s: float = 15.0
    producer_poll_s: float = 0.1
    """The producer's snapshot poll (miles/rollout/producer.py ProducerConfig.snapshot_poll_s)."""
    retention: int = 1024
    """Finished records kept (miles/controller/registry.py COMPLETED_RETENTION)."""
    driver_calls: int = 6
    """Controller calls of one iteration that return a snapshot and write the registry through
    (snapshot, and `apply` of RetireAdapters, BeginWeightUpdate, RecordWeightUpdate, RecordBatch,
    MarkBatchTrained: miles/main/*.py, miles/rollout/collection.py)."""


def load_costs(paths: list[Path]) -> Costs:
    """The defaults, replaced by the figures the `paths` hold (trainer_service on tiny,
    control_plane_scale): a `benchmarks.json` of run_all.py or one script's `--json` output;
    a figure in a later file wins."""
    costs = Costs()
    figures: list[dict[str, Any]] = []
    for path in paths:
        if path.exists():
            payload = json.loads(path.read_text())
            figures = [{"command": payload.get("command", ""), **f} for f in payload["figures"]][::-1] + figures
    found: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def pick(prefix: str, model: str | None = None) -> dict[str, Any] | None:
        for f in figures:
            if f["figure"].startswith(prefix) and (model is None or f["model"] == model):
                return f
        return None

    overhead = pick("loop overhead", "tiny")
    if overhead:
        stages = overhead["params"]["stages_median_s"]
        found.update(generate_s=stages["iteration_time"] - stages["train_time"] - overhead["ours_median"],
                     train_s=stages["train_time"], loop_stage_s=stages["reconcile_time"] + stages["commit_time"])
        sources["generate_s, train_s, loop_stage_s"] = overhead["command"]
    pushed = pick("bytes pushed", "tiny")
    push = pick("weight push on the loop's path", "tiny")
    if pushed and push:
        per_adapter = pushed["params"]["adapter_bytes"]
        found.update(adapter_bytes=per_adapter, stepped_per_iteration=round(pushed["ours_median"] * 1e6 / per_adapter),
                     push_bytes_per_s=pushed["ours_median"] * 1e6 / push["params"]["push_time_median_s"])
        sources["adapter_bytes, push_bytes_per_s"] = push["command"]
    snap = pick("driver snapshot")
    if snap:
        n0, n1 = sorted(int(n) for n in snap["params"]["bytes"])
        found["snapshot"] = Line.through(n0, snap["baseline_median"] / 1e3, n1, snap["ours_median"] / 1e3,
                                         snap["command"])
        nbytes = snap["params"]["bytes"]
        found["snapshot_bytes"] = Line.through(n0, nbytes[str(n0)], n1, nbytes[str(n1)], snap["command"])
    for key, prefix in (("write_through", "registry write-through (RegistryStore.write_through) after one"),
                        ("register", "control plane p99 latency of POST /adapter_runs,"),
                        ("release", "registry write-through (RegistryStore.write_through) after a slot"),
                        ("listing", "control plane p99 latency of GET /adapter_runs (every record),"),
                        ("metrics", "control plane p99 latency of GET /metrics,")):
        f = _largest(figures, prefix)
        if f is None:
            continue
        small, big = _sizes(f)
        if "p50_ms" in f["params"]:  # a latency figure: fit its p50s (service time, not the tail)
            y = f["params"]["p50_ms"]
            found[key] = Line.through(small, y[str(small)] / 1e3, big, y[str(big)] / 1e3, f["command"])
        else:
            found[key] = Line.through(small, f["baseline_median"] / 1e3, big, f["ours_median"] / 1e3, f["command"])
    status = _largest(figures, "control plane p99 latency of GET /adapter_runs/{name},")
    if status:
        found["status_s"] = min(status["params"]["p50_ms"].values()) / 1e3
    sources.update({key: value.source for key, value in found.items() if isinstance(value, Line)})
    return replace(costs, **found, sources=sources)


def _largest(figures: list[dict[str, Any]], prefix: str) -> dict[str, Any] | None:
    """The figure named `prefix...` measured with the most records kept."""
    matching = [f for f in figures if f["figure"].startswith(prefix)
                and ("p50_ms" in f.get("params", {}) or "saves_per_s" in f.get("params", {}))]
    return max(matching, key=lambda f: _sizes(f)[1], default=None)


def _sizes(f: dict[str, Any]) -> tuple[int, int]:
    """The records kept on the two sides of a control_plane_scale figure (baseline, ours)."""
    small, big = sorted(int(k) for k in (f["params"].get("p50_ms") or f["params"]["saves_per_s"]))
    return small, big


# ---- the event loop -------------------------------------------------------------------------


Process = Generator[tuple[str, float], None, None]
"""A process yields ("sleep", seconds) or ("call", service seconds at the controller)."""


class Simulation:
    """A heap of timed events and one FIFO server, the controller."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Process]] = []
        self._seq = 0
        self._queue: list[tuple[Process, float, float]] = []
        """(process, service seconds, arrival time) waiting for the controller."""
        self._busy_until = 0.0
        self.busy_s = 0.0
        self.waits: dict[str, list[float]] = {}

    def start(self, process: Process, at: float = 0.0) -> None:
        self._schedule(at, process)

    def _schedule(self, at: float, process: Process) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, process))

    def _step(self, process: Process) -> None:
        try:
            kind, value = next(process)
        except StopIteration:
            return
        if kind == "sleep":
            self._schedule(self.now + value, process)
        else:  # a controller call: served after those queued before it
            start = max(self.now, self._busy_until)
            self._busy_until = start + value
            self.busy_s += value
            self._schedule(self._busy_until, process)

    def run(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            self.now, _, process = heapq.heappop(self._events)
            self._step(process)


@dataclass
class Point:
    """One grid point's outcome."""

    adapters: int
    engines: int
    mode: str
    mitigation: str
    iteration_s: float
    overhead_share: float
    """(iteration - generate - train) ÷ iteration."""
    controller_busy: float
    """Fraction of the simulated time the controller served requests."""
    controller_s: float
    """Seconds per iteration the driver spent in controller calls (queueing included)."""
    push_s: float
    """Seconds of one iteration's push (it overlaps generate and train)."""
    push_wait_s: float
    """Seconds the iteration waited for the push after generate and train."""
    registration_s: float
    """Mean seconds from a registration's arrival to its answer (queueing included)."""
    snapshot_bytes: int
    bottleneck: str


def simulate(n: int, engines: int, mode: str, costs: Costs, load: Load, *, iterations: int = 10,
             mitigation: str = "none", seed: int = 0) -> Point:
    """Run `iterations` loop iterations with `n` live adapters and `engines` engines."""
    mitigated = {mitigation} if mitigation != "all" else set(MITIGATIONS)
    records = n + min(load.retention, 10 * n)  # live ones and the finished ones kept
    changed = min(n, costs.stepped_per_iteration)  # an incremental snapshot carries the changed views only
    snapshot_s = costs.snapshot.at(n if "incremental_snapshot" not in mitigated else changed)
    write_s = costs.write_through.at(records if "incremental_store" not in mitigated else 10)
    register_s = costs.register.at(records if "incremental_store" not in mitigated else 10)
    release_s = costs.release.at(records if "incremental_store" not in mitigated else 10)
    stepped = min(n, costs.stepped_per_iteration)
    push_bytes = stepped * costs.adapter_bytes
    if mode == "in_place":
        fan_out = engines if "parallel_push" not in mitigated else math.ceil(math.log2(engines + 1))
        push_s = push_bytes * fan_out / costs.push_bytes_per_s
    else:
        rounds = math.ceil(math.log2(engines + 1))  # object-store copies: each holder can serve another
        push_s = push_bytes * rounds / costs.push_bytes_per_s + stepped * costs.versioned_load_s
    sim, rng = Simulation(), random.Random(seed)
    driver: dict[str, list[float]] = {"iteration": [], "controller": [], "push_wait": []}
    registrations: list[float] = []
    done = [False]

    def driver_loop() -> Process:
        push_done = 0.0
        for _ in range(iterations):
            start, in_controller = sim.now, 0.0
            for _ in range(load.driver_calls):
                before = sim.now
                yield "call", snapshot_s + write_s
                in_controller += sim.now - before
            yield "sleep", costs.loop_stage_s
            push_done = sim.now + push_s  # pushed behind generate and train
            yield "sleep", costs.generate_s + costs.train_s
            wait = max(0.0, push_done - sim.now)
            yield "sleep", wait
            driver["iteration"].append(sim.now - start)
            driver["controller"].append(in_controller)
            driver["push_wait"].append(wait)
        done[0] = True

    def every(period: float, service: float) -> Process:
        while not done[0]:
            yield "call", service
            yield "sleep", period

    def poisson(rate: float, service: float, record: list[float] | None = None) -> Process:
        while not done[0] and rate > 0:
            yield "sleep", rng.expovariate(rate)
            arrived = sim.now
            yield "call", service
            if record is not None:
                record.append(sim.now - arrived)

    sim.start(driver_loop())
    sim.start(every(load.producer_poll_s, snapshot_s))
    sim.start(every(load.metrics_period_s, costs.metrics.at(records)))
    sim.start(poisson(load.registrations_per_s, register_s + release_s, registrations))
    sim.start(poisson(load.status_per_s, costs.status_s))
    sim.start(poisson(load.list_per_s, costs.listing.at(records)))
    sim.run(until=float("inf") if iterations else 0.0)
    elapsed = sum(driver["iteration"])
    iteration = elapsed / iterations
    overhead = iteration - costs.generate_s - costs.train_s
    controller = sum(driver["controller"]) / iterations
    push_wait = sum(driver["push_wait"]) / iterations
    busy = min(1.0, sim.busy_s / elapsed)
    if busy > CONTROLLER_BUSY_LIMIT:
        bottleneck = "controller saturated"
    elif overhead / iteration > OVERHEAD_TARGET:
        bottleneck = "push" if push_wait >= controller else "controller calls"
    else:
        bottleneck = "none"
    return Point(n, engines, mode, mitigation, iteration, overhead / iteration, busy, controller, push_s, push_wait,
                 sum(registrations) / len(registrations) if registrations else 0.0,
                 round(costs.snapshot_bytes.at(n)), bottleneck)


def grid(adapters: list[int], engines: list[int], modes: list[str], mitigations: list[str], costs: Costs,
         load: Load, iterations: int) -> Iterator[Point]:
    for mitigation in mitigations:
        for mode in modes:
            for e in engines:
                for n in adapters:
                    yield simulate(n, e, mode, costs, load, iterations=iterations, mitigation=mitigation)


def first_bottlenecks(points: list[Point]) -> list[dict[str, Any]]:
    """Per (mitigation, mode): the smallest grid point (by N, then E) where a bottleneck shows."""
    out = []
    for key in dict.fromkeys((p.mitigation, p.mode) for p in points):
        hit = [p for p in points if (p.mitigation, p.mode) == key and p.bottleneck != "none"]
        first = min(hit, key=lambda p: (p.adapters * p.engines, p.adapters), default=None)
        out.append({"mitigation": key[0], "mode": key[1],
                    "first": None if first is None else {"adapters": first.adapters, "engines": first.engines,
                                                         "bottleneck": first.bottleneck,
                                                         "overhead_share": first.overhead_share,
                                                         "controller_busy": first.controller_busy}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", default="8,32,128,512,1024,4096", help="live adapters N (comma list)")
    parser.add_argument("--engines", default="1,4,16,64,256", help="engines E (comma list)")
    parser.add_argument("--modes", default="in_place,versioned")
    parser.add_argument("--mitigations", default=",".join(MITIGATIONS))
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--benchmarks", type=Path, nargs="+", default=[ROOT / "docs" / "benchmarks.json"],
                        help="measured costs: benchmarks.json files or --json outputs of trainer_service.py and "
                             "control_plane_scale.py (a later file wins)")
    parser.add_argument("--train-s", type=float, help="train stage seconds (default: measured, tiny demo)")
    parser.add_argument("--generate-s", type=float, help="generate stage seconds (default: measured, tiny demo)")
    parser.add_argument("--stepped", type=int, help="adapters stepped per iteration (default: measured, tiny demo)")
    parser.add_argument("--adapter-mb", type=float, help="LoRA MB of one adapter (default: measured, tiny demo)")
    parser.add_argument("--link-gbps", type=float, help="push link Gbit/s (default: measured gloo push on CPU)")
    parser.add_argument("--registrations-per-s", type=float, default=Load.registrations_per_s)
    parser.add_argument("--json", type=Path, help="write every grid point and the first bottlenecks here")
    args = parser.parse_args(argv)
    costs = load_costs(args.benchmarks)
    overrides: dict[str, Any] = {}
    for flag, key, scale in (("train_s", "train_s", 1.0), ("generate_s", "generate_s", 1.0),
                             ("stepped", "stepped_per_iteration", 1), ("adapter_mb", "adapter_bytes", 1e6),
                             ("link_gbps", "push_bytes_per_s", 1e9 / 8)):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag) * scale
    costs = replace(costs, **overrides)
    load = Load(registrations_per_s=args.registrations_per_s)
    points = list(grid([int(x) for x in args.adapters.split(",")], [int(x) for x in args.engines.split(",")],
                       args.modes.split(","), args.mitigations.split(","), costs, load, args.iterations))
    print(f"{'mitigation':21s} {'mode':9s} {'N':>5s} {'E':>4s} {'iter s':>8s} {'overhead':>8s} {'ctl busy':>8s} "
          f"{'ctl s/it':>8s} {'push s':>8s} {'reg s':>7s}  bottleneck")
    for p in points:
        print(f"{p.mitigation:21s} {p.mode:9s} {p.adapters:5d} {p.engines:4d} {p.iteration_s:8.3f} "
              f"{p.overhead_share:8.3f} {p.controller_busy:8.3f} {p.controller_s:8.4f} {p.push_s:8.3f} "
              f"{p.registration_s:7.3f}  {p.bottleneck}")
    firsts = first_bottlenecks(points)
    print("\nFirst bottleneck (smallest N x E where overhead > 5 % of an iteration or the controller is > 80 % busy):")
    for row in firsts:
        first = row["first"]
        where = "none on this grid" if first is None else (
            f"N={first['adapters']}, E={first['engines']}: {first['bottleneck']} (overhead "
            f"{first['overhead_share']:.2f}, controller busy {first['controller_busy']:.2f})")
        print(f"  {row['mitigation']:21s} {row['mode']:9s} {where}")
    if args.json:
        args.json.write_text(json.dumps({"costs": _jsonable(costs), "load": asdict(load),
                                         "points": [asdict(p) for p in points], "first_bottlenecks": firsts},
                                        indent=1))
    return 0


def _jsonable(costs: Costs) -> dict[str, Any]:
    return {k: asdict(v) if isinstance(v, Line) else v for k, v in costs.__dict__.items()}


if __name__ == "__main__":
    sys.exit(main())
