"""End-to-end: the `tinker-cookbook` package's own training loops against the trainer.

The cookbook, pinned, runs from a virtualenv of its own (`cookbook_venv.py`: it pins a
`transformers` other than ours; the client needs none of our packages), made once under
`.cache/` from the package registry and reused while the pins stay the same. Its RL recipe
(`math_rl.train` on the generated `arithmetic` problems) and its supervised trainer
(`supervised.train` on the conversations file the wheel ships) run unchanged as subprocesses with `base_url` at the
trainer, on the tiny pretrained base and its tokenizer, with nothing downloaded. The trainer
runs with `--lora-unembed`: the cookbook creates its models with the SDK's default
`train_unembed=True`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from miles.controller.client import ControlPlaneClient
from miles.lora import read_peft_dir
from miles.utils.types import AdapterKind, AdapterState
from tests.helpers import HELPERS_DIR
from tests.helpers.cookbook_venv import CookbookVenvError, ensure_cookbook_venv
from tests.helpers.driver_harness import DriverProcess, tiny_run_flags

pytestmark = pytest.mark.slow

TRAINER = "miles.main.train_multi_lora_async"
SL_ENTRY = HELPERS_DIR / "cookbook_sl_entry.py"
RENDERER = "role_colon"
"""`User: ...` / `Assistant: ...` turns: the only tokens it needs are the text's own, which
the tiny base's tokenizer has. Named explicitly: the cookbook looks up a recommended
renderer by Hugging Face model name, which a local path is not."""
STEPS = 3
RUN_TIMEOUT = 600.0
API_KEY = "tml-local"


def cookbook_env() -> dict[str, str]:
    """The cookbook's process: no token for a hosted service, no telemetry, no hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "RAY_"))}
    return {**env, "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_cookbook(venv: Path, args: list[str], cwd: Path, what: str) -> None:
    log = cwd / f"{what}.out"
    with log.open("w") as out:
        result = subprocess.run([str(venv / "bin" / "python"), *args], cwd=cwd, env=cookbook_env(),
                                stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert result.returncode == 0, f"the cookbook's {what} exited {result.returncode}:\n{tail}"


@dataclass
class CookbookRun:
    metrics: list[dict]
    """The cookbook's own `metrics.jsonl`, one record per step."""
    checkpoints: list[dict]
    """Its `checkpoints.jsonl`: `tinker://` paths the trainer gave it."""

    @property
    def model_id(self) -> str:
        ids = {c["sampler_path"].removeprefix("tinker://").split("/", 1)[0] for c in self.checkpoints}
        assert len(ids) == 1, self.checkpoints
        return ids.pop()


def read_run(log_path: Path) -> CookbookRun:
    def jsonl(name: str) -> list[dict]:
        return [json.loads(line) for line in (log_path / name).read_text().splitlines() if line.strip()]

    return CookbookRun(jsonl("metrics.jsonl"), jsonl("checkpoints.jsonl"))


def assert_saved_on_our_side(run: CookbookRun, save: Path, control: ControlPlaneClient) -> None:
    """Each checkpoint the cookbook recorded is a directory under the trainer's save dir, the
    sampler ones PEFT adapters with the head's LoRA; the model is listed as a client model
    that took every step."""
    status = next((s for s in control.list() if s.model_id == run.model_id), None)
    assert status is not None, f"{run.model_id} not listed by the control plane: {control.list()}"
    assert status.kind is AdapterKind.CLIENT and status.state is AdapterState.ACTIVE, status
    assert status.step == STEPS, status
    adapter_dir = save / "adapters" / status.name
    assert [c["name"] for c in run.checkpoints] == ["000002", "final"], run.checkpoints
    for checkpoint in run.checkpoints:
        assert (adapter_dir / "weights" / checkpoint["name"]).is_dir(), checkpoint
        tensors, config = read_peft_dir(adapter_dir / "sampler_weights" / checkpoint["name"])
        assert "lm_head" in config["target_modules"], config
        assert all(bool(torch.isfinite(t).all()) for t in tensors.values()), checkpoint


def test_the_cookbook_rl_recipe_and_sl_trainer_train_on_the_trainer(tiny_base_dir: Path, tmp_path: Path) -> None:
    try:
        venv = ensure_cookbook_venv()
    except CookbookVenvError as error:
        pytest.fail(str(error))
    save = tmp_path / "save"
    flags = [*tiny_run_flags(tiny_base_dir, save, n_adapters=2), "--lora-unembed"]
    driver = DriverProcess(TRAINER, flags, tmp_path / "trainer.log")
    try:
        url = driver.wait_for_api_url()
        control = ControlPlaneClient(url)

        # RL: the recipe samples groups of answers to generated additions from the trainer's
        # engines, grades them, trains with importance_sampling and saves every 2 steps.
        run_cookbook(venv, [
            "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={tiny_base_dir}",
            f"renderer_name={RENDERER}", f"base_url={url}", "groups_per_batch=4", "group_size=4",
            f"max_steps={STEPS}", "lora_rank=4", "learning_rate=1e-3", "max_tokens=5", "eval_every=0",
            "save_every=2", f"log_path={tmp_path / 'rl'}", "behavior_if_log_dir_exists=delete",
        ], tmp_path, "rl")
        rl = read_run(tmp_path / "rl")
        assert [m["step"] for m in rl.metrics] == list(range(STEPS)), rl.metrics
        for m in rl.metrics:
            assert m["env/all/total_episodes"] == 16, m  # 4 groups of 4 answers sampled each step
            assert all(math.isfinite(m[k]) for k in ("env/all/reward/total", "optim/entropy", "grad_norm")), m
        assert_saved_on_our_side(rl, save, control)

        # SL: the supervised trainer on the conversations the wheel ships (truncated to the
        # tiny base's 128 positions), 4 conversations a step, linear learning-rate decay.
        data = next(venv.glob("lib/python*/site-packages/tinker_cookbook/example_data/conversations.jsonl"))
        builder = "dataset_builder.common_config"
        run_cookbook(venv, [
            str(SL_ENTRY), f"log_path={tmp_path / 'sl'}", f"model_name={tiny_base_dir}", "recipe_name=sl_conversations",
            f"renderer_name={RENDERER}", f"base_url={url}", "lora_rank=4", "learning_rate=1e-3",
            f"max_steps={STEPS}", "save_every=2", "eval_every=0",
            "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
            f"dataset_builder.file_path={data}", f"{builder}.model_name_for_tokenizer={tiny_base_dir}",
            f"{builder}.renderer_name={RENDERER}", f"{builder}.max_length=128", f"{builder}.batch_size=4",
        ], tmp_path, "sl")
        sl = read_run(tmp_path / "sl")
        assert [m["step"] for m in sl.metrics] == list(range(STEPS)), sl.metrics
        nll = [m["train_mean_nll"] for m in sl.metrics]
        assert all(math.isfinite(x) for x in nll) and all(m["num_sequences"] == 4 for m in sl.metrics), sl.metrics
        assert nll[-1] < nll[0], nll  # measured 15.43, 14.81, 14.30
        assert_saved_on_our_side(sl, save, control)

        clients = {s.model_id for s in control.list() if s.kind is AdapterKind.CLIENT}
        assert clients == {rl.model_id, sl.model_id}, clients
        assert driver.terminate() == 0
    finally:
        driver.kill()
