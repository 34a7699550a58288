"""Faults the multi-LoRA driver survives, and how it stops when it cannot.

- A train call that raises: the batch is dropped (never committed, counted by no
  adapter), the next iteration trains normally; failures in a row stop the run.
- A dead train rank: the run stops with a message naming the fix, and the driver's own
  way out (`trainer_run`) saves every adapter. The first two through the real `run_loop`
  over fakes (no Ray), the third through the driver's `main` with `launch` handing it
  those fakes.
- SIGKILL of the whole trainer (driver and its Ray cluster) mid-run, then a restart
  with the same `--save`: the registry comes back from its SQLite file, every adapter
  resumes from its latest complete checkpoint (never a partial one): its first step
  after the resume is one AdamW step from exactly that checkpoint's weights, moments,
  step count and LR clock, and its data continues from where it stood. A subprocess
  trainer on the tiny model, with a train fault injected on the way by the test rank of
  `tests/helpers/fault_injection.py` (`--train-actor-path`, `MILES_TEST_FAULT_TRAIN_CALLS`).
  A Tinker SDK client's model lives through the same restart: it comes back from its latest
  `save_state` with its optimizer, and the client goes on with the same `TrainingClient`.
  Registrations QUEUED while every slot was held come back QUEUED in the same order, and the
  head takes the slot the client's model frees when it is unloaded. A client's model paged
  out while idle (`--multi-lora-idle-evict-s`) with a gradient not yet stepped comes back
  PAGED after a SIGKILL and restart, and its next call pages it in with nothing lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from miles.backends.base import TrainRankLostError, TrainResult
from miles.backends.common.checkpoint import TRAINER_STATE, Checkpoint, latest_checkpoint, read_checkpoint
from miles.main import launch, train_multi_lora_async
from miles.main.launch import Components
from miles.main.progress import RunProgress
from miles.main.stages import Stages
from miles.utils.arguments import MilesConfig
from miles.utils.tracking import MetricsLogger
from miles.utils.types import AdapterState, DataPosition, MultiLoRASnapshot, RolloutBatch
from miles.utils.types.lifecycle_ops import MarkBatchTrained, Transition
from tests.helpers.fault_injection import ACTOR_PATH, FAULT_TRAIN_CALLS_ENV
from tests.helpers.lifecycle_fakes import (
    FakeBackend,
    FakeRollout,
    InProcessController,
    InProcessHandle,
    RecordingPusher,
    SavedAdapter,
)


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

    async def apply(self, op: Transition[Any]) -> MultiLoRASnapshot:
        if isinstance(op, MarkBatchTrained):
            self.committed.append(op.rollout_id)
        return await super().apply(op)


class StoppableRollout(FakeRollout):
    """What the driver's shutdown also calls on the rollout manager."""

    disposed: bool = False

    async def dispose(self) -> None:
        self.disposed = True


def _trainer(tmp_path, backend: FakeBackend, *, n_slots: int = 1, save_interval: int | None = 1):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "1+1=", "label": "2"}) + "\n")
    controller = CommitLog(n_slots, rollout_batch_size=2, n_samples_per_prompt=2, rm_type="math",
                           save=str(tmp_path / "save"))
    handle = InProcessHandle(controller)
    rollout = StoppableRollout(handle)
    stages = Stages.build(backend, handle, InProcessHandle(rollout), save_interval=save_interval,
                          pusher=RecordingPusher())
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


async def test_a_dead_train_rank_stops_the_run_with_every_adapter_saved(tmp_path, caplog, monkeypatch):
    """The driver's `main` as the CLI runs it (trainer_run around run_loop), `launch` handing
    it the fakes: a rank dies while training rollout 1, the run stops with the rank's error,
    and its way out saves both adapters at step 1. No save cadence: only that save writes."""
    backend = FlakyBackend({1}, rank_lost=True)
    controller, rollout, components, data = _trainer(tmp_path, backend, n_slots=2, save_interval=None)
    for name in ("a", "b"):
        await controller.register_adapter(name, config={"data": data, "num_step": 5})

    async def launch_fakes(cfg: MilesConfig) -> Components:
        return components

    monkeypatch.setattr(launch, "init_ray", lambda cfg: None)  # the components are in-process: no Ray
    monkeypatch.setattr(launch, "launch", launch_fakes)
    cfg = MilesConfig(multi_lora_n_adapters=2, multi_lora_disable_service_mode=True, run_dir=str(tmp_path / "run"))
    loop = asyncio.get_running_loop()
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(TrainRankLostError):
            await train_multi_lora_async.main(cfg)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # trainer_run's stop handlers, on the test's loop
            loop.remove_signal_handler(signum)
    assert "Stopping: every adapter is saved from the surviving ranks; start the trainer again with the " \
           "same --save" in caplog.text
    assert controller.committed == [0]
    for name in ("a", "b"):
        status = controller.backend.adapter_status(name)
        # Step 1's weights: two groups of two samples; its data continues after rollout 1's
        # groups (2, 3), which are consumed, not retrained.
        assert status.step == 1 and backend.disk[status.save] == {1: SavedAdapter(4.0, DataPosition(0, 4))}, name
    assert rollout.disposed and backend.calls[-1] == ("shutdown", "")  # then everything stopped


