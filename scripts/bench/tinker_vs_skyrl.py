"""Tinker clients on our trainer and on SkyRL's Tinker server, side by side: tokens/s.

    python scripts/bench/tinker_vs_skyrl.py --skyrl-venv PATH    # ~12 min on 2 shared cores
    python scripts/bench/tinker_vs_skyrl.py --quick              # smoke run (numbers meaningless)

One run starts both servers on loopback, on the same tiny random Llama (hidden 64, 2 layers,
vocabulary 100: `miles.recipes.tiny_model`, written once under .cache/bench/ and loaded by
both from its absolute path), and drives both with the same client loop
(`tinker_clients.py`) under the same SDK, tinker 0.24.1, the version SkyRL 0.3.0 speaks:

- ours: `python -m miles.main.train_multi_lora_async` in service mode with no RL adapter (the
  loop runs the clients' work alone, without a generate phase), the torch backend and one
  builtin engine, slots for every client; its Ray workers at niceness 0 like every other
  process here (`--ray-worker-niceness`; Ray's default, 15, hands most of the CPU to the
  other side on a machine shared with other jobs);
- SkyRL: skyrl 0.3.0's Tinker API server and engine, JAX backend on the CPU
  (`skyrl_server.py`, `--skyrl-backend-config`), run by the interpreter of a virtualenv that
  holds `skyrl[tinker,jax]==0.3.0` and `tinker==0.24.1`: `--skyrl-venv`, or one this script
  makes under .cache/skyrl-venv (about 1.5 min and 6.7 GB; pip's registry is the only thing
  fetched).

Each client driver opens max(K) clients, each its own service client (session) and LoRA
training client, and warms every path up (one step and one sample each, then one untimed
round of every case). Then `--reps` rounds, the cases in alternating order (forward, then
reversed), for each K of `--ks`:
- training: K clients each run `--steps` steps of forward_backward (4 datums of 128 tokens,
  cross_entropy) + optim_step: on ours at once (their datums mixed in one train call), on ours
  one client after another, on SkyRL at once;
- sampling: K clients each send `--sample-calls` requests (4 samples of 64 tokens from a
  32-token prompt, no stop token), each read before the next: the same three cases.
Tokens/s = tokens trained (datums x 128) or generated, over the case's wall time. Each figure
is the ratio of two cases of the same round, median over the rounds with min..max.

Target: ours >= 2x SkyRL's training tokens/s at K = 8 (reported, not failed). With
`--ours-sdk-038` (the default) ours is also driven by our environment's SDK (0.38.0).

SDK 0.24.1 drives both servers unmodified: our gateway's client config asks it for protobuf
forward_backward bodies (as SDK 0.38 writes them by default), SkyRL's takes its JSON.

Exits 1 when a server or a driver fails or a sample comes back shorter than asked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import CACHE, ROOT, Figure, base_parser, report, vocab_size  # noqa: E402

from miles.controller.actor import API_URL_LINE  # noqa: E402

HERE = Path(__file__).resolve().parent
SKYRL_PACKAGES = ("skyrl[tinker,jax]==0.3.0", "tinker==0.24.1")
SKYRL_VERSIONS = {"skyrl": "0.3.0", "tinker": "0.24.1"}
SKYRL_LISTENING = re.compile(r"SkyRL Tinker server listening at (http://\S+)")
SKYRL_REFERENCE = {"train": {1: 1293, 4: 1638, 8: 1547}, "sample": {1: 469, 4: 787, 8: 560}}
"""SkyRL's tokens/s measured earlier by hand on a tiny random Llama (hidden 64, 2 layers,
vocabulary 512, 4 x 128-token datums per client per step; another JAX config), printed beside
this run's for orientation only."""
API_KEY = "tml-bench"
RANK = 8
TARGET_K = 8
TARGET = ">= 2.0"


class CheckFailed(RuntimeError):
    pass


# ---- set-up --------------------------------------------------------------------------------


def skyrl_backend_config(clients: int) -> dict[str, Any]:
    """SkyRL's JAX backend for `clients` clients: an adapter slot each and slot 0 for the base
    model, rank 8 like ours, micro-batches of one request's 4 datums (one compiled train shape),
    sample batches of 8 sequences. Of those tried on this machine, alternating (micro-batches of
    32, sample batches of 32), these gave SkyRL its highest training and sampling tokens/s."""
    return {"max_lora_adapters": clients + 1, "max_lora_rank": RANK, "train_micro_batch_size": 4,
            "sample_max_num_sequences": 8}


