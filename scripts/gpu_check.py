"""The GPU check of the SGLang path: real SGLang serving pushed LoRAs agrees with PEFT and the trainer.

    make gpu-check                         # = python scripts/gpu_check.py
    python scripts/gpu_check.py --work /tmp/gpu-check --sglang-venv .venv-sglang

Needs CUDA; without it, it says so and exits 2 (`--cpu-rehearsal` runs the same checks
against the builtin engine on CPU, to test this script itself). It runs unattended in at most
`--budget-s` (480 s) and prints one verdict line per check, `PASS|FAIL|SKIP <check>:
<detail>`, then exits 1 if any check failed:

  install        SGLang (`--sglang-version`, 0.5.23) in a virtual environment of its own
                 (it pins torch and transformers other than the trainer's), reused if present
  adapters       a tiny Llama built locally (no download) and two random PEFT adapters
  sglang-peft    SGLang serving both pushed adapters (versioned pushes) gives PEFT's greedy tokens
  sglang-trainer SGLang's logprobs are within 1e-2 of the trainer's multi-LoRA model
  push-in-flight a push while requests are in flight fails none of them; the new version
                 then serves the new weights
  in-place       a broadcast push over NCCL (`/load_lora_adapter_from_distributed` with
                 upsert) serves the sent weights; SKIP on SGLang builds without that route
  service        the end-to-end service scenario with --rollout-engine sglang: SKIP until
                 the driver's push orchestration drives SGLang engines
  megatron-tp1   the Megatron backend on CUDA (bf16) against the torch backend: logprobs of a
  megatron-tp2   mixed batch and LoRA weights after one step within 1e-2 (TP 2: SKIP with
                 fewer than two GPUs)
"""

from __future__ import annotations

import argparse
import asyncio
import os
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


class Verdicts:
    def __init__(self, deadline: float):
        self.deadline = deadline
        self.failed = False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def report(self, status: str, check: str, detail: str) -> None:
        self.failed |= status == "FAIL"
        print(f"{status} {check}: {detail}", flush=True)


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

    from miles.backends import lora

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

        from miles.backends import lora

        self.model_dir, self.adapters, self.device = model_dir, adapters, device
        self.trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        lora.inject_multi_lora(self.trainer, n_slots=len(adapters), max_rank=RANK, target_modules="all-linear")
        self.slots = {}
        for slot, (name, path) in enumerate(sorted(adapters.items())):
            lora.load_peft_adapter(self.trainer, slot, path)
            self.slots[name] = slot
        self._peft = {}

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
        from miles.backends import lora

        ids = torch.tensor([prompt_ids + response_ids], device=self.device)
        with lora.use_slots(self.trainer, [self.slots[adapter]]):
            logits = self.trainer(ids).logits[0].float()
        positions = slice(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1)
        logprobs = torch.log_softmax(logits[positions], dim=-1)
        return logprobs.gather(1, torch.tensor(response_ids, device=self.device)[:, None])[:, 0].tolist()


def peft_payload(path: Path) -> tuple[dict, dict]:
    from miles.backends import lora

    tensors, config = lora.read_peft_dir(path)
    return config, tensors


