"""`make gpu-check`: refuses without CUDA; its checks pass when the builtin engine stands in for SGLang.

The CPU rehearsal runs the checks the GPU machine runs (the trainer runs too: the service
scenario and a Megatron run, each update mode in one of them) with the builtin engine and
the CPU backends; what only a GPU machine runs (SGLang's command line, the GPU placement of
a trainer run) is checked here without one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.project_scripts import load_script
from tests.helpers.sglang_flags import check_lora_limits, parser_from_flag_list

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_without_cuda_it_says_so_and_fails():
    done = run(timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stdout


def test_gpu_plan_shares_one_gpu_only_where_it_can():
    plan = load_script("gpu_check.py").gpu_plan
    assert plan(0, 0, "in_place") == (0, False)  # CPU rehearsal
    assert plan(2, 1, "in_place") == (2, False)  # a train rank and an engine, a GPU each
    assert plan(1, 1, "versioned") == (2, True)  # one GPU: train rank and engine share it
    assert "a broadcast push needs the engine on a GPU of its own" in plan(1, 1, "in_place")
    assert "needs 3 GPUs" in plan(2, 2, "versioned")  # TP 2 + an engine
    assert plan(4, 2, "in_place") == (4, False)


def test_logprobs_the_engine_left_out_are_a_fail_not_a_pass():
    """engine-trainer compares one engine logprob per generated token: none, fewer, or no
    generated tokens at all is a reason to FAIL (a string), never a max over nothing."""
    gap = load_script("gpu_check.py").logprob_gap

    def out(n_tokens: int, logprobs: list[float] | None) -> dict:
        meta = {} if logprobs is None else {"output_token_logprobs": [(lp, i, None) for i, lp in enumerate(logprobs)]}
        return {"output_ids": list(range(n_tokens)), "meta_info": meta}

    assert gap(out(2, [-1.0, -2.0]), [-1.0, -2.5]) == pytest.approx(0.5)
    for engine, trainer in [(out(2, []), [-1.0, -2.0]), (out(2, None), [-1.0, -2.0]), (out(2, [-1.0]), [-1.0, -2.0]),
                            (out(2, [-1.0, -2.0]), [-1.0]), (out(0, []), [])]:
        assert "logprobs for" in gap(engine, trainer), (engine, trainer)


def test_a_check_subprocess_passes_only_with_a_pass_line_and_exit_0():
    verdict = load_script("gpu_check.py").subprocess_verdict

    def done(code: int, stdout: str) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], code, stdout, "Traceback: boom")

    assert verdict("megatron-tp1", done(0, "noise\nPASS megatron-tp1: ok\n")) == "PASS megatron-tp1: ok"
    assert verdict("megatron-tp1", done(1, "FAIL megatron-tp1: off\n")) == "FAIL megatron-tp1: off"
    assert verdict("megatron-tp2", done(0, "SKIP megatron-tp2: 1 GPU\n")) == "SKIP megatron-tp2: 1 GPU"
    for code, stdout in [(1, "PASS megatron-tp1: ok\n"), (0, "FAIL megatron-tp1: off\n"), (0, ""), (-9, "")]:
        line = verdict("megatron-tp1", done(code, stdout))
        assert line.startswith(f"FAIL megatron-tp1: exit {code} after ") and "boom" in line, line


def test_the_megatron_check_fails_when_a_side_has_fewer_values():
    """miles.backends.megatron.gpu_check compares every response logprob and every LoRA
    tensor of both backends; a side with fewer (or none) is a FAIL, not a max over the rest."""
    import torch

    from miles.backends.megatron import gpu_check as megatron_check

    vocab = 100
    lengths = [len(s.response_ids) for s in megatron_check._probe(megatron_check._samples(vocab)[0])]
    full = {"logprobs": [[-1.0] * n for n in lengths],
            "lora": {n: {"w.lora_A.weight": torch.zeros(2)} for n in megatron_check.ADAPTERS}}
    assert megatron_check._not_alike(full, full, vocab) is None
    short = {**full, "logprobs": [xs[:-1] for xs in full["logprobs"]]}
    for meg, ref in [({**full, "logprobs": []}, full), (full, short), (short, short)]:
        assert "logprobs per sample" in megatron_check._not_alike(meg, ref, vocab)
    no_lora = {**full, "lora": {n: {} for n in megatron_check.ADAPTERS}}
    for meg, ref in [(no_lora, full), (no_lora, no_lora), ({**full, "lora": {"a": full["lora"]["a"]}}, full)]:
        assert "LoRA tensors" in megatron_check._not_alike(meg, ref, vocab)


@pytest.mark.parametrize("mode, backend, tp", [("versioned", "torch", 1), ("in_place", "torch", 1),
                                               ("versioned", "megatron", 1), ("versioned", "megatron", 2)])
def test_gpu_trainer_flags_make_a_command_sglang_0_5_takes(tmp_path, mode, backend, tp):
    """The trainer flags of each GPU run parse, and the SGLang server command built from them
    uses only SGLang 0.5.23's flags, with the check's SGLang flags passed through."""
    from miles.rollout.engines.server_command import EngineServerConfig, build_sglang_command
    from miles.utils.arguments import parse_args

    gpu_check = load_script("gpu_check.py")
    args = argparse.Namespace(cpu_rehearsal=False, engine="sglang", sglang_venv=str(tmp_path / "venv"),
                              sglang_args="--mem-fraction-static 0.3 --attention-backend triton --skip-server-warmup")
    flags = gpu_check.trainer_flags(args, tmp_path / "model", tmp_path / "run", tmp_path / "data", mode=mode,
                                    port=8123, backend=backend, tp=tp)
    cfg = parse_args(flags)
    assert (cfg.rollout_engine, cfg.device, cfg.dtype, cfg.engine_lora_update) == ("sglang", "cuda", "bfloat16", mode)
    assert (cfg.train_backend, cfg.tensor_model_parallel_size) == (backend, tp)
    assert cfg.engine_python == str(tmp_path / "venv" / "bin" / "python")
    argv = build_sglang_command(EngineServerConfig.from_config(cfg, lora_update=mode), "127.0.0.1", 30001)
    assert argv[0] == cfg.engine_python
    parsed, unknown = parser_from_flag_list().parse_known_args(argv[3:])
    assert unknown == [], f"not SGLang 0.5 flags: {unknown}"
    check_lora_limits(mode, parsed, cfg.multi_lora_n_adapters)
    assert parsed.mem_fraction_static == 0.3 and parsed.attention_backend == "triton" and parsed.skip_server_warmup
    assert parsed.dtype == "bfloat16"


@pytest.mark.slow
@pytest.mark.timeout(1020)
def test_cpu_rehearsal_passes_every_check(tmp_path):
    """Every check a single GPU runs, here on CPU: the three trainer runs (service scenario in
    both update modes, a Megatron trainer) and Megatron against the torch backend. Skipped by
    the script itself and only those: the SGLang install (the builtin engine stands in; its
    command line is checked by test_gpu_trainer_flags_make_a_command_sglang_0_5_takes) and the
    TP 2 checks, which need GPUs of their own (TP 2 on CPU: tests/backends/megatron/
    test_megatron_vs_torch.py and test_megatron_service.py). Several minutes on 2 cores: the
    budget is the default's twice."""
    done = run("--cpu-rehearsal", "--work", str(tmp_path), "--budget-s", "960", timeout=1000)
    verdicts = [line for line in done.stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    checks = {line.split(" ", 2)[1].rstrip(":"): line.split(" ", 1)[0] for line in verdicts}
    assert checks == {"install": "SKIP", "adapters": "PASS", "engine-peft": "PASS", "engine-trainer": "PASS",
                      "push-in-flight": "PASS", "in-place": "PASS", "service-versioned": "PASS",
                      "service-in-place": "PASS", "megatron-tp1": "PASS", "megatron-tp2": "SKIP",
                      "megatron-engine-tp1": "PASS", "megatron-engine-tp2": "SKIP"}
    lines = {line.split(" ", 2)[1].rstrip(":"): line for line in verdicts}
    assert "SKIP install: CPU rehearsal: the builtin engine stands in for SGLang" in lines["install"]
    assert "SKIP megatron-tp2: CPU rehearsal" in lines["megatron-tp2"]
    assert "SKIP megatron-engine-tp2: CPU rehearsal" in lines["megatron-engine-tp2"]
    assert "--engine-lora-update in_place, --train-backend torch" in lines["service-in-place"]
    assert "'first' retired" in lines["service-in-place"] and "taken by 'third'" in lines["service-in-place"]
    assert "Megatron vs torch backend" in lines["megatron-tp1"]
    assert "--train-backend megatron TP 1" in lines["megatron-engine-tp1"]
    assert "two adapters trained at once" in lines["megatron-engine-tp1"]
    assert "--engine-lora-update versioned, --train-backend torch" in lines["service-versioned"]
    assert "'first' retired" in lines["service-versioned"] and "taken by 'third'" in lines["service-versioned"]
    assert (tmp_path / "service-versioned" / "save" / "adapters" / "second" / "checkpoints").is_dir()