def ensure_model(out: Path) -> Path:
    """The tiny random Llama both servers load (seeded; written once)."""
    if (out / "model.safetensors").exists():
        return out.resolve()
    from miles.recipes.tiny_model import write_tiny_model

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    write_tiny_model(tmp, arch="llama", seed=0, hidden_size=64, num_layers=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # another process wrote it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out.resolve()


def ensure_skyrl_venv(given: str | None) -> Path:
    """The interpreter of a virtualenv with skyrl 0.3.0 and tinker 0.24.1: the given one, or
    one made under .cache/skyrl-venv."""
    venv = Path(given) if given else CACHE / "skyrl-venv"
    python = venv / "bin" / "python"
    if given is None and not (venv / ".installed").exists():
        print(f"making {venv}: pip install {' '.join(SKYRL_PACKAGES)} (about 1.5 min, 6.7 GB)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *SKYRL_PACKAGES], check=True)
        (venv / ".installed").touch()
    if not python.exists():
        sys.exit(f"--skyrl-venv {venv}: no bin/python there")
    found = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; "
                            f"print(json.dumps({{n: m.version(n) for n in {sorted(SKYRL_VERSIONS)}}}))"],
                           capture_output=True, text=True)
    versions = json.loads(found.stdout) if found.returncode == 0 else {}
    if versions != SKYRL_VERSIONS:
        why = versions or (found.stderr.strip().splitlines() or ["no answer"])[-1]
        sys.exit(f"{python}: needs {SKYRL_VERSIONS}, has {why}; "
                 f"pip install {' '.join(repr(p) for p in SKYRL_PACKAGES)} there, or leave out --skyrl-venv")
    return python


# ---- processes -----------------------------------------------------------------------------


