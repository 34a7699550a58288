"""Faults the multi-LoRA driver survives, and how it stops when it cannot.

- A train call that raises: the batch is dropped (never committed, counted by no
  adapter), the next iteration trains normally; failures in a row stop the run.
- A dead train rank: the run stops with a message naming the fix, every adapter saved.
  Both through the real `run_loop` over fakes (no Ray).
- SIGKILL of the whole trainer (driver and its Ray cluster) mid-run, then a restart
  with the same `--save`: the registry comes back from its SQLite file, every adapter
  resumes from its latest complete checkpoint (never a partial one) and keeps stepping
  from where its data stood. A subprocess trainer on the tiny base, with a train fault
  injected through the test-only `MILES_TEST_FAULT_TRAIN_CALLS` on the way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from lifecycle_fakes import FakeBackend, FakeRollout, InProcessController, InProcessHandle, RecordingPusher

from miles.backends.base import TrainRankLostError, TrainResult
from miles.backends.torch.actor import FAULT_TRAIN_CALLS_ENV
from miles.backends.torch.checkpoint import TRAINER_STATE, latest_checkpoint, read_checkpoint
from miles.main import train_multi_lora_async
from miles.main.launch import Components
from miles.main.progress import RunProgress
from miles.main.stages import Stages
from miles.utils.arguments import MilesConfig
from miles.utils.tracking import MetricsLogger
from miles.utils.types import AdapterState, MultiLoRASnapshot, RolloutBatch


class FlakyBackend(FakeBackend):
    """Train raises for the listed rollouts: RuntimeError, or a lost rank."""

    def __init__(self, fail: set[int], *, rank_lost: bool = False) -> None:
        super().__init__()
        self.fail, self.rank_lost = fail, rank_lost

    async def train(self, rollout_id: int, batch: RolloutBatch) -> TrainResult:
        if rollout_id in self.fail:
            if self.rank_lost:
                raise TrainRankLostError(f"a train rank died while training rollout {rollout_id}")
            raise RuntimeError(f"injected fault in rollout {rollout_id}")
        return await super().train(rollout_id, batch)


class CommitLog(InProcessController):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.committed: list[int] = []

    async def mark_batch_trained(self, rollout_id: int) -> MultiLoRASnapshot:
        self.committed.append(rollout_id)
        return await super().mark_batch_trained(rollout_id)


def _trainer(tmp_path, backend: FakeBackend):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "1+1=", "label": "2"}) + "\n")
    controller = CommitLog(1, rollout_batch_size=2, n_samples_per_prompt=2, rm_type="math",
                           save=str(tmp_path / "save"))
    handle = InProcessHandle(controller)
    rollout = FakeRollout(handle)
    stages = Stages.build(backend, handle, InProcessHandle(rollout), save_interval=1, pusher=RecordingPusher())
    components = Components(handle, InProcessHandle(rollout), backend, stages)
    return controller, rollout, components, str(data)


async def _run(tmp_path, components) -> None:
    cfg = MilesConfig(multi_lora_n_adapters=1, multi_lora_disable_service_mode=True)
    progress = RunProgress(MetricsLogger(tmp_path / "run"))
    await train_multi_lora_async.run_loop(cfg, components, asyncio.Event(), progress)


async def test_a_failed_train_call_drops_its_batch_and_the_next_one_trains(tmp_path, caplog):
    backend = FlakyBackend({1})
    controller, rollout, components, data = _trainer(tmp_path, backend)
    await controller.register_adapter("a", config={"data": data, "num_step": 2})
    with caplog.at_level(logging.ERROR):
        await _run(tmp_path, components)
    status = controller.backend.adapter_status("a")
    assert status.state is AdapterState.COMPLETED and status.step == 2
    assert controller.committed == [0, 2]  # rollout 1 never reached the registry
    assert backend.disk[status.save][2].weights == 8  # two steps of 4 samples: the dropped batch counts nowhere
    assert rollout.group_indices["a"] == [0, 1, 2, 3, 4, 5]  # its prompts (2, 3) are consumed, not retrained
    assert "Training rollout 1 failed (RuntimeError: injected fault in rollout 1); its batch is dropped" in caplog.text
    assert components.stages.train.failures == 0  # reset by the batch that trained


async def test_failures_in_a_row_stop_the_run(tmp_path):
    backend = FlakyBackend({0, 1, 2, 3})
    controller, _, components, data = _trainer(tmp_path, backend)
    await controller.register_adapter("a", config={"data": data, "num_step": 2})
    with pytest.raises(RuntimeError, match="injected fault in rollout 2"):
        await _run(tmp_path, components)
    assert controller.committed == [] and controller.backend.adapter_status("a").step == 0


async def test_a_dead_train_rank_stops_the_run_with_every_adapter_saved(tmp_path, caplog):
    backend = FlakyBackend({1}, rank_lost=True)
    controller, _, components, data = _trainer(tmp_path, backend)
    await controller.register_adapter("a", config={"data": data, "num_step": 5})
    with caplog.at_level(logging.ERROR), pytest.raises(TrainRankLostError):
        await _run(tmp_path, components)
    assert "Stopping: every adapter is saved from the surviving ranks; start the trainer again with the " \
           "same --save" in caplog.text
    assert controller.committed == [0]
    # What `trainer_run` does on the way out (save_interval=1 already saved step 1; nothing newer is lost).
    await components.stages.slots.save_all()
    status = controller.backend.adapter_status("a")
    assert status.step == 1 and max(backend.disk[status.save]) == 1


# ---- SIGKILL of the whole trainer, then a restart with the same --save ----------------------

TRAINER = "miles.main.train_multi_lora_async"


def _wait(predicate, timeout: float, what: str, driver):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if driver.proc.poll() is not None:
            raise AssertionError(f"trainer exited while waiting for {what}:\n{driver.log_tail()}")
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{driver.log_tail()}")


def _plant_partial_checkpoints(save_dir: Path, latest: Path) -> None:
    """What a crash can leave: a temp directory mid-write, and a higher step dir without its
    trainer state (the last file a save writes)."""
    root = save_dir / "checkpoints"
    shutil.copytree(latest, root / ".tmp-step_999-crashed")
    partial = root / "step_998"
    shutil.copytree(latest, partial)
    (partial / TRAINER_STATE).unlink()


@pytest.mark.slow
def test_sigkill_of_the_trainer_then_restart_resumes_every_adapter_and_the_registry(
        tiny_model_dir, tmp_path, monkeypatch):
    from driver_harness import DriverProcess, free_port, tiny_run_flags, write_arithmetic_dataset

    from miles.controller.client import ControlPlaneClient

    data = tmp_path / "data"
    data.mkdir()
    datasets = {"add": write_arithmetic_dataset(data / "add.jsonl", 200, op="+", seed=1),
                "sub": write_arithmetic_dataset(data / "sub.jsonl", 200, op="-", seed=2)}
    save = tmp_path / "save"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = tiny_run_flags(tiny_model_dir, save, n_adapters=2, port=port) + ["--save-interval", "1"]

    # First run: the second train call of the rank raises (test hook); the run goes on.
    monkeypatch.setenv(FAULT_TRAIN_CALLS_ENV, "2")
    first = DriverProcess(TRAINER, flags, tmp_path / "first.log")
    try:
        first.wait_for_http(url)
        client = ControlPlaneClient(url)
        for name, path in datasets.items():
            client.register(name, config={"data": str(path)})
        _wait(lambda: all(client.status(n).step >= 2 for n in datasets), 150, "both adapters to step twice", first)
        assert "its batch is dropped and counts for no adapter" in first.log_path.read_text()
        before = {n: client.status(n) for n in datasets}
        first.kill()  # SIGKILL to the driver and every process of its session (its Ray cluster)
    finally:
        first.kill()

    latest = {}
    for name in datasets:
        save_dir = Path(before[name].save)
        latest[name] = latest_checkpoint(save_dir)
        assert latest[name] is not None
        _plant_partial_checkpoints(save_dir, latest[name])
        assert latest_checkpoint(save_dir) == latest[name]  # neither leftover is picked

    monkeypatch.delenv(FAULT_TRAIN_CALLS_ENV)
    started = time.monotonic()
    second = DriverProcess(TRAINER, flags, tmp_path / "second.log")
    try:
        second.wait_for_http(url)
        client = ControlPlaneClient(url)
        # The registry is back from {save}/controller/registry.sqlite: nothing is re-POSTed.
        listed = {s.name: s for s in client.list()}
        assert set(listed) == set(datasets)
        assert all(listed[n].registration_id == before[n].registration_id for n in datasets)
        resumed = {}
        for name in datasets:
            ckpt = read_checkpoint(latest[name])
            line = f"Adapter '{name}' resumed from {latest[name]} (step {ckpt.trainer_state.step})"
            _wait(lambda: line in second.log_path.read_text(), 120, f"{name} to resume", second)
            resumed[name] = ckpt.trainer_state
        _wait(lambda: all(client.status(n).step > resumed[n].step for n in datasets), 120,
              "both adapters to step after the resume", second)
        resume_s = time.monotonic() - started
        for name in datasets:
            path = Path(before[name].save) / "checkpoints" / f"step_{resumed[name].step + 1}"
            _wait(lambda: latest_checkpoint(before[name].save) not in (None, latest[name]), 60,
                  f"{name}'s first checkpoint after the resume", second)
            after = read_checkpoint(path).trainer_state
            # Its data continued from the resumed position instead of starting over.
            assert after.data_position.index > resumed[name].data_position.index, (name, after, resumed[name])
            assert after.registration_id == before[name].registration_id
        print(f"restart to the first step of both resumed adapters: {resume_s:.1f}s")
        assert second.terminate() == 0, second.log_tail()
    finally:
        second.kill()