# ---- SIGKILL of the whole trainer, then a restart with the same --save ----------------------

TRAINER = "miles.main.train_multi_lora_async"


def assert_one_adamw_step_from(before: Checkpoint, after: Checkpoint) -> None:
    """`after` holds what one AdamW step (torch's update, written out here) makes of exactly
    `before`'s weights, moments, step count and LR clock, for some gradient g: the moments
    give g (m1 = b1 m0 + (1 - b1) g), which must also give v1 and the new weights. A resume
    from anything else (fresh weights, zero moments, a restarted step count) breaks this."""
    opt0, opt1 = before.optimizer, after.optimizer
    assert (after.trainer_state.step, opt1.step) == (before.trainer_state.step + 1, opt0.step + 1)
    schedule = after.scheduler
    assert (schedule["style"], schedule["warmup_steps"]) == ("constant", 0)  # the lr is the same at every step
    assert schedule["samples_seen"] == before.scheduler["samples_seen"] + schedule["samples_per_step"]
    (b1, b2), eps, lr, wd = opt1.hyper["betas"], opt1.hyper["eps"], opt1.hyper["lr"], opt1.hyper["weight_decay"]
    w0, w1 = (load_file(c.path / "adapter_model.safetensors") for c in (before, after))
    assert set(opt0.exp_avg) == set(opt1.exp_avg) and {f"base_model.model.{k}.weight" for k in opt0.exp_avg} \
        == set(w0) == set(w1)
    t = opt1.step
    moved = 0.0
    for key in opt0.exp_avg:
        m0, v0, m1, v1 = (x[key].double() for x in (opt0.exp_avg, opt0.exp_avg_sq, opt1.exp_avg, opt1.exp_avg_sq))
        weight0, weight1 = (w[f"base_model.model.{key}.weight"].double() for w in (w0, w1))
        g = (m1 - b1 * m0) / (1 - b1)
        torch.testing.assert_close(v1, b2 * v0 + (1 - b2) * g * g, rtol=1e-4, atol=1e-15, msg=key)
        update = lr / (1 - b1**t) * m1 / (v1.sqrt() / math.sqrt(1 - b2**t) + eps)
        torch.testing.assert_close(weight1, weight0 * (1 - lr * wd) - update, rtol=0, atol=1e-7, msg=key)
        moved = max(moved, float((weight1 - weight0).abs().max()))
    assert moved > 1e-5  # the step moved the weights: the equalities above are not 0 == 0


def _plant_partial_checkpoints(save_dir: Path, latest: Path) -> None:
    """What a crash can leave: a temp directory mid-write, and a higher step dir without its
    trainer state (the last file a save writes)."""
    root = save_dir / "checkpoints"
    shutil.copytree(latest, root / ".tmp-step_999-crashed")
    partial = root / "step_998"
    shutil.copytree(latest, partial)
    (partial / TRAINER_STATE).unlink()


def restart_on_the_same_port(url: str, flags: list[str], log: Path):
    """A trainer started with `flags` on the port of `url` (an SDK client has only its
    base_url), once its control plane answers there."""
    from urllib.parse import urlparse

    from tests.helpers.driver_harness import DriverProcess

    port = urlparse(url).port
    assert port is not None
    flags = list(flags)
    flags[flags.index("--multi-lora-api-port") + 1] = str(port)
    trainer = DriverProcess(TRAINER, flags, log)
    try:
        assert trainer.wait_for_api_url() == url
    except BaseException:
        trainer.kill()
        raise
    return trainer


class SdkModel:
    """A Tinker SDK client's model that lives through a trainer's restart (the client process
    keeps running; the trainer comes back on the same port)."""

    LR = 2e-2

    def __init__(self, url: str, base_model: Path) -> None:
        import tinker

        self.service = tinker.ServiceClient(base_url=url, api_key="tml-local")
        self.model = self.service.create_lora_training_client(str(base_model), rank=4, seed=3,
                                                              train_unembed=False).result(timeout=120)

    def step(self) -> float:
        """forward_backward + optim_step on the same two datums; the loss:sum."""
        from tinker import types

        from tests.helpers.driver_harness import cycle_datum

        out = self.model.forward_backward([cycle_datum(0), cycle_datum(2)], "cross_entropy")
        self.model.optim_step(types.AdamParams(learning_rate=self.LR)).result(timeout=120)
        return out.result(timeout=120).metrics["loss:sum"]

    def held_out(self) -> list[float]:
        from tests.helpers.driver_harness import cycle_datum

        return self.model.forward([cycle_datum(1)], "cross_entropy").result(timeout=120).loss_fn_outputs[0][
            "logprobs"].tolist()