class Server:
    """A server subprocess whose output goes to a log file, and the URL it logs once bound."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, url_line: re.Pattern,
                 *, stop_group: bool) -> None:
        self.name = name
        self.log_path = log_path
        self.url_line = url_line
        self.stop_group = stop_group
        """SIGTERM the whole process group (SkyRL's API and engine), or the main process only
        (our trainer, which stops its Ray cluster itself)."""
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CheckFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            found = self.url_line.search(self.log_path.read_text(errors="replace"))
            if found:
                self.url = found.group(1)
                return self.url
            time.sleep(0.2)
        raise CheckFailed(f"{self.name} logged no address within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 120.0) -> int | None:
        """Its exit code after SIGTERM (None: killed after `timeout`)."""
        if self.proc.poll() is None:
            if self.stop_group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            return None
        finally:
            self._log.close()


class ClientDriver:
    """`tinker_clients.py` under one interpreter against one server: a JSON request a line in,
    a JSON answer a line out (read on a thread, so that every wait has a deadline)."""

    def __init__(self, name: str, python: Path | str, url: str, model: Path, clients: int, log_path: Path,
                 args: Any, extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("w")
        env = {**os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1"}
        argv = [str(python), str(HERE / "tinker_clients.py"), "--base-url", url, "--base-model", str(model),
                "--api-key", API_KEY, "--vocab", str(vocab_size(model)), "--clients", str(clients),
                "--rank", str(RANK), "--num-samples", str(args.num_samples), "--max-tokens", str(args.max_tokens),
                *extra]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        self.ready: dict[str, Any] = {}

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def answer(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise CheckFailed(f"{self.name}: no answer within {timeout:.0f}s:\n{self.log_tail()}") from None
        if line is None:
            raise CheckFailed(f"{self.name} exited with {self.proc.wait()}:\n{self.log_tail()}")
        payload = json.loads(line)
        if "error" in payload:
            raise CheckFailed(f"{self.name}: {payload['error']}")
        return payload

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        self.ready = self.answer(timeout)
        return self.ready

    def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


def start_ours(model: Path, workdir: Path, n_slots: int, worker_niceness: int) -> Server:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "RAY_worker_niceness": str(worker_niceness)}
    env.pop("RAY_ADDRESS", None)
    argv = [sys.executable, "-m", "miles.main.train_multi_lora_async", "--hf-checkpoint", str(model),
            "--multi-lora-n-adapters", str(n_slots), "--lora-rank", str(RANK),
            "--multi-lora-api-port", "0", "--multi-lora-api-token", API_KEY, "--multi-lora-idle-poll-s", "0.2",
            "--rollout-num-engines", "1", "--rollout-engine", "builtin", "--save", str(workdir / "ours")]
    return Server("our trainer", argv, env, workdir / "ours.log", API_URL_LINE, stop_group=False)


def start_skyrl(python: Path, model: Path, workdir: Path, backend_config: dict[str, Any]) -> Server:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "COLUMNS": "250", "PYTHONUNBUFFERED": "1"}
    argv = [str(python), str(HERE / "skyrl_server.py"), "--base-model", str(model), "--backend", "jax",
            "--backend-config", json.dumps(backend_config), "--checkpoints-base", str(workdir / "skyrl_checkpoints"),
            "--database-url", f"sqlite:///{workdir / 'skyrl.sqlite'}"]
    return Server("SkyRL's server", argv, env, workdir / "skyrl.log", SKYRL_LISTENING, stop_group=True)


# ---- measurement ---------------------------------------------------------------------------


class Driver(Protocol):
    """What a case needs of a client driver (`ClientDriver`)."""

    name: str

    def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Case:
    """One side of a figure: a driver, and its clients at once or one after another."""

    name: str
    driver: Driver
    mode: str = "concurrent"


@dataclass
class Measured:
    """Tokens/s of every (kind, K, case) per round, and the step latencies of the training cases."""

    rates: dict[tuple[str, int, str], list[float]] = field(default_factory=dict)
    step_seconds: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    short_samples: list[str] = field(default_factory=list)


def run_case(kind: str, k: int, case: Case, args: Any, measured: Measured | None) -> None:
    if kind == "train":
        out = case.driver.request({"op": "train", "k": k, "steps": args.steps, "mode": case.mode}, args.timeout)
    else:
        out = case.driver.request({"op": "sample", "k": k, "calls": args.sample_calls, "mode": case.mode},
                                  args.timeout)
        expected = k * args.sample_calls * args.num_samples * args.max_tokens
        if out["tokens"] != expected and measured is not None:
            measured.short_samples.append(f"{case.name} at K={k} generated {out['tokens']} tokens, not {expected}")
    if measured is None:
        return
    measured.rates.setdefault((kind, k, case.name), []).append(out["tokens"] / out["seconds"])
    if kind == "train":
        measured.step_seconds.setdefault((k, case.name), []).extend(out["step_seconds"])


def measure(cases: dict[str, Case], ks: list[int], args: Any) -> Measured:
    """One untimed round, then `args.reps` rounds; in each, for each K, the training cases then
    the sampling cases, in alternating order."""
    measured = Measured()
    for rep in range(-1, args.reps):
        start = time.perf_counter()
        for k in ks:
            for kind in ("train", "sample"):
                names = [n for n in cases if k > 1 or cases[n].mode == "concurrent"]
                for name in names if rep % 2 == 0 else reversed(names):
                    run_case(kind, k, cases[name], args, None if rep < 0 else measured)
        print(f"{'warm-up round' if rep < 0 else f'round {rep + 1}/{args.reps}'}: "
              f"{time.perf_counter() - start:.1f}s, load average {os.getloadavg()[0]:.1f}", flush=True)
    return measured


def figures(measured: Measured, ks: list[int], args: Any, params: dict[str, Any], with_038: bool) -> list[Figure]:
    r = measured.rates
    model = args.model
    out = []

    def latency(k: int, name: str) -> float:
        return statistics.median(measured.step_seconds[(k, name)])

    for k in ks:
        clients = f"{k} client{'s' if k > 1 else ''}"
        at_once = "mixed in one train call" if k > 1 else "alone"
        step = {"median_step_s": {"ours": latency(k, "ours"), "skyrl": latency(k, "skyrl")}}
        out.append(Figure(
            f"Tinker training tokens/s, {clients}: ours ÷ SkyRL 0.3.0 (SDK 0.24.1 on both)", model,
            f"ours, {clients} {at_once}", "SkyRL, JAX on CPU", r[("train", k, "ours")], r[("train", k, "skyrl")],
            "tokens/s", "ours/baseline", TARGET if k == TARGET_K else "report",
            params={**params, **step, "k": k, "skyrl_reference_tokens_per_s": SKYRL_REFERENCE["train"].get(k)}))
        if k > 1:
            out.append(Figure(
                f"Tinker training tokens/s, {clients} on ours: mixed in one train call ÷ one client at a time",
                model, "at once, one train call", "one client after another", r[("train", k, "ours")],
                r[("train", k, "ours_sequential")], "tokens/s", "ours/baseline", "report",
                params={**params, "k": k, "median_step_s": {"at_once": latency(k, "ours"),
                                                            "one_at_a_time": latency(k, "ours_sequential")}}))
        out.append(Figure(
            f"Tinker sampling tokens/s, {clients}: ours ÷ SkyRL 0.3.0 (SDK 0.24.1 on both)", model,
            f"ours, {clients}{' at once' if k > 1 else ''}", "SkyRL, JAX on CPU", r[("sample", k, "ours")],
            r[("sample", k, "skyrl")],
            "tokens/s", "ours/baseline", "report",
            params={**params, "k": k, "skyrl_reference_tokens_per_s": SKYRL_REFERENCE["sample"].get(k)}))
        if k > 1:
            out.append(Figure(
                f"Tinker sampling tokens/s, {clients} on ours: at once ÷ one client at a time", model,
                "at once", "one client after another", r[("sample", k, "ours")],
                r[("sample", k, "ours_sequential")], "tokens/s", "ours/baseline", "report", params={**params, "k": k}))
        if with_038:
            for kind, word in (("train", "training"), ("sample", "sampling")):
                out.append(Figure(
                    f"Tinker {word} tokens/s, {clients}: ours with SDK 0.38.0 ÷ SkyRL 0.3.0 with SDK 0.24.1", model,
                    f"ours, {clients}{' at once' if k > 1 else ''}, SDK 0.38.0", "SkyRL, JAX on CPU, SDK 0.24.1",
                    r[(kind, k, "ours_sdk038")], r[(kind, k, "skyrl")], "tokens/s", "ours/baseline", "report",
                    params={**params, "k": k}))
    return out


def print_rates(measured: Measured, ks: list[int]) -> None:
    names = sorted({name for _, _, name in measured.rates})
    print(f"\ntokens/s, medians of {len(next(iter(measured.rates.values())))} rounds (min..max); "
          "SkyRL's hand-measured reference in brackets")
    for kind in ("train", "sample"):
        for k in ks:
            cells = []
            for name in names:
                values = measured.rates.get((kind, k, name))
                if values:
                    cells.append(f"{name} {statistics.median(values):.0f} ({min(values):.0f}..{max(values):.0f})")
            reference = SKYRL_REFERENCE[kind].get(k)
            print(f"  {kind:6} K={k}: " + " | ".join(cells) + (f" [SkyRL by hand: {reference}]" if reference else ""))


# ---- main ----------------------------------------------------------------------------------


def main() -> int:
    parser = base_parser(__doc__, default_reps=7)
    parser.set_defaults(model="tiny-random")
    parser.add_argument("--skyrl-venv", default=None,
                        help="a virtualenv with skyrl[tinker,jax]==0.3.0 and tinker==0.24.1 (default: make one "
                             "under .cache/skyrl-venv)")
    parser.add_argument("--ks", default="1,4,8", help="numbers of concurrent clients")
    parser.add_argument("--steps", type=int, default=6, help="training steps per client per case")
    parser.add_argument("--sample-calls", type=int, default=3, help="sample requests per client per case")
    parser.add_argument("--num-samples", type=int, default=4, help="samples per request")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per sample")
    parser.add_argument("--ours-sdk-038", action=argparse.BooleanOptionalAction, default=True,
                        help="also drive ours with this environment's SDK (0.38.0)")
    parser.add_argument("--skyrl-backend-config", default=None,
                        help="SkyRL's --backend-config (JSON; default: skyrl_backend_config())")
    parser.add_argument("--ray-worker-niceness", type=int, default=0,
                        help="niceness of our trainer's Ray workers (Ray's default: 15; SkyRL's processes run at 0)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait may take")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (server and client logs)")
    args = parser.parse_args()
    if args.threads != 1:
        parser.error("--threads has no effect here: each of our train ranks and engines runs one torch thread")
    if args.quick:
        args.reps, args.ks, args.steps, args.sample_calls = 1, "1,2", 1, 1
    ks = [int(k) for k in args.ks.split(",")]
    load_at_start = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.UTC)
    print(f"load average at the start: {load_at_start:.2f} (1 min), {os.cpu_count()} cores", flush=True)

    if args.model == "tiny-random":
        model = ensure_model(CACHE / "bench" / "tiny_llama_h64")
    else:
        model = Path(args.model).resolve()
        if not (model / "config.json").exists():
            sys.exit(f"--model {args.model!r}: not tiny-random and not a Hugging Face model directory")
    skyrl_python = ensure_skyrl_venv(args.skyrl_venv)
    clients = max(ks)
    backend_config = (json.loads(args.skyrl_backend_config) if args.skyrl_backend_config
                      else skyrl_backend_config(clients))
    drivers_on_ours = 2 if args.ours_sdk_038 else 1
    workdir = Path(tempfile.mkdtemp(prefix="tinker_vs_skyrl_"))
    params = {"steps": args.steps, "datums": 4, "seq_len": 128, "sample_calls": args.sample_calls,
              "num_samples": args.num_samples, "max_tokens": args.max_tokens, "prompt_len": 32, "rank": RANK,
              "skyrl_backend_config": backend_config, "load_avg_1m_at_start": load_at_start,
              "ray_worker_niceness": args.ray_worker_niceness,
              "started_at": started.strftime("%Y-%m-%d %H:%M UTC")}

    ours = start_ours(model, workdir, n_slots=clients * drivers_on_ours, worker_niceness=args.ray_worker_niceness)
    skyrl = start_skyrl(skyrl_python, model, workdir, backend_config)
    drivers: list[ClientDriver] = []
    problems: list[str] = []
    measured: Measured | None = None
    try:
        ours_url, skyrl_url = ours.wait_for_url(args.timeout), skyrl.wait_for_url(args.timeout)
        drivers = [ClientDriver("ours (SDK 0.24.1)", skyrl_python, ours_url, model, clients,
                                workdir / "clients_ours.log", args),
                   ClientDriver("SkyRL (SDK 0.24.1)", skyrl_python, skyrl_url, model, clients,
                                workdir / "clients_skyrl.log", args)]
        if args.ours_sdk_038:
            drivers.append(ClientDriver("ours (SDK 0.38.0)", sys.executable, ours_url, model, clients,
                                        workdir / "clients_ours_sdk038.log", args))
        for driver in drivers:  # set up meanwhile: SkyRL's compiles, ours loads slots and snapshots
            ready = driver.wait_ready(args.timeout)
            print(f"{driver.name}: {clients} clients set up in {ready['setup_seconds']:.1f}s (SDK {ready['sdk']})",
                  flush=True)
        cases = {"ours": Case("ours", drivers[0]), "ours_sequential": Case("ours_sequential", drivers[0], "sequential"),
                 "skyrl": Case("skyrl", drivers[1])}
        if args.ours_sdk_038:
            cases["ours_sdk038"] = Case("ours_sdk038", drivers[2])
        measured = measure(cases, ks, args)
        problems += measured.short_samples
    except CheckFailed as exc:
        problems.append(str(exc))
    finally:
        for driver in drivers:
            driver.close()
        skyrl.stop()
        code = ours.stop()
    if code != 0:
        problems.append(f"our trainer exited with {code} after SIGTERM:\n{ours.log_tail()}")

    if measured is not None and measured.rates:
        print_rates(measured, ks)
        figs = figures(measured, ks, args, params, args.ours_sdk_038)
        report(figs, args.json, sys.argv)
        at_target = [f for f in figs if f.target != "report"]
        for f in at_target:
            print(f"target: ours >= 2x SkyRL's training tokens/s at K = {TARGET_K}: ratio {f.ratio:.2f} "
                  f"({min(f.ratios):.2f}..{max(f.ratios):.2f}): {'met' if f.met else 'MISSED'}")
    print(f"work directory: {workdir}" + ("" if args.keep or problems else " (removed)"))
    if not args.keep and not problems:
        shutil.rmtree(workdir, ignore_errors=True)
    for problem in problems:
        print(f"CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