async def generate(client, url: str, name: str, prompt_ids: list[int], max_new_tokens: int = NEW_TOKENS) -> dict:
    response = await client.post(url + "/generate", json={
        "input_ids": prompt_ids, "lora_path": name, "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})
    response.raise_for_status()
    return response.json()


async def check_versioned(v: Verdicts, cfg, work: Path, ref: Reference, tokenizer) -> None:
    import httpx

    from miles.rollout.engines.engine_actor import EngineServer

    server = EngineServer(cfg, str(work / "engine-versioned"), start_timeout_s=max(60.0, v.left() - 120))
    await server.start()
    try:
        served = {adapter: await server.push_lora(slot, 1, *peft_payload(ref.adapters[adapter]))
                  for slot, adapter in enumerate(("first", "second"))}
        mismatches, worst = [], 0.0
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for adapter, name in served.items():
                for prompt in PROMPTS:
                    prompt_ids = tokenizer.encode(prompt)
                    out = await generate(client, server.url(), name, prompt_ids)
                    if out["output_ids"] != ref.peft_greedy(adapter, prompt_ids):
                        mismatches.append(f"{adapter}/{prompt!r}")
                    engine_lp = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                    trainer_lp = ref.trainer_logprobs(adapter, prompt_ids, out["output_ids"])
                    worst = max([worst, *(abs(a - b) for a, b in zip(engine_lp, trainer_lp))])
            n = len(served) * len(PROMPTS)
            v.report("FAIL" if mismatches else "PASS", "sglang-peft",
                     f"greedy tokens differ from PEFT for {mismatches}" if mismatches
                     else f"{n}/{n} greedy generations equal PEFT's (2 adapters)")
            v.report("PASS" if worst <= LOGPROB_TOL else "FAIL", "sglang-trainer",
                     f"max |logprob(SGLang) - logprob(trainer)| = {worst:.2e} (tolerance {LOGPROB_TOL})")

            # A push while requests of the previous version are in flight.
            prompt_ids = tokenizer.encode(PROMPTS[0])
            in_flight = [asyncio.create_task(generate(client, server.url(), served["first"], prompt_ids, 256))
                         for _ in range(16)]
            await asyncio.sleep(0.2)
            new_name = await server.push_lora(0, 2, *peft_payload(ref.adapters["third"]))
            results = await asyncio.gather(*in_flight, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)
                      or r["meta_info"]["finish_reason"]["type"] == "abort"]
            after = await generate(client, server.url(), new_name, prompt_ids)
            ok = not failed and after["output_ids"] == ref.peft_greedy("third", prompt_ids)
            v.report("PASS" if ok else "FAIL", "push-in-flight",
                     f"{len(results) - len(failed)}/{len(results)} in-flight requests finished; "
                     f"{new_name} serves the new weights: {after['output_ids'] == ref.peft_greedy('third', prompt_ids)}")
    finally:
        await server.shutdown()


async def check_in_place(v: Verdicts, cfg, work: Path, ref: Reference, tokenizer) -> None:
    import httpx

    from miles.backends import weight_sync
    from miles.rollout.engines.engine_actor import EngineConfigError, EngineServer
    from miles.rollout.engines.process import free_port

    server = EngineServer(cfg, str(work / "engine-in-place"), start_timeout_s=max(60.0, v.left() - 60))
    try:
        await server.start()
    except EngineConfigError as exc:
        v.report("SKIP", "in-place", str(exc).split(";")[0])
        await server.shutdown()
        return
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
        if args.cpu_rehearsal:
            return EngineServerConfig(kind="builtin", model_path=str(model_dir), n_slots=2, max_lora_rank=RANK,
                                      target_modules="all-linear", dtype="float32", device="cpu", lora_update=mode)
        return EngineServerConfig(kind="sglang", model_path=str(model_dir), n_slots=2, max_lora_rank=RANK,
                                  target_modules="all-linear", dtype="float32", device="cuda", lora_update=mode,
                                  python=python, extra_args=tuple(args.sglang_args.split()))

    await check_versioned(v, config("versioned"), work, ref, tokenizer)
    if v.left() > 90:
        await check_in_place(v, config("in_place"), work, ref, tokenizer)
    else:
        v.report("SKIP", "in-place", f"only {v.left():.0f} s of the budget left")
    v.report("SKIP", "service", "the driver's push orchestration does not drive SGLang engines yet")
    check_megatron(v, model_dir, 1, device)
    if args.cpu_rehearsal:  # TP 2 on CPU is covered by tests/backends/megatron
        v.report("SKIP", "megatron-tp2", "CPU rehearsal")
    else:
        check_megatron(v, model_dir, 2, device)


def check_megatron(v: Verdicts, model_dir: Path, tp: int, device: str) -> None:
    """The Megatron check prints its own verdict line; a crash or a time-out is one FAIL line."""
    if v.left() < 60:
        v.report("SKIP", f"megatron-tp{tp}", f"only {v.left():.0f} s of the budget left")
        return
    dtype = "bfloat16" if device == "cuda" else "float32"
    command = [sys.executable, "-m", "miles.backends.megatron.gpu_check", "--hf-checkpoint", str(model_dir),
               "--device", device, "--dtype", dtype, "--tp", str(tp)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=v.left() - 10, cwd=ROOT)
    except subprocess.TimeoutExpired:
        v.report("FAIL", f"megatron-tp{tp}", "did not finish within the budget")
        return
    verdict = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    if verdict:
        print(verdict[-1], flush=True)
        v.failed |= verdict[-1].startswith("FAIL")
    else:
        v.report("FAIL", f"megatron-tp{tp}", f"exit {done.returncode}: {(done.stderr or done.stdout)[-300:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(ROOT / ".cache" / "gpu-check"))
    parser.add_argument("--sglang-venv", default=str(ROOT / ".venv-sglang"))
    parser.add_argument("--sglang-version", default="0.5.23")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--sglang-args", default="--mem-fraction-static 0.3 --attention-backend triton "
                        "--sampling-backend pytorch --skip-server-warmup",
                        help="Extra SGLang server flags (float32 needs kernels that take it).")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="Run every check against the builtin engine on CPU (tests this script).")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() or args.cpu_rehearsal):
        print("gpu-check needs a CUDA GPU (torch.cuda.is_available() is False); run it on a GPU machine", flush=True)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    verdicts = Verdicts(deadline=time.monotonic() + args.budget_s)
    started = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(run(args, verdicts), timeout=args.budget_s))
    except TimeoutError:
        verdicts.report("FAIL", "budget", f"the checks did not finish within {args.budget_s:.0f} s")
    except Exception as exc:  # one line per failure, whatever broke
        verdicts.report("FAIL", "error", f"{type(exc).__name__}: {str(exc)[:400]}")
    where = "CPU (rehearsal)" if args.cpu_rehearsal else torch.cuda.get_device_name(0)
    print(f"gpu-check finished in {time.monotonic() - started:.0f} s on {where}: "
          f"{'FAILED' if verdicts.failed else 'OK'}", flush=True)
    return 1 if verdicts.failed else 0


if __name__ == "__main__":
    sys.exit(main())
