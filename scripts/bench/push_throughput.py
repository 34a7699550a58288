"""Weight-push throughput (MB/s) to a builtin engine ÷ a plain loopback TCP copy of the same bytes.

    python scripts/bench/push_throughput.py [--model tiny|llama60m|smollm2|DIR] [--adapters 2]
                                            [--rank 16] [--reps 5] [--train-batch 32]

Drives the trainer's push path without the rest of the trainer: a real torch train rank
(`TrainGroup`, one Ray actor) holds `--adapters` adapters of rank `--rank` on all linears
and exports them; `EnginePusher` pushes them to one builtin engine per mode (an
`EngineFleet` with `lora_update=in_place` and one with `versioned`, each behind its
router), a new version every time. Each push is timed from `pusher.push` to its return
(what `perf/push_time` counts), quiet and with a train call of `--train-batch` samples on
the same train rank running beside it (as `--overlap-weight-push` runs them: the push
starts once the train call has). The baseline, alternating with the pushes: the same
number of bytes sent over a TCP connection on 127.0.0.1 to a server thread of this
process that reads them and answers one byte, quiet and beside the same train call.
Figures: push MB/s ÷ loopback MB/s, per mode, quiet and beside training (target >= 0.25).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable

import benchlib
from benchlib import Figure

from miles.backends.base import AdapterSpec
from miles.backends.common.train_group import TrainGroupConfig
from miles.backends.torch.actor import TrainActorConfig
from miles.backends.torch.train_group import torch_train_group
from miles.main.engine_push import EnginePusher
from miles.rollout.engines.fleet import EngineFleet, EngineFleetConfig
from miles.rollout.engines.server_command import EngineServerConfig
from miles.utils.types import RolloutBatch, Sample

MODES = ("in_place", "versioned")


class LoopbackCopy:
    """A server thread on 127.0.0.1 (port 0) that reads `n` bytes and answers one byte; `copy()`
    sends `n` bytes over one kept connection and waits for the answer."""

    def __init__(self, n: int) -> None:
        self.n, self.payload = n, random.Random(0).randbytes(n)
        listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(listener.getsockname())
        self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn, _ = listener.accept()
        listener.close()
        self._thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
        self._thread.start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        with conn:
            while True:
                left = self.n
                while left:
                    got = conn.recv_into(buf, min(left, len(buf)))
                    if not got:
                        return
                    left -= got
                conn.sendall(b"k")

    def copy(self) -> None:
        self.client.sendall(self.payload)
        if self.client.recv(1) != b"k":
            raise RuntimeError("the loopback server closed the connection")

    def close(self) -> None:
        self.client.close()
        self._thread.join(timeout=5)


class _Call:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


class FleetManager:
    """The rollout-manager methods a pusher calls, over a fleet in this process (no groups in flight)."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.update_group_layout = _Call(fleet.update_group_layout)
        self.versions_in_flight = _Call(dict)
        self.record_push = _Call(fleet.record_push)
        self.forget_slot = _Call(fleet.forget_slot)


