"""Figures of a running trainer: weight push, loop overhead, registration latency, load.

    python scripts/bench/trainer_service.py --model tiny             # the demo's settings
    python scripts/bench/trainer_service.py --model smollm2 --warmup 1 --iterations 3 --phases steady
    python scripts/bench/trainer_service.py --quick                  # smoke run (CI)

Starts `python -m miles.main.train_multi_lora_async` as a subprocess in service mode on
loopback, with the settings of the model's demo (`configs/tiny-multi-lora.yaml` or
`configs/smollm2-multi-lora.yaml`, its adapters left out), POSTs the demo's adapters over
HTTP as a user would, and reads the loop's own timings from the run's `metrics.jsonl`:
one loop record per trained batch with each stage's seconds (`perf/snapshot_time`,
`reconcile`, `update_weights`, `generate`, `train`, `commit`, `save`), the wall time
since the previous record (`perf/iteration_time`), the engine push (`perf/push_time`,
`perf/push_bytes` per engine, `perf/push_adapters`) and `perf/stepped_adapters`.

Phases of the one run; each figure is a ratio of two things measured in that run, one
ratio per iteration or repetition, median with min..max:

1. Steady training of the demo adapters: `--iterations` loop records after
   `--warmup` give weight push ÷ train (the time the loop spends on the push: the
   update_weights stage, export + push + record, plus the wait at the end of the
   iteration for a push that ran behind generate and train (`--overlap-weight-push`,
   the trainer's default), ÷ the train stage of the same iteration; the push's own
   duration is in the figure's params); bytes pushed ÷ LoRA bytes of the
   adapters the previous iteration stepped (rank x (in + out) of every targeted linear
   in float32, computed from the model's config.json, not from the push: must be 1);
   loop overhead ÷ iteration (iteration - generate - train: snapshot, reconcile, push,
   commit, save and the record itself).
2. Registration: `--reps` times, POST a new adapter (num_step 1) while the demo adapters
   train and poll its status every 20 ms: POST -> ACTIVE and POST -> first optimizer
   step, each ÷ the median iteration of the loop records written meanwhile.
3. Load: `scripts/bench/control_plane_load.py`'s mix (reads, registrations of small
   datasets, deletions), `--load-requests` at `--load-concurrency`, while the demo
   adapters train. Reported: requests/s, p50/p99, 5xx (must be 0), and the trainer's
   iteration time during the load ÷ before it. Then every load adapter is deleted and
   checked: the trainer kept stepping during the load, the registry over HTTP is
   consistent (`check_http_invariants`: slots unique and valid, counters match the
   registrations answered 200), no slot leaked (the free slots take exactly that many
   new registrations, the next is QUEUED), and once the trainer has stopped, the
   registry file it leaves has free and held slots partitioning the slot table.

Exits 1 when a check fails (a 5xx, a leaked slot, a broken invariant, no step during the
load, bytes pushed ≠ LoRA bytes stepped); targets missed are reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, Figure, base_parser, model_dir, report  # noqa: E402

sys.path.insert(0, str(ROOT))
import control_plane_load as load_test  # noqa: E402

from miles.controller.actor import API_URL_LINE  # noqa: E402

TOKEN = "bench-token"
POLL_S = 0.02
DEMOS = {
    "tiny": ("configs/tiny-multi-lora.yaml",
             ["configs/adapters/add.yaml", "configs/adapters/sub.yaml", "configs/adapters/mul.yaml"]),
    "smollm2": ("configs/smollm2-multi-lora.yaml",
                ["configs/adapters/smollm2-next.yaml", "configs/adapters/smollm2-max.yaml"]),
}
LEFT_OUT = ("multi_lora_adapters", "multi_lora_adapter", "multi_lora_disable_service_mode")
QUICK_TRAINER = {"rollout_batch_size": 8, "global_batch_size": 16, "rollout_max_response_len": 4}
QUICK_ADAPTER = {"rollout_batch_size": 2, "n_samples_per_prompt": 2}
LOAD_ADAPTER = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rm_type": "final_number",
                "input_key": "text", "label_key": "label"}


class CheckFailed(RuntimeError):
    pass




# ---- the trainer ---------------------------------------------------------------------------


def lora_nbytes(config: dict[str, Any], rank: int, bytes_per_value: int = 4) -> int:
    """LoRA bytes of one adapter on every linear of a Llama-style decoder (q, k, v, o, gate,
    up, down), from the model's config.json: rank x (in + out) per linear."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    linears = [(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, kv_heads * head_dim),
               (heads * head_dim, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
    return config["num_hidden_layers"] * rank * sum(i + o for i, o in linears) * bytes_per_value


def trainer_config(model: str, workdir: Path, n_slots: int, quick: bool, engine_lora_update: str = "in_place",
                   overlap_weight_push: bool = True) -> Path:
    demo, _ = DEMOS[model]
    cfg = {k: v for k, v in yaml.safe_load((ROOT / demo).read_text()).items() if k not in LEFT_OUT}
    cfg.update(hf_checkpoint=str(model_dir(model)), multi_lora_n_adapters=n_slots, multi_lora_api_port=0,
               multi_lora_api_token=TOKEN, multi_lora_allowed_roots=[str(workdir), str(ROOT)],
               multi_lora_idle_poll_s=0.2, save=str(workdir / "save"), engine_lora_update=engine_lora_update,
               overlap_weight_push=overlap_weight_push)
    if quick:
        cfg.update(QUICK_TRAINER)
    path = workdir / "trainer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def demo_adapters(model: str, quick: bool) -> list[tuple[str, dict[str, Any]]]:
    """The demo's adapters as POST configs (absolute data paths, no step limit)."""
    out = []
    for path in DEMOS[model][1]:
        config = yaml.safe_load((ROOT / path).read_text())
        config.update(data=str(ROOT / config["data"]), num_step=100_000)
        if quick:
            config.update(QUICK_ADAPTER)
        out.append((Path(path).stem, config))
    return out


class Trainer:
    """The trainer subprocess, its control plane and its metrics."""

    def __init__(self, config: Path, workdir: Path) -> None:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        self.log_path = workdir / "trainer.log"
        self.metrics_path = workdir / "save" / "metrics.jsonl"
        self.url = ""
        """The control plane's, once `connect` read it from the log."""
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "miles.main.train_multi_lora_async", "--config",
                                      str(config)], cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60, trust_env=False)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise CheckFailed(f"the trainer exited with {self.proc.returncode}:\n{self.log_tail()}")

    def wait_until(self, what: str, predicate: Any, timeout: float, poll_s: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive()
            value = predicate()
            if value:
                return value
            time.sleep(poll_s)
        raise CheckFailed(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.log_tail()}")

    def connect(self, timeout: float) -> None:
        """Find the control plane (it binds a port the OS picks and logs its URL), then wait until it serves."""
        found = self.wait_until("the control plane's address in the trainer's log",
                                lambda: API_URL_LINE.search(self.log_path.read_text(errors="replace")), timeout,
                                poll_s=0.5)
        self.url = self.http.base_url = found.group(1)
        self.wait_until("the control plane", self.serving, timeout, poll_s=0.5)

    def serving(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def register(self, name: str, config: dict[str, Any]) -> httpx.Response:
        return self.http.post("/adapter_runs", json={"name": name, "config": config})

    def status(self, name: str) -> dict[str, Any]:
        return self.http.get(f"/adapter_runs/{name}").raise_for_status().json()

    def adapters(self) -> list[dict[str, Any]]:
        return self.http.get("/adapter_runs").raise_for_status().json()["adapters"]

    def records(self) -> list[dict[str, Any]]:
        """Every complete record of the run's metrics.jsonl, in the order written."""
        if not self.metrics_path.exists():
            return []
        text = self.metrics_path.read_text()
        lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
        return [json.loads(line) for line in lines if line]

    def loop_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if r["kind"] == "loop"]

    def stop(self, timeout: float = 180.0) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            raise CheckFailed(f"the trainer did not stop within {timeout:.0f}s:\n{self.log_tail()}") from None
        finally:
            self._log.close()


# ---- phases --------------------------------------------------------------------------------


def steady(trainer: Trainer, warmup: int, iterations: int, adapter_bytes: int,
           timeout: float) -> tuple[list[dict[str, float]], list[str]]:
    """`iterations` loop records after `warmup`, each with `stepped_bytes`: the LoRA bytes of
    the adapters the previous iteration stepped, which its push must carry exactly."""
    need = warmup + iterations
    records = trainer.wait_until(f"{need} trained batches", lambda: (r := trainer.loop_records()) and
                                 len(r) >= need and r, timeout)
    window = records[warmup - 1:need]  # one before the window: what it stepped, the first one pushes
    problems, out = [], []
    for previous, record in zip(window, window[1:]):
        m = dict(record["metrics"])
        m["stepped_bytes"] = previous["metrics"]["perf/stepped_adapters"] * adapter_bytes
        if m.get("perf/push_bytes", 0.0) != m["stepped_bytes"]:
            problems.append(f"rollout {record['rollout_id']} pushed {m.get('perf/push_bytes', 0.0):.0f} bytes, "
                            f"the {previous['metrics']['perf/stepped_adapters']:.0f} adapter(s) the previous batch "
                            f"stepped hold {m['stepped_bytes']:.0f}")
        out.append(m)
    return out, problems


def registration(trainer: Trainer, name: str, config: dict[str, Any], timeout: float) -> tuple[float, float, float]:
    """POST -> ACTIVE and POST -> first step (seconds), and the median iteration meanwhile."""
    start_wall, start = time.time(), time.perf_counter()
    response = trainer.register(name, config)
    if response.status_code != 200:
        raise CheckFailed(f"registering {name} answered {response.status_code}: {response.text}")
    active = stepped = None
    deadline = start + timeout
    while stepped is None:
        trainer.alive()
        status = trainer.status(name)
        now = time.perf_counter()
        if active is None and status["state"] in ("ACTIVE", "RETIRING", "COMPLETED"):
            active = now - start
        if status["step"] >= 1:
            stepped = now - start
            active = active if active is not None else stepped
        if now > deadline:
            raise CheckFailed(f"{name} did not step within {timeout:.0f}s (status {status}):\n{trainer.log_tail()}")
        time.sleep(POLL_S)
    # The loop records written while the adapter joined, up to the one that stepped it
    # (written right after the adapter's own step record).
    def joined() -> list[dict[str, Any]] | None:
        records = [r for r in trainer.records() if r["time"] >= start_wall]
        first = next((i for i, r in enumerate(records) if r["kind"] == "adapter" and r["adapter"] == name), None)
        last = next((i for i, r in enumerate(records) if first is not None and i > first and r["kind"] == "loop"), None)
        return None if last is None else [r for r in records[:last + 1] if r["kind"] == "loop"]

    times = [r["metrics"]["perf/iteration_time"] for r in trainer.wait_until(f"{name}'s step record", joined, timeout)]
    trainer.wait_until(f"{name} to complete", lambda: trainer.status(name)["state"] == "COMPLETED", timeout)
    return active, stepped, statistics.median(times)


def holding(trainer: Trainer, prefix: str | None = None) -> list[dict[str, Any]]:
    """Adapters that hold a slot or wait in the queue for one (neither COMPLETED nor FAILED)."""
    return [a for a in trainer.adapters()
            if a["state"] not in ("COMPLETED", "FAILED") and (prefix is None or a["name"].startswith(prefix))]


def load_phase(trainer: Trainer, workdir: Path, args: Any, n_slots: int,
               registrations_before: int) -> tuple[dict[str, Any], list[str]]:
    datasets = [str(p) for p in load_test.write_datasets(workdir / "load_data")]
    rollouts_before = len(trainer.loop_records())
    start_wall = time.time()
    result = load_test.load_in_subprocess(trainer.url, args.load_requests, args.load_concurrency, args.seed,
                                          datasets, token=TOKEN, register_config=LOAD_ADAPTER, name_prefix="load")
    end_wall = time.time()
    records = trainer.loop_records()
    during = [r["metrics"]["perf/iteration_time"] for r in records if start_wall <= r["time"] <= end_wall]
    result["trainer_iterations_during_load"] = len(records) - rollouts_before
    result["iteration_times_during_load"] = during
    problems = []
    if result["server_errors"]:
        problems.append(f"{result['server_errors']} responses were 5xx: {result['statuses']}")
    if result["trainer_iterations_during_load"] == 0:
        problems.append("the trainer trained no batch during the load")
    problems += load_test.check_http_invariants(trainer.url, TOKEN, n_slots,
                                                registrations_before + result["accepted_registrations"])
    # Every load adapter leaves; then the free slots take exactly that many registrations.
    for adapter in holding(trainer, "load"):
        trainer.http.delete(f"/adapter_runs/{adapter['name']}")
    trainer.wait_until("every load adapter to be cleaned up", lambda: not holding(trainer, "load"), args.timeout)
    free = n_slots - len([a for a in holding(trainer) if a["slot"] is not None])
    responses = [trainer.register(f"fill{i}", {**LOAD_ADAPTER, "data": datasets[0], "num_step": 1})
                 for i in range(free + 1)]
    answers = [(r.status_code, r.json().get("state")) for r in responses]
    if answers != [(200, "PENDING")] * free + [(200, "QUEUED")]:
        problems.append(f"{free} slot(s) should be free: registering {free + 1} answered {answers}")
    for i in range(free + 1):
        trainer.http.delete(f"/adapter_runs/fill{i}")
    trainer.wait_until("the fill adapters to be cleaned up", lambda: not holding(trainer, "fill"), args.timeout)
    problems += load_test.check_http_invariants(trainer.url, TOKEN, n_slots,
                                                registrations_before + result["accepted_registrations"] + free + 1)
    return result, problems


def registry_file_problems(path: Path, n_slots: int) -> list[str]:
    """The registry the stopped trainer left on disk: free and held slots partition the table."""
    from miles.controller.registry import AdapterRegistry
    from miles.controller.store import RegistryStore

    registry = AdapterRegistry.from_state(RegistryStore(path).load(), n_slots)
    held = sorted(registry.live_slots().values())
    if sorted(held + registry.free_slots) != list(range(n_slots)):
        return [f"registry file: free {registry.free_slots} and held {held} slots do not partition the table"]
    return []


# ---- main ------------------------------------------------------------------------------------


def main() -> int:
    parser = base_parser(__doc__, default_reps=3)
    parser.add_argument("--iterations", type=int, default=8, help="steady iterations measured (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2, help="loop records skipped at the start")
    parser.add_argument("--load-requests", type=int, default=2000)
    parser.add_argument("--load-concurrency", type=int, default=32)
    parser.add_argument("--extra-slots", type=int, default=2, help="slots beyond the demo adapters (probes, load)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overlap-weight-push", action=argparse.BooleanOptionalAction, default=True,
                        help="the trainer's flag: push the stepped adapters behind generate and train")
    parser.add_argument("--engine-lora-update", choices=["in_place", "versioned"], default="in_place",
                        help="how the trainer pushes LoRA weights to its engines")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait may take")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (trainer log, metrics)")
    parser.add_argument("--phases", default="steady,registration,load",
                        help="which of steady,registration,load to run after the steady phase (steady always runs)")
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    if args.model not in DEMOS:
        sys.exit(f"--model {args.model!r}: this script runs the demo of {sorted(DEMOS)}")
    if args.quick:
        args.reps, args.iterations, args.warmup = 1, 2, 1
        args.load_requests, args.load_concurrency = min(args.load_requests, 40), min(args.load_concurrency, 8)

    workdir = Path(tempfile.mkdtemp(prefix="trainer_service_"))
    adapters = demo_adapters(args.model, args.quick)
    n_slots = len(adapters) + args.extra_slots
    base = model_dir(args.model)
    model_config = json.loads((base / "config.json").read_text())
    trainer = Trainer(trainer_config(args.model, workdir, n_slots, args.quick, args.engine_lora_update,
                                     args.overlap_weight_push),
                      workdir)
    problems: list[str] = []
    figures: list[Figure] = []
    try:
        trainer.connect(args.timeout)
        for name, config in adapters:
            response = trainer.register(name, config)
            if response.status_code != 200:
                raise CheckFailed(f"registering {name} answered {response.status_code}: {response.text}")
        ranks = {config.get("rank", 8) for _, config in adapters}
        if len(ranks) != 1:
            raise CheckFailed(f"the demo adapters have ranks {ranks}: one rank expected")
        adapter_bytes = lora_nbytes(model_config, ranks.pop())

        steady_records, push_problems = steady(trainer, args.warmup, args.iterations, adapter_bytes, args.timeout)
        problems += push_problems
        m = [r for r in steady_records if r["stepped_bytes"]]
        figures += [
            Figure("weight push on the loop's path (update_weights stage + wait for the push behind it) "
                   f"÷ train stage, per iteration ({'overlapped' if args.overlap_weight_push else 'not overlapped'})",
                   args.model, "push", "train",
                   [r["perf/update_weights_time"] + r.get("perf/export_wait_time", 0.0)
                    + r.get("perf/push_wait_time", 0.0) for r in m],
                   [r["perf/train_time"] for r in m], "s", "ours/baseline", "<= 0.05",
                   params={"push_time_median_s": statistics.median(r.get("perf/push_time", 0.0) for r in m),
                           "overlap_weight_push": args.overlap_weight_push}),
            Figure("bytes pushed ÷ LoRA bytes of the adapters the previous iteration stepped", args.model,
                   "pushed per engine", "LoRA bytes stepped (from config.json)",
                   [r.get("perf/push_bytes", 0.0) / 1e6 for r in m], [r["stepped_bytes"] / 1e6 for r in m], "MB",
                   "ours/baseline", "== 1", params={"adapter_bytes": adapter_bytes}),
            Figure("loop overhead (snapshot + reconcile + push + commit + save + record) ÷ iteration", args.model,
                   "overhead", "iteration",
                   [r["perf/iteration_time"] - r["perf/generate_time"] - r["perf/train_time"] for r in m],
                   [r["perf/iteration_time"] for r in m], "s", "ours/baseline", "<= 0.05",
                   params={"stages_median_s": {k.removeprefix("perf/"): statistics.median(r.get(k, 0.0) for r in m)
                                               for k in sorted(m[0]) if k.endswith("_time")}}),
        ]

        registrations = len(adapters)
        if "registration" in phases:
            probe = {**adapters[0][1], "num_step": 1}
            joins = [registration(trainer, f"probe{i}", probe, args.timeout) for i in range(args.reps)]
            registrations += args.reps
            figures += [
                Figure("POST /adapter_runs -> ACTIVE ÷ one loop iteration, while training", args.model,
                       "POST -> ACTIVE", "iteration", [a for a, _, _ in joins], [it for _, _, it in joins], "s",
                       "ours/baseline", "<= 1.0"),
                Figure("POST /adapter_runs -> first optimizer step ÷ one loop iteration, while training", args.model,
                       "POST -> first step", "iteration", [s for _, s, _ in joins], [it for _, _, it in joins], "s",
                       "ours/baseline", "report"),
            ]
        if "load" in phases:
            before = [r["perf/iteration_time"] for r in steady_records]
            result, load_problems = load_phase(trainer, workdir, args, n_slots, registrations)
            problems += load_problems
            during = result["iteration_times_during_load"] or [0.0]
            label = (f"{result['requests']} requests at concurrency {result['concurrency']}: "
                     f"{result['requests_per_s']:.1f} requests/s, p50 {result['p50_ms']:.0f} ms, "
                     f"p99 {result['p99_ms']:.0f} ms; 5xx")
            load_params = {k: result[k] for k in ("requests", "concurrency", "seconds", "requests_per_s", "p50_ms",
                                                  "p99_ms", "by_kind", "statuses", "server_errors",
                                                  "accepted_registrations", "trainer_iterations_during_load")}
            figures += [
                Figure("control plane under load while training: 5xx ÷ requests", args.model, label, "requests",
                       [float(result["server_errors"])], [float(result["requests"])], "responses", "ours/baseline",
                       "== 0", params=load_params),
                Figure("trainer iteration during the load ÷ before it", args.model, "during the load", "before",
                       [statistics.median(during)], [statistics.median(before)], "s", "ours/baseline", "report",
                       params={"iterations_during_load": len(result["iteration_times_during_load"])}),
            ]
    except CheckFailed as exc:
        problems.append(str(exc))
    finally:
        code = trainer.stop()
    if code != 0:
        problems.append(f"the trainer exited with {code} after SIGTERM:\n{trainer.log_tail()}")
    registry = workdir / "save" / "controller" / "registry.sqlite"
    if registry.exists():
        problems += registry_file_problems(registry, n_slots)
    else:
        problems.append(f"no registry file at {registry}")

    if figures:
        report(figures, args.json, sys.argv)
    print(f"work directory: {workdir}" + ("" if args.keep else " (removed)"))
    if not args.keep and not problems:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    for problem in problems:
        print(f"CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
