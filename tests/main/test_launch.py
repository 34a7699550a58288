"""What the launcher hands its components: the controller's registration hooks (the
dataset rows that fit `--rollout-max-prompt-len`, so `num_step` is derived after the
filter as in Miles), the run's metrics logger (Miles' W&B flags), and the Ray instance a
driver without RAY_ADDRESS starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from miles.controller.backend import MultiLoRABackend
from miles.main import launch as launch_module
from miles.recipes.tiny_model import build_char_tokenizer
from miles.rollout.data_source import DatasetCheck
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.arguments import parse_args
from miles.utils.tracking import MetricsLogger


@pytest.mark.parametrize("max_len, num_step", [(None, 5), (4, 3)])
async def test_num_step_is_counted_after_the_max_prompt_len_filter(tmp_path, max_len, num_step):
    tokenizer_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * n, "label": str(n)}) + "\n" for n in (2, 7, 3, 9, 4)))
    argv = ["--hf-checkpoint", str(tokenizer_dir), "--multi-lora-n-adapters", "2", "--rm-type", "math",
            "--save", str(tmp_path / "save")]
    cfg = parse_args(argv + ([] if max_len is None else ["--rollout-max-prompt-len", str(max_len)]))
    hooks = launch_module.controller_hooks(cfg)
    assert hooks.validate_dataset == DatasetCheck.from_config(cfg)
    backend = MultiLoRABackend(cfg.multi_lora_n_adapters, AdapterDefaults.from_config(cfg), None, hooks)
    await backend.register("a", config={"data": str(data), "label_key": "label", "rollout_batch_size": 1,
                                        "n_samples_per_prompt": 2})
    assert backend.registry.snapshot().pending["a"].config.num_step == num_step


async def test_the_run_logs_with_miles_wandb_flags(monkeypatch, tmp_path):
    """`trainer_run` builds its logger with `MetricsLogger.from_config`: the W&B group,
    key and suffix flags reach it."""
    built = []

    def from_config(cfg):
        built.append(cfg)
        return MetricsLogger(tmp_path / "run")  # no W&B in tests

    class Components:
        controller = None

    async def no_launch(cfg):
        return Components()

    async def no_shutdown(components):
        return None

    monkeypatch.setattr(launch_module, "init_ray", lambda cfg: None)
    monkeypatch.setattr(launch_module, "install_stop_handlers", lambda stop: None)
    monkeypatch.setattr(launch_module, "launch", no_launch)
    monkeypatch.setattr(launch_module, "shutdown", no_shutdown)
    monkeypatch.setattr(MetricsLogger, "from_config", staticmethod(from_config))
    cfg = parse_args(["--use-wandb", "--wandb-group", "g", "--disable-wandb-random-suffix"])
    async with launch_module.trainer_run(cfg) as run:
        assert run.progress is not None
    assert built == [cfg]


def test_a_driver_without_ray_address_starts_its_own_ray_beside_another(ray_session):
    """A cluster that `ray start` left on the machine (here: this session's, named in Ray's
    current-cluster file) is not joined without RAY_ADDRESS: joining it with the driver's
    CPU count fails, and it may be anyone's."""
    session = ray_session.get_runtime_context().gcs_address
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths must stay short
    try:
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text(session)
        code = ("import ray; from miles.main.launch import init_ray; from miles.utils.arguments import parse_args; "
                "init_ray(parse_args([])); print(ray.get_runtime_context().gcs_address); ray.shutdown()")
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": str(temp)}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] != session