@pytest.mark.slow
def test_sigkill_of_the_trainer_then_restart_resumes_every_adapter_and_the_registry(
        tiny_model_dir, tmp_path, monkeypatch):
    """Two server-driven adapters and a Tinker SDK client's model: each resumes from its latest
    checkpoint (the client's: its latest `save_state`, optimizer included). Two registrations
    queued behind them (every slot held) are still queued, in order, after the restart."""

    from miles.controller.client import ControlPlaneClient
    from miles.utils.types import AdapterKind
    from tests.helpers.driver_harness import DriverProcess, tiny_run_flags, write_arithmetic_dataset

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    data = tmp_path / "data"
    data.mkdir()
    datasets = {"add": write_arithmetic_dataset(data / "add.jsonl", 200, op="+", seed=1),
                "sub": write_arithmetic_dataset(data / "sub.jsonl", 200, op="-", seed=2)}
    save = tmp_path / "save"
    flags = tiny_run_flags(tiny_model_dir, save, n_adapters=3) + ["--save-interval", "1"]

    # First run: the second train call of the rank raises (the test rank); the run goes on.
    monkeypatch.setenv(FAULT_TRAIN_CALLS_ENV, "2")
    first = DriverProcess(TRAINER, [*flags, "--train-actor-path", ACTOR_PATH], tmp_path / "first.log")
    try:
        url = first.wait_for_api_url()
        client = ControlPlaneClient(url)
        for name, path in datasets.items():
            client.register(name, config={"data": str(path)})
        first.wait_until(lambda: all(client.status(n).step >= 2 for n in datasets), 150, "both adapters to step twice")
        assert "its batch is dropped and counts for no adapter" in first.log_path.read_text()

        # The client takes two steps and saves its state, then takes a third that no save keeps.
        sdk = SdkModel(url, tiny_model_dir)
        sdk.step(), sdk.step()
        assert sdk.model.save_state("two").result(timeout=120).path == f"tinker://{sdk.model.model_id}/weights/two"
        at_save = sdk.held_out()
        lost_loss = sdk.step()
        after_lost_step = sdk.held_out()
        assert after_lost_step != pytest.approx(at_save, abs=1e-3)
        model = next(s for s in client.list() if s.model_id == sdk.model.model_id)
        assert (model.kind, model.step) == (AdapterKind.CLIENT, 3)
        # Every slot is held now: these two wait, the later one ahead (its priority is higher).
        assert client.register("late", config={"data": str(datasets["add"])}) is None
        assert client.register("urgent", config={"data": str(datasets["sub"])}, priority=1) is None
        queued = [client.status(n) for n in ("urgent", "late")]
        assert [(s.state, s.queue_position) for s in queued] == [(AdapterState.QUEUED, 1), (AdapterState.QUEUED, 2)]
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
    second = restart_on_the_same_port(url, flags, tmp_path / "second.log")
    try:
        client = ControlPlaneClient(url)
        # The registry is back from {save}/controller/registry.sqlite: nothing is re-POSTed.
        listed = {s.name: s for s in client.list()}
        assert set(listed) == {*datasets, model.name, "urgent", "late"}
        assert all(listed[n].registration_id == before[n].registration_id for n in datasets)
        assert [(listed[s.name].state, listed[s.name].queue_position, listed[s.name].registration_id)
                for s in queued] == [(AdapterState.QUEUED, 1, queued[0].registration_id),
                                     (AdapterState.QUEUED, 2, queued[1].registration_id)]
        resumed = {}
        for name in datasets:
            ckpt = read_checkpoint(latest[name])
            line = f"Adapter '{name}' resumed from {latest[name]} (step {ckpt.trainer_state.step})"
            second.wait_until(lambda: line in second.log_path.read_text(), 120, f"{name} to resume")
            resumed[name] = ckpt
        second.wait_until(lambda: all(client.status(n).step > resumed[n].trainer_state.step for n in datasets), 120,
                          "both adapters to step after the resume")
        resume_s = time.monotonic() - started
        for name in datasets:
            state = resumed[name].trainer_state
            path = Path(before[name].save) / "checkpoints" / f"step_{state.step + 1}"
            second.wait_until(lambda: latest_checkpoint(before[name].save) not in (None, latest[name]), 60,
                              f"{name}'s first checkpoint after the resume")
            after = read_checkpoint(path)
            # At most the work since the latest checkpoint is lost: the first step after the
            # resume started from that checkpoint's weights, moments, step and LR clock.
            assert_one_adamw_step_from(resumed[name], after)
            # Its data continued from the resumed position instead of starting over.
            assert after.trainer_state.data_position.index > state.data_position.index, (name, after, state)
            assert after.trainer_state.registration_id == before[name].registration_id
        print(f"restart to the first step of both resumed adapters: {resume_s:.1f}s")

        # The client's model is back at its save_state: its step, weights, and the moments and
        # clock of its optimizer (its next step repeats the lost one exactly).
        line = (f"Client model '{model.name}' resumed from {save / 'adapters' / model.name / 'weights' / 'two'} "
                "at step 2: its 1 optim_step(s) after that save are lost")
        second.wait_until(lambda: line in second.log_path.read_text(), 120, "the client model to resume")
        assert client.status(model.name).step == 2
        assert sdk.held_out() == pytest.approx(at_save, abs=1e-5)
        assert sdk.step() == pytest.approx(lost_loss, rel=1e-5)
        assert sdk.held_out() == pytest.approx(after_lost_step, abs=1e-5)
        assert client.status(model.name).step == 3
        # Still queued after the resumes; the slot the unloaded model frees goes to the head.
        assert [client.status(s.name).queue_position for s in queued] == [1, 2]
        sdk.service.close("success").result(timeout=120)  # its session ends: the model is unloaded
        client.wait_for_state(model.name, AdapterState.COMPLETED, timeout=120)
        client.wait_for_state("urgent", AdapterState.ACTIVE, timeout=120)
        urgent, late = client.status("urgent"), client.status("late")
        assert (urgent.slot, urgent.registration_id) == (client.status(model.name).slot, queued[0].registration_id)
        assert (late.state, late.queue_position, late.slot) == (AdapterState.QUEUED, 1, None)
        assert second.terminate() == 0, second.log_tail()
    finally:
        second.kill()


