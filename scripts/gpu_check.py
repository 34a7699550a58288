"""The GPU check: an engine serving pushed LoRAs agrees with PEFT and the trainer, and the trainer runs on CUDA.

    make gpu-check                         # = python scripts/gpu_check.py (SGLang)
    python scripts/gpu_check.py --work /tmp/gpu-check --sglang-venv .venv-sglang
    python scripts/gpu_check.py --engine builtin   # no SGLang: the builtin engine on the GPU

Needs CUDA; without it, it says so and exits 2 (`--cpu-rehearsal` runs the same checks
against the builtin engine on CPU, to test this script itself). It runs unattended in at most
`--budget-s` (480 s) and prints one verdict line per check, `PASS|FAIL|SKIP <check>:
<detail>`, then exits 1 if any check failed:

  install        SGLang (`--sglang-version`, 0.5.23) in a virtual environment of its own
                 (it pins torch and transformers other than the trainer's), reused if present;
                 SKIP with `--engine builtin`
  adapters       a tiny Llama built locally (no download) and two random PEFT adapters
  engine-peft    the engine serving both pushed adapters (versioned pushes) gives PEFT's greedy tokens,
                 each unlike the base's, and the base's own without an adapter
  engine-trainer the engine's logprobs, one per generated token (none is a FAIL), are within 1e-2
                 of the trainer's multi-LoRA model
  push-in-flight a push while requests are in flight fails none of them; the new version
                 then serves the new weights
  in-place       a broadcast push over NCCL (`/load_lora_adapter_from_distributed` with
                 upsert) serves the sent weights; SKIP on SGLang builds without that route
                 and with one GPU (NCCL puts no two ranks of a group on one device)
  service-versioned  the real trainer (`python -m miles.main.train_multi_lora_async`,
  service-in-place   --rollout-engine sglang|builtin, torch backend on CUDA in bf16) driven over its
                 control plane: 'first' is POSTed and steps, 'second' joins mid-run and both
                 step, 'first' is DELETEd mid-run and retires (its slot cleaned up, unloaded
                 from the engines and taken by a third adapter) while 'second' keeps stepping,
                 then SIGTERM saves and exits 0; once per --engine-lora-update mode (in_place:
                 SKIP, unsupported, on SGLang builds without the in-place route)
  megatron-tp1   the Megatron backend on CUDA (bf16) against the torch backend: logprobs of a
  megatron-tp2   mixed batch and LoRA weights after one step within 1e-2 (TP 2: SKIP with
                 fewer than two GPUs)
  megatron-engine-tp1  the trainer with --train-backend megatron (TP 1, TP 2) and the
  megatron-engine-tp2  engine (--rollout-engine): two adapters registered together each step
                 twice, then SIGTERM saves and exits 0

The trainer runs join a Ray cluster this script starts (RAY_ADDRESS, as under `ray job
submit`), each within 150 s. They need a GPU per train rank plus one for the engine; with
fewer, a one-rank run with versioned pushes shares GPU 0 with the engine, and the others
SKIP saying how many GPUs they need. `--cpu-rehearsal` runs each of them with the builtin
engine and the CPU backends (fewest steps, tiny model; TP 2 is left to the CPU tests).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RANK = 8
LOGPROB_TOL = 1e-2
PROMPTS = ["12+34=", "hello there", "(7*6)-5=", "abc xyz"]
NEW_TOKENS = 12
SKIPPABLE = ["service-versioned", "service-in-place", "megatron-tp1", "megatron-tp2", "megatron-engine-tp1",
             "megatron-engine-tp2"]


class Verdicts:
    def __init__(self, deadline: float, skip: frozenset[str] = frozenset()):
        self.deadline = deadline
        self.started = time.monotonic()
        self.skip = skip
        self.failed = False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def report(self, status: str, check: str, detail: str) -> None:
        self.failed |= status == "FAIL"
        print(f"{status} {check}: {detail} [{time.monotonic() - self.started:.0f} s]", flush=True)

    def wanted(self, check: str, min_left_s: float = 60.0) -> bool:
        """False (and a SKIP line) when `check` was skipped by --skip or the budget is nearly spent."""
        if check in self.skip:
            self.report("SKIP", check, "--skip")
        elif self.left() < min_left_s:
            self.report("SKIP", check, f"only {self.left():.0f} s of the budget left")
        else:
            return True
        return False


def install_sglang(venv: Path, version: str, timeout_s: float) -> tuple[bool, str]:
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import sglang, sys; sys.stdout.write(sglang.__version__)"]
    if python.exists():
        done = subprocess.run(probe, capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == version:
            return True, f"sglang {version} already in {venv}"
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    try:
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", f"sglang=={version}"],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"pip install sglang=={version} took over {timeout_s:.0f} s"
    if done.returncode != 0:
        return False, f"pip install sglang=={version} failed: {done.stderr.strip()[-400:]}"
    return True, f"installed sglang {version} in {venv}"


def make_adapters(model_dir: Path, out: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    from miles import lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora.inject_multi_lora(model, n_slots=1, max_rank=RANK, target_modules="all-linear")
    generator = torch.Generator().manual_seed(0)
    dirs = {}
    for name in ("first", "second", "third"):
        lora.init_slot(model, 0, rank=RANK, alpha=2 * RANK, generator=generator)
        weights = lora.get_slot_weights(model, 0)
        for key, value in weights.items():
            if key.endswith("lora_B.weight"):
                weights[key] = torch.randn(value.shape, generator=generator) * 0.5
        lora.set_slot_weights(model, 0, weights, rank=RANK, alpha=2 * RANK)
        dirs[name] = lora.export_peft_adapter(model, 0, out / name)
    return dirs


class Reference:
    """PEFT (greedy tokens) and the trainer's multi-LoRA model (logprobs), in float32."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path], device: str):
        from transformers import AutoModelForCausalLM

        from miles import lora

        self.model_dir, self.adapters, self.device = model_dir, adapters, device
        self.trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        lora.inject_multi_lora(self.trainer, n_slots=len(adapters), max_rank=RANK, target_modules="all-linear")
        self.slots = {}
        for slot, (name, path) in enumerate(sorted(adapters.items())):
            lora.load_peft_adapter(self.trainer, slot, path)
            self.slots[name] = slot
        self._peft = {}
        self._base = None

    @torch.no_grad()
    def base_greedy(self, prompt_ids: list[int]) -> list[int]:
        """The base model's greedy tokens (transformers, no adapter)."""
        from transformers import AutoModelForCausalLM

        if self._base is None:
            base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            self._base = base.to(self.device).eval()
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self._base.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        return out[0, len(prompt_ids):].tolist()

    @torch.no_grad()
    def peft_greedy(self, adapter: str, prompt_ids: list[int]) -> list[int]:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        if adapter not in self._peft:
            base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device).eval()
            self._peft[adapter] = PeftModel.from_pretrained(base, str(self.adapters[adapter])).eval()
        model = self._peft[adapter]
        ids = torch.tensor([prompt_ids], device=self.device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        return out[0, len(prompt_ids):].tolist()

    @torch.no_grad()
    def trainer_logprobs(self, adapter: str, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        from miles import lora

        ids = torch.tensor([prompt_ids + response_ids], device=self.device)
        with lora.use_slots(self.trainer, [self.slots[adapter]]):
            logits = self.trainer(ids).logits[0].float()
        positions = slice(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1)
        logprobs = torch.log_softmax(logits[positions], dim=-1)
        return logprobs.gather(1, torch.tensor(response_ids, device=self.device)[:, None])[:, 0].tolist()


def peft_payload(path: Path) -> tuple[dict, dict]:
    from miles import lora

    tensors, config = lora.read_peft_dir(path)
    return config, tensors


async def generate(client, url: str, name: str | None, prompt_ids: list[int], max_new_tokens: int = NEW_TOKENS) -> dict:
    """Greedy tokens and their logprobs; `name` None: the base model."""
    request = {"input_ids": prompt_ids, "return_logprob": True,
               "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    if name is not None:
        request["lora_path"] = name
    response = await client.post(url + "/generate", json=request)
    response.raise_for_status()
    return response.json()


def logprob_gap(out: dict, trainer_lp: list[float]) -> float | str:
    """max |engine - trainer| over a generation's tokens, or why they cannot be compared
    (no logprobs, or not one per generated token: never a silent pass on fewer)."""
    engine_lp = [lp for lp, _, _ in out["meta_info"].get("output_token_logprobs") or []]
    n = len(out["output_ids"])
    if n == 0 or not len(engine_lp) == len(trainer_lp) == n:
        return f"{len(engine_lp)} engine and {len(trainer_lp)} trainer logprobs for {n} generated tokens"
    return max(abs(a - b) for a, b in zip(engine_lp, trainer_lp))


async def check_versioned(v: Verdicts, cfg, work: Path, ref: Reference, tokenizer) -> None:
    import httpx

    from miles.rollout.engines.engine_actor import EngineServer

    server = EngineServer(cfg, str(work / "engine-versioned"), start_timeout_s=max(60.0, v.left() - 120))
    await server.start()
    try:
        served = {adapter: await server.push_lora(slot, 1, *peft_payload(ref.adapters[adapter]))
                  for slot, adapter in enumerate(("first", "second"))}
        mismatches, gaps, uncompared = [], [], []
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for prompt in PROMPTS:
                prompt_ids = tokenizer.encode(prompt)
                # The base (no lora_path) is the base model's, and no adapter's: the adapters apply.
                base = (await generate(client, server.url(), None, prompt_ids))["output_ids"]
                if base != ref.base_greedy(prompt_ids):
                    mismatches.append(f"base/{prompt!r}")
                for adapter, name in served.items():
                    out = await generate(client, server.url(), name, prompt_ids)
                    if out["output_ids"] != ref.peft_greedy(adapter, prompt_ids):
                        mismatches.append(f"{adapter}/{prompt!r}")
                    if out["output_ids"] == base:
                        mismatches.append(f"{adapter}/{prompt!r} gives the base's tokens")
                    gap = logprob_gap(out, ref.trainer_logprobs(adapter, prompt_ids, out["output_ids"]))
                    if isinstance(gap, str):
                        uncompared.append(f"{adapter}/{prompt!r}: {gap}")
                    else:
                        gaps.append(gap)
            n = (len(served) + 1) * len(PROMPTS)
            v.report("FAIL" if mismatches else "PASS", "engine-peft",
                     f"greedy tokens differ from PEFT (or the base) for {mismatches}" if mismatches
                     else f"{n}/{n} greedy generations equal PEFT's (2 adapters, each unlike the base, and the base)")
            if uncompared:
                v.report("FAIL", "engine-trainer", f"logprobs missing: {uncompared}")
            else:
                worst = max(gaps)
                v.report("PASS" if worst <= LOGPROB_TOL else "FAIL", "engine-trainer",
                         f"max |logprob(engine) - logprob(trainer)| = {worst:.2e} over {len(gaps)} generations "
                         f"(tolerance {LOGPROB_TOL})")

            # A push while requests of the previous version are in flight.
            prompt_ids = tokenizer.encode(PROMPTS[0])
            in_flight = [asyncio.create_task(generate(client, server.url(), served["first"], prompt_ids, 256))
                         for _ in range(16)]
            await asyncio.sleep(0.2)
            new_name = await server.push_lora(0, 2, *peft_payload(ref.adapters["third"]))
            results = await asyncio.gather(*in_flight, return_exceptions=True)
            # Finished means every asked-for token: a request cut short counts as failed.
            failed = [r for r in results if isinstance(r, BaseException) or len(r["output_ids"]) != 256
                      or r["meta_info"]["finish_reason"]["type"] == "abort"]
            after = await generate(client, server.url(), new_name, prompt_ids)
            ok = not failed and after["output_ids"] == ref.peft_greedy("third", prompt_ids)
            v.report("PASS" if ok else "FAIL", "push-in-flight",
                     f"{len(results) - len(failed)}/{len(results)} in-flight requests finished; "
                     f"{new_name} serves the new weights: "
                     f"{after['output_ids'] == ref.peft_greedy('third', prompt_ids)}")
    finally:
        await server.shutdown()


async def check_in_place(v: Verdicts, cfg, work: Path, ref: Reference, tokenizer) -> str | None:
    """Returns why this engine cannot replace a LoRA in place (None: it can)."""
    import httpx

    from miles.lora import weight_sync
    from miles.rollout.engines.engine_actor import EngineConfigError, EngineServer
    from miles.rollout.engines.process import free_port

    server = EngineServer(cfg, str(work / "engine-in-place"), start_timeout_s=max(60.0, v.left() - 60))
    try:
        await server.start()
    except EngineConfigError as exc:
        reason = str(exc).split(";")[0]
        v.report("SKIP", "in-place", reason)
        await server.shutdown()
        return reason
    group = None
    try:
        device = "cuda" if cfg.device == "cuda" else "cpu"
        spec = weight_sync.UpdateGroupSpec(master_address="127.0.0.1", master_port=free_port(), world_size=2,
                                           group_name=f"gpu_check_{uuid.uuid4().hex[:6]}",
                                           backend="nccl" if device == "cuda" else "gloo", timeout_s=120)
        _, group = await asyncio.gather(server.init_weights_update_group(**spec.init_request(1)),
                                        asyncio.to_thread(weight_sync.join_update_group, spec, 0))
        good = []
        for version, adapter in ((1, "first"), (2, "second")):
            config, tensors = peft_payload(ref.adapters[adapter])
            names, dtypes, shapes = weight_sync.tensor_metadata(tensors)
            name, _ = await asyncio.gather(
                server.push_lora_from_distributed(0, version, config, names, dtypes, shapes, spec.group_name),
                asyncio.to_thread(weight_sync.broadcast_tensors, group, tensors, device=device))
            prompt_ids = tokenizer.encode(PROMPTS[1])
            async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
                out = await generate(client, server.url(), name, prompt_ids)
            good.append(out["output_ids"] == ref.peft_greedy(adapter, prompt_ids))
        v.report("PASS" if all(good) else "FAIL", "in-place",
                 f"broadcast pushes (fresh, then upsert) equal PEFT's greedy tokens: {good}")
        return None
    finally:
        await server.shutdown()
        if group is not None:
            weight_sync.leave_update_group(group)


async def run(args: argparse.Namespace, v: Verdicts) -> None:
    from transformers import AutoTokenizer

    from miles.recipes.tiny_model import write_tiny_model
    from miles.rollout.engines.server_command import EngineServerConfig

    if args.cpu_rehearsal:
        v.report("SKIP", "install", "CPU rehearsal: the builtin engine stands in for SGLang")
    elif args.engine == "builtin":
        v.report("SKIP", "install", "--engine builtin: the builtin engine serves on the GPU, SGLang is not used")
    else:
        ok, detail = install_sglang(Path(args.sglang_venv), args.sglang_version, timeout_s=max(30.0, v.left() - 300))
        v.report("PASS" if ok else "FAIL", "install", detail)
        if not ok:
            return
    work = Path(args.work)
    # head_dim 64: SGLang's attention kernels do not take tiny heads.
    model_dir = write_tiny_model(work / "model", arch="llama", hidden_size=256, num_heads=4, num_kv_heads=4)
    adapters = make_adapters(model_dir, work / "adapters")
    device = "cpu" if args.cpu_rehearsal else "cuda"
    ref = Reference(model_dir, adapters, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    v.report("PASS", "adapters", f"tiny Llama at {model_dir}, adapters {sorted(adapters)} (rank {RANK})")
    python = str(Path(args.sglang_venv) / "bin" / "python")

    def config(mode: str) -> EngineServerConfig:
        if args.engine == "builtin":
            return EngineServerConfig(kind="builtin", model_path=str(model_dir), n_slots=2, max_lora_rank=RANK,
                                      target_modules="all-linear", dtype="float32", device=device, lora_update=mode)
        return EngineServerConfig(kind="sglang", model_path=str(model_dir), n_slots=2, max_lora_rank=RANK,
                                  target_modules="all-linear", dtype="float32", device="cuda", lora_update=mode,
                                  python=python, extra_args=tuple(args.sglang_args.split()))

    await check_versioned(v, config("versioned"), work, ref, tokenizer)
    in_place_gap: str | None = f"only {v.left():.0f} s of the budget left to check it"
    if device == "cuda" and torch.cuda.device_count() < 2:
        in_place_gap = (f"a broadcast push needs the engine on a GPU of its own (NCCL puts no two ranks of a "
                        f"group on one device); {torch.cuda.device_count()} present")
        v.report("SKIP", "in-place", in_place_gap)
    elif v.left() > 90:
        in_place_gap = await check_in_place(v, config("in_place"), work, ref, tokenizer)
    else:
        v.report("SKIP", "in-place", in_place_gap)
    data_dir = work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    write_arithmetic_data(data_dir / "add.jsonl", "+", seed=1)
    write_arithmetic_data(data_dir / "sub.jsonl", "-", seed=2)
    trainers = TrainerRuns(args, v, model_dir, work, data_dir)
    try:
        await trainers.check("service-versioned", run_service_scenario, mode="versioned")
        await trainers.check("service-in-place", run_service_scenario, mode="in_place", unsupported=in_place_gap)
        check_megatron(v, model_dir, 1, device)
        if args.cpu_rehearsal:  # TP 2 on CPU is covered by tests/backends/megatron
            v.report("SKIP", "megatron-tp2", "CPU rehearsal")
        else:
            check_megatron(v, model_dir, 2, device)
        await trainers.check("megatron-engine-tp1", run_two_adapters, mode=trainers.mode(1, in_place_gap),
                             backend="megatron", tp=1)
        if args.cpu_rehearsal:  # TP 2 end to end on CPU: tests/backends/megatron/test_megatron_service.py
            v.report("SKIP", "megatron-engine-tp2", "CPU rehearsal")
        else:
            await trainers.check("megatron-engine-tp2", run_two_adapters, mode=trainers.mode(2, in_place_gap),
                                 backend="megatron", tp=2)
    finally:
        trainers.shutdown()


class TrainerRuns:
    """Runs the real trainer once per check on a Ray cluster of this script's, one verdict each.

    GPUs: one per train rank and one for the SGLang engine. With fewer, a one-rank run with
    versioned pushes shares the GPU (train rank and engine on device 0); a broadcast push
    cannot (NCCL puts no two ranks of a group on one GPU), nor can TP ranks (each needs its own).
    """

    def __init__(self, args: argparse.Namespace, v: Verdicts, model_dir: Path, work: Path, data_dir: Path):
        self.args, self.v, self.model_dir, self.work, self.data_dir = args, v, model_dir, work, data_dir
        self.gpus = 0 if args.cpu_rehearsal else torch.cuda.device_count()
        self._clusters: dict[bool, RayCluster] = {}

    def mode(self, ranks: int, in_place_gap: str | None) -> str:
        """in_place where the engine and the GPUs allow it, else versioned."""
        fits = not isinstance(gpu_plan(self.gpus, 0 if self.args.cpu_rehearsal else ranks, "in_place"), str)
        return "in_place" if in_place_gap is None and fits else "versioned"

    def _cluster(self, ranks: int, mode: str) -> RayCluster | str:
        """The cluster this run fits on, or why none does."""
        plan = gpu_plan(self.gpus, 0 if self.args.cpu_rehearsal else ranks, mode)
        if isinstance(plan, str):
            return plan
        advertised, share = plan
        if share not in self._clusters:
            for other in list(self._clusters):  # one cluster at a time
                self._clusters.pop(other).shutdown()
            self._clusters[share] = RayCluster(gpus=advertised, share_gpus=share)
        return self._clusters[share]

    async def check(self, name: str, scenario, *, mode: str, backend: str = "torch", tp: int = 1,
                    unsupported: str | None = None) -> None:
        if unsupported is not None and mode == "in_place":
            self.v.report("SKIP", name, f"--engine-lora-update in_place: {unsupported}")
            return
        if not self.v.wanted(name, min_left_s=2 * STOP_S + 60):
            return
        cluster = self._cluster(tp, mode)
        if isinstance(cluster, str):
            self.v.report("SKIP", name, cluster)
            return
        run_dir = self.work / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        # Port 0: the control plane binds a free port itself and the trainer logs its URL (a port
        # picked here could be taken by another process before the trainer binds it).
        flags = trainer_flags(self.args, self.model_dir, run_dir, self.data_dir, mode=mode, port=0,
                              backend=backend, tp=tp)
        # The scenario, then SIGTERM's saves and exit, all within the run's cap and the budget.
        deadline = time.monotonic() + min(TRAINER_RUN_CAP_S - STOP_S, self.v.left() - STOP_S - 5)
        started = time.monotonic()
        trainer = TrainerProcess(flags, run_dir / "trainer.log", cluster.address)
        what = (f"--engine-lora-update {mode}, --train-backend {backend}"
                + (f" TP {tp}" if backend == "megatron" else ""))
        try:
            detail = await asyncio.to_thread(
                lambda: scenario(trainer, trainer.wait_for_api_url(deadline), self.data_dir, deadline))
            code = await asyncio.to_thread(trainer.stop, deadline + STOP_S)
        except Exception as exc:  # one verdict line, whatever broke
            trainer.kill()
            if not isinstance(exc, StepFailed):
                exc = StepFailed(f"{type(exc).__name__}: {str(exc)[:300]}")
            if NO_IN_PLACE_ROUTE in trainer.log():
                self.v.report("SKIP", name, "--engine-lora-update in_place is unsupported by this SGLang build "
                                            f"({NO_IN_PLACE_ROUTE})")
            else:
                self.v.report("FAIL", name, f"{what}: {exc} (log: {run_dir / 'trainer.log'})")
            return
        finally:
            trainer.kill()
        if code != 0:
            self.v.report("FAIL", name, f"{what}: {detail}; but the trainer exited {code} at SIGTERM: {trainer.tail()}")
            return
        self.v.report("PASS", name,
                      f"{what}: {detail}; saved and exited at SIGTERM ({time.monotonic() - started:.0f} s)")

    def shutdown(self) -> None:
        for cluster in self._clusters.values():
            cluster.shutdown()
        self._clusters.clear()


# ---- the trainer end to end: service scenario and a Megatron run, on a Ray cluster of our own ----

TRAINER = "miles.main.train_multi_lora_async"
TRAINER_RUN_CAP_S = 150.0
"""Most seconds one trainer run may take (start, adapters stepping, SIGTERM and exit)."""
STOP_S = 30.0
"""Of which at most this long for SIGTERM: the final saves, engines and Ray actors stopped."""
NO_IN_PLACE_ROUTE = "no /load_lora_adapter_from_distributed"
"""What the engine actor says when an SGLang build cannot replace a LoRA in place."""


def gpu_plan(gpus: int, train_ranks: int, mode: str) -> tuple[int, bool] | str:
    """(GPUs the Ray cluster advertises, whether they are shared) for a trainer run of
    `train_ranks` GPU ranks (0: on CPU) and one SGLang engine on a machine with `gpus`; or why
    it cannot run there. One rank and versioned pushes share: the train rank and the engine
    both use device 0. A broadcast push cannot (NCCL puts no two ranks of a group on one
    device), nor can TP ranks (each needs a device of its own)."""
    need = train_ranks + 1 if train_ranks else 0
    if need <= gpus:
        return gpus, False
    if train_ranks > 1 or mode == "in_place":
        why = "TP ranks need a GPU each" if train_ranks > 1 else "a broadcast push needs the engine on a GPU of its own"
        return f"needs {need} GPUs ({train_ranks} train rank(s) + 1 SGLang engine: {why}); {gpus} present"
    return need, True


class StepFailed(AssertionError):
    """A trainer check went wrong; the message is the verdict's detail."""


def write_arithmetic_data(path: Path, op: str, seed: int, n: int = 200) -> Path:
    import json
    import random

    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            fh.write(json.dumps({"text": f"{a}{op}{b}=", "label": str(a + b if op == "+" else a - b)}) + "\n")
    return path


class RayCluster:
    """A local Ray cluster the trainers join (RAY_ADDRESS), as `ray job submit` runs them.

    `share_gpus`: more GPUs are advertised than there are, and Ray leaves CUDA_VISIBLE_DEVICES
    alone, so a train rank and an SGLang engine share a device (one-GPU machines).
    """

    def __init__(self, gpus: int, share_gpus: bool):
        from ray.cluster_utils import Cluster

        self.gpus, self.share_gpus = gpus, share_gpus
        saved = os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")
        if share_gpus:  # read by the raylet and the workers it starts
            os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": max(os.cpu_count() or 1, 8), "num_gpus": gpus, "include_dashboard": False})
        finally:
            if saved is None:
                os.environ.pop("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = saved
        self.address = self.cluster.address

    def shutdown(self) -> None:
        self.cluster.shutdown()


API_URL_LINE = re.compile(r"Multi-LoRA controller API at (http://\S+?:\d+)")


class TrainerProcess:
    """`python -m miles.main.train_multi_lora_async FLAGS` on the cluster, its log in a file."""

    def __init__(self, flags: list[str], log_path: Path, ray_address: str):
        env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", TRAINER, *flags], cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 400) -> str:
        return " | ".join(self.log().strip().splitlines()[-3:])[-n:]

    def wait_until(self, predicate, deadline: float, what: str, poll_s: float = 0.5):
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise StepFailed(f"the trainer exited ({self.proc.returncode}) while waiting for {what}: {self.tail()}")
            time.sleep(poll_s)
        raise StepFailed(f"timed out waiting for {what}: {self.tail()}")

    def wait_for_api_url(self, deadline: float) -> str:
        """The control plane's URL, from the line the trainer logs once it is bound."""
        found = self.wait_until(lambda: API_URL_LINE.search(self.log()), deadline, "the control plane's address")
        return found.group(1)

    def wait_for_http(self, url: str, deadline: float) -> None:
        import httpx

        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait_until(healthy, deadline, "the control plane")

    def stop(self, deadline: float) -> int:
        """SIGTERM (every loaded adapter is saved), then the exit code; SIGKILL past the deadline."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return -signal.SIGKILL
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


def trainer_flags(args: argparse.Namespace, model_dir: Path, run_dir: Path, data_dir: Path, *, mode: str,
                  port: int, backend: str = "torch", tp: int = 1) -> list[str]:
    """The fewest steps on the tiny model: two groups of four samples per step, short answers."""
    flags = ["--hf-checkpoint", str(model_dir), "--multi-lora-n-adapters", "2", "--lora-rank", str(RANK),
             "--multi-lora-api-port", str(port), "--multi-lora-allowed-roots", str(data_dir), str(run_dir),
             "--multi-lora-idle-poll-s", "0.5", "--multi-lora-max-empty-wait-s", "60",
             "--multi-lora-max-coalesce-wait-s", "0.2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
             "--rollout-max-response-len", "8", "--rollout-num-engines", "1", "--rm-type", "random", "--lr", "1e-3",
             "--save", str(run_dir / "save"), "--engine-lora-update", mode, "--train-backend", backend]
    if backend == "megatron":
        flags += ["--tensor-model-parallel-size", str(tp)]
    if args.cpu_rehearsal:
        return flags + ["--rollout-engine", "builtin", "--device", "cpu", "--dtype", "float32"]
    if args.engine == "builtin":
        return flags + ["--rollout-engine", "builtin", "--device", "cuda", "--dtype", "bfloat16"]
    # The SGLang flags of this script, as the trainer takes them (--NAME -> --sglang-NAME).
    sglang = [f"--sglang-{token[2:]}" if token.startswith("--") else token for token in args.sglang_args.split()]
    return flags + ["--rollout-engine", "sglang", "--engine-python", str(Path(args.sglang_venv) / "bin" / "python"),
                    "--device", "cuda", "--dtype", "bfloat16", *sglang]


def run_service_scenario(trainer: TrainerProcess, url: str, data_dir: Path, deadline: float) -> str:
    """One adapter joins and one retires mid-run; returns the verdict's detail."""
    from miles.controller.client import ControlPlaneClient
    from miles.utils.types import AdapterState

    trainer.wait_for_http(url, deadline)
    client = ControlPlaneClient(url)
    add, sub = str(data_dir / "add.jsonl"), str(data_dir / "sub.jsonl")
    client.register("first", config={"data": add})
    trainer.wait_until(lambda: client.status("first").step >= 1, deadline, "'first' to step")
    client.register("second", config={"data": sub})  # joins mid-run
    first_at_join = client.status("first").step
    trainer.wait_until(lambda: client.status("second").step >= 1, deadline, "'second' (joined mid-run) to step")
    trainer.wait_until(lambda: client.status("first").step > first_at_join, deadline,
                       "'first' to keep stepping beside 'second'")
    client.deregister("first")  # retires mid-run
    trainer.wait_until(lambda: client.status("first").state is AdapterState.COMPLETED, deadline, "'first' to retire")
    first = client.status("first")
    second_at_retire = client.status("second").step
    trainer.wait_until(lambda: client.status("second").step > second_at_retire, deadline,
                       "'second' to keep stepping after 'first' retired")
    if "Adapter 'first' cleaned up" not in trainer.log():
        raise StepFailed("'first' is COMPLETED but the trainer never cleaned its slot up")
    # Two slots: a third adapter fits only in the one 'first' freed.
    third_slot = client.register("third", config={"data": add})
    if third_slot != first.slot:
        raise StepFailed(f"'third' got slot {third_slot}, not slot {first.slot} that 'first' left")
    return (f"'first' stepped {first_at_join} time(s) alone, 'second' joined and both stepped; 'first' retired at "
            f"step {first.step} (slot {first.slot} freed: cleaned up, unloaded, taken by 'third'), "
            f"'second' at step {client.status('second').step}")


def run_two_adapters(trainer: TrainerProcess, url: str, data_dir: Path, deadline: float) -> str:
    """Two adapters registered together, each steps twice; returns the verdict's detail."""
    from miles.controller.client import ControlPlaneClient

    trainer.wait_for_http(url, deadline)
    client = ControlPlaneClient(url)
    client.register("first", config={"data": str(data_dir / "add.jsonl")})
    client.register("second", config={"data": str(data_dir / "sub.jsonl")})
    for name in ("first", "second"):
        trainer.wait_until(lambda: client.status(name).step >= 2, deadline, f"'{name}' to step twice")
    steps = {name: client.status(name).step for name in ("first", "second")}
    return f"two adapters trained at once: steps {steps}"



def check_megatron(v: Verdicts, model_dir: Path, tp: int, device: str) -> None:
    """The Megatron check prints its own verdict line; a crash or a time-out is one FAIL line."""
    if not v.wanted(f"megatron-tp{tp}"):
        return
    dtype = "bfloat16" if device == "cuda" else "float32"
    command = [sys.executable, "-m", "miles.backends.megatron.gpu_check", "--hf-checkpoint", str(model_dir),
               "--device", device, "--dtype", dtype, "--tp", str(tp)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=v.left() - 10, cwd=ROOT)
    except subprocess.TimeoutExpired:
        v.report("FAIL", f"megatron-tp{tp}", "did not finish within the budget")
        return
    line = subprocess_verdict(f"megatron-tp{tp}", done)
    print(f"{line} [{time.monotonic() - v.started:.0f} s]", flush=True)
    v.failed |= line.startswith("FAIL")


def subprocess_verdict(check: str, done: subprocess.CompletedProcess) -> str:
    """The verdict line a check's subprocess printed last, or a FAIL line where it printed
    none or its exit code contradicts it (a crash after a PASS line, a FAIL that exits 0)."""
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("PASS ", "FAIL ", "SKIP "))]
    if verdicts and (done.returncode == 0) != verdicts[-1].startswith("FAIL "):
        return verdicts[-1]
    return (f"FAIL {check}: exit {done.returncode} after {verdicts[-1] if verdicts else 'no verdict'}: "
            f"{(done.stderr or done.stdout)[-300:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(ROOT / ".cache" / "gpu-check"))
    parser.add_argument("--sglang-venv", default=str(ROOT / ".venv-sglang"))
    parser.add_argument("--sglang-version", default="0.5.23")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--sglang-args", default="--mem-fraction-static 0.3 --attention-backend triton "
                        "--sampling-backend pytorch --skip-server-warmup",
                        help="Extra SGLang server flags (float32 needs kernels that take it).")
    parser.add_argument("--engine", default="sglang", choices=("sglang", "builtin"),
                        help="The engine the checks serve with: SGLang (installed by the check) or the builtin "
                             "engine on the GPU (no install: for machines without a package index).")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="Run every check against the builtin engine on CPU (tests this script).")
    parser.add_argument("--skip", nargs="*", default=[], choices=SKIPPABLE,
                        help="Checks not to run (each still prints a SKIP line).")
    args = parser.parse_args(argv)
    if args.cpu_rehearsal:
        args.engine = "builtin"
    if not (torch.cuda.is_available() or args.cpu_rehearsal):
        print("gpu-check needs a CUDA GPU (torch.cuda.is_available() is False); run it on a GPU machine", flush=True)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    verdicts = Verdicts(deadline=time.monotonic() + args.budget_s, skip=frozenset(args.skip))
    started = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(run(args, verdicts), timeout=args.budget_s))
    except TimeoutError:
        verdicts.report("FAIL", "budget", f"the checks did not finish within {args.budget_s:.0f} s")
    except Exception as exc:  # one line per failure, whatever broke
        verdicts.report("FAIL", "error", f"{type(exc).__name__}: {str(exc)[:400]}")
    where = "CPU (rehearsal)" if args.cpu_rehearsal else f"{torch.cuda.get_device_name(0)}, engine {args.engine}"
    print(f"gpu-check finished in {time.monotonic() - started:.0f} s on {where}: "
          f"{'FAILED' if verdicts.failed else 'OK'}", flush=True)
    return 1 if verdicts.failed else 0


if __name__ == "__main__":
    sys.exit(main())