def train_batch(names: list[str], slots: dict[str, int], n: int, vocab: int, rollout_id: int) -> RolloutBatch:
    """`n` samples in groups of two (rewards differ within a group), spread over the adapters."""
    rng = random.Random(rollout_id)
    samples = [Sample(adapter=names[(i // 2) % len(names)], slot=slots[names[(i // 2) % len(names)]],
                      group_index=i // 2, index=i % 2, prompt="", label=None, metadata={},
                      prompt_ids=[rng.randrange(3, vocab) for _ in range(16)],
                      response_ids=[rng.randrange(3, vocab) for _ in range(48)], reward=float(i % 2))
               for i in range(n)]
    groups: dict[str, int] = {}
    for s in samples[::2]:
        groups[s.adapter] = groups.get(s.adapter, 0) + 1
    return RolloutBatch(rollout_id=rollout_id, samples=samples, prompt_group_sizes=[2] * (n // 2),
                        groups_per_adapter=groups, step_names=list(groups))


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def beside(train: Callable[[], Awaitable[object]], fn: Callable[[], Awaitable[object]]) -> float:
    """Time `fn` started once a train call has started on the train rank; wait for both."""
    training = asyncio.ensure_future(train())
    await asyncio.sleep(0.05)  # the call has reached the rank
    try:
        return await timed(fn)
    finally:
        await training


async def run(args) -> list[Figure]:
    import ray

    path = benchlib.model_dir(args.model)
    vocab = benchlib.vocab_size(path)
    names = [f"a{i}" for i in range(args.adapters)]
    slots = {name: i for i, name in enumerate(names)}
    group = torch_train_group(TrainGroupConfig(
        actor=TrainActorConfig(hf_checkpoint=str(path), n_slots=args.adapters, lora_rank=args.rank,
                               num_threads=args.threads),
        n_workers=1, num_cpus_per_worker=0))
    work = tempfile.TemporaryDirectory()
    fleets = {}

    def fleet_config(mode: str) -> EngineFleetConfig:
        server = EngineServerConfig(kind="builtin", model_path=str(path), n_slots=args.adapters,
                                    max_lora_rank=args.rank, target_modules="all-linear", dtype="float32",
                                    device="cpu", lora_update=mode)
        return EngineFleetConfig(server=server, num_engines=1, work_dir=f"{work.name}/{mode}", start_timeout_s=300)

    started = await asyncio.gather(group.start(), *(EngineFleet.start(fleet_config(m)) for m in MODES))
    fleets = dict(zip(MODES, started[1:]))
    pushers = {mode: EnginePusher(group, fleet.engines, FleetManager(fleet), mode=mode)
               for mode, fleet in fleets.items()}
    loopback = None
    try:
        for name in names:
            await group.load_adapter(AdapterSpec(name=name, slot=slots[name], rank=args.rank,
                                                 alpha=2.0 * args.rank, global_batch_size=args.train_batch, lr=1e-4))
        exports = [await group.export_adapter(name) for name in names]
        nbytes = sum(e.nbytes for e in exports)
        loopback = LoopbackCopy(nbytes)
        version = 0
        rollout = 0

        async def push(mode: str) -> None:
            nonlocal version
            version += 1
            stats = await pushers[mode].push([(slots[n], version, e) for n, e in zip(names, exports)])
            if stats.bytes != nbytes:
                raise RuntimeError(f"{mode} push sent {stats.bytes} bytes, expected {nbytes}")

        async def copy() -> None:
            await asyncio.to_thread(loopback.copy)

        async def train() -> None:
            nonlocal rollout
            rollout += 1
            await group.train(rollout, train_batch(names, slots, args.train_batch, vocab, rollout))

        cases: dict[str, Callable[[], Awaitable[float]]] = {}
        for label, fn in (*((m, (lambda m=m: push(m))) for m in MODES), ("loopback", copy)):
            cases[f"{label} quiet"] = lambda fn=fn: timed(fn)
            cases[f"{label} beside training"] = lambda fn=fn: beside(train, fn)
        for _ in range(args.warmup):
            for case in cases.values():
                await case()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(args.reps):
            for name in (list(cases) if rep % 2 == 0 else list(reversed(cases))):
                times[name].append(await cases[name]())
    finally:
        if loopback is not None:
            loopback.close()
        for pusher in pushers.values():
            await pusher.close()
        await asyncio.gather(group.shutdown(), *(f.shutdown() for f in fleets.values()), return_exceptions=True)
        work.cleanup()
        ray.shutdown()
    mb = nbytes / 1e6
    rate = {name: [mb / t for t in ts] for name, ts in times.items()}
    for name, ts in times.items():
        print(f"  {name}: median {statistics.median(ts):.4f} s ({mb / statistics.median(ts):.1f} MB/s)")
    params = {"adapters": args.adapters, "rank": args.rank, "bytes_per_push": nbytes,
              "train_batch": args.train_batch, "engines_per_mode": 1}
    return [
        Figure(figure=f"weight push MB/s ({mode}, {when}) ÷ loopback TCP copy of the same bytes",
               model=args.model, ours_label=f"push {mode}", baseline_label="loopback copy",
               ours=rate[f"{mode} {when}"], baseline=rate[f"loopback {when}"], unit="MB/s",
               ratio_of="ours/baseline", target=">= 0.25", params={**params, "mode": mode, "when": when})
        for when in ("quiet", "beside training") for mode in MODES
    ]


def main() -> None:
    parser = benchlib.base_parser(__doc__)
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--train-batch", type=int, default=32, help="samples of the train call beside a push")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    benchlib.setup(args)
    if args.quick:
        args.adapters, args.rank, args.train_batch, args.warmup = 1, 4, 4, 0
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="miles",
             runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    figures = asyncio.run(run(args))
    benchlib.report(figures, args.json, sys.argv)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