@pytest.mark.slow
def test_sigkill_of_a_trainer_holding_a_paged_model_then_restart_pages_it_in_with_nothing_lost(
        tiny_model_dir, tmp_path, monkeypatch):
    """A client's model steps once, runs a forward_backward it has not stepped yet and idles:
    the trainer pages it out (PAGED, its slot free). SIGKILL, restart on the same port: it is
    still PAGED, and its client's optim_step pages it back in and steps the gradient it left
    with. Its held-out logprobs then equal those of a model of the same seed that ran the same
    calls without a pause: weights, moments, pending gradient and clock all came back."""

    from tinker import types

    from miles.controller.client import ControlPlaneClient
    from tests.helpers.driver_harness import DriverProcess, cycle_datum, tiny_run_flags

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    save = tmp_path / "save"
    flags = [*tiny_run_flags(tiny_model_dir, save, n_adapters=2), "--multi-lora-idle-evict-s", "1"]
    datums = [cycle_datum(0), cycle_datum(2)]
    adam = types.AdamParams(learning_rate=SdkModel.LR)

    first = DriverProcess(TRAINER, flags, tmp_path / "first.log")
    try:
        url = first.wait_for_api_url()
        client = ControlPlaneClient(url)
        paged = SdkModel(url, tiny_model_dir)
        paged.step()
        paged.model.forward_backward(datums, "cross_entropy").result(timeout=120)  # not stepped yet
        before = paged.held_out()
        name = next(s.name for s in client.list() if s.model_id == paged.model.model_id)
        client.wait_for_state(name, AdapterState.PAGED, timeout=120)
        status = client.status(name)
        assert (status.slot, status.step) == (None, 1)
        assert (save / "adapters" / name / "paged" / "pending_grad.safetensors").is_file()
        first.kill()  # SIGKILL to the driver and every process of its session
    finally:
        first.kill()

    second = restart_on_the_same_port(url, flags, tmp_path / "second.log")
    try:
        client = ControlPlaneClient(url)
        assert client.status(name).state is AdapterState.PAGED
        paged.model.optim_step(adam).result(timeout=120)  # pages it in, then steps what it left pending
        assert " paged in from " in second.log_path.read_text()
        assert client.status(name).step == 2
        after = paged.held_out()

        alone = SdkModel(url, tiny_model_dir)  # the same seed, the same calls, never paged
        alone.step()
        alone.model.forward_backward(datums, "cross_entropy").result(timeout=120)
        alone.model.optim_step(adam).result(timeout=120)
        assert after == pytest.approx(alone.held_out(), abs=1e-5)
        assert after != pytest.approx(before, abs=1e-4)  # the step moved the weights
        assert second.terminate() == 0, second.log_tail()
    finally:
        second.kill()
