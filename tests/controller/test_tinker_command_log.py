"""The command log of client-driven models, alone: seq_id order, barriers, retries, durability."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.controller.store import RegistryStore
from miles.controller.tinker.command_log import CommandLog, CommandLogError, ErrorCategory, FutureKind
from miles.utils.types import (
    AdamStep,
    ClientCommandKind,
    ClientCommandStatus,
    ClientDatum,
    ClientLoss,
    DatumOutput,
    ForwardBackwardResult,
    ForwardCommand,
    OptimStepCommand,
    OptimStepResult,
    SaveStateCommand,
    WeightsResult,
)

FB = ClientCommandKind.FORWARD_BACKWARD
MODELS = {"m": (3, "reg-m")}


def forward(*tokens: int) -> ForwardCommand:
    datum = ClientDatum(tokens=list(tokens), inputs={"target_tokens": list(tokens), "weights": [1.0] * len(tokens)})
    return ForwardCommand(datums=[datum], loss=ClientLoss("cross_entropy"))


def optim(lr: float = 1e-3) -> OptimStepCommand:
    return OptimStepCommand(adam=AdamStep(learning_rate=lr))


def outputs(n: int) -> ForwardBackwardResult:
    return ForwardBackwardResult(outputs=[DatumOutput({"logprobs": [-1.0] * n}, loss=float(n))], metrics={})


def test_commands_run_in_seq_order_up_to_the_next_barrier() -> None:
    log = CommandLog()
    late = log.submit_command("m", "M", 2, FB, forward(2, 2))
    assert log.take(MODELS).empty  # seq 1 has not arrived: 2 waits for it
    first = log.submit_command("m", "M", 1, FB, forward(1))
    step = log.submit_command("m", "M", 3, ClientCommandKind.OPTIM_STEP, optim())
    after = log.submit_command("m", "M", 4, FB, forward(4))

    batch = log.take(MODELS)
    (model,) = batch.models
    assert (model.model, model.slot, model.registration_id) == ("m", 3, "reg-m")
    assert [c.seq_id for c in model.work] == [1, 2] and model.barrier is not None and model.barrier.seq_id == 3
    assert model.work[1].request == forward(2, 2) and model.barrier.request == optim()
    assert [c.future_id for c in batch.commands] == [first.future_id, late.future_id, step.future_id]
    assert {log.get(c.future_id).status for c in batch.commands} == {ClientCommandStatus.RUNNING}

    assert log.take(MODELS).empty  # nothing more while the model runs something
    log.complete(first.future_id, outputs(1))
    log.complete(late.future_id, outputs(2))
    assert log.take(MODELS).empty
    log.complete(step.future_id, OptimStepResult(metrics={"grad_norm:mean": 0.5}))
    (model,) = log.take(MODELS).models
    assert [c.future_id for c in model.work] == [after.future_id] and model.barrier is None


def test_a_barrier_at_the_head_runs_alone_and_unknown_models_get_nothing() -> None:
    log = CommandLog()
    save = SaveStateCommand(name="c1", tinker_path="tinker://M/weights/c1", directory="/save/weights/c1")
    log.submit_command("m", "M", 1, ClientCommandKind.SAVE_STATE, save)
    log.submit_command("m", "M", 2, FB, forward(1))
    assert log.take({}).empty  # the model is not live (or not loaded): nothing is handed out
    (model,) = log.take(MODELS).models
    assert model.work == [] and model.barrier is not None and model.barrier.request == save


def test_a_retry_of_a_seq_id_is_the_same_future_and_logged_once() -> None:
    log = CommandLog()
    first = log.submit_command("m", "M", 1, FB, forward(1))
    assert log.submit_command("m", "M", 1, FB, forward(9)) == first  # the retry's body is not read again
    assert [f.future_id for f in log.commands("m")] == [first.future_id]
    with pytest.raises(CommandLogError, match="seq_id 1 was already used by a forward_backward"):
        log.submit_command("m", "M", 1, ClientCommandKind.OPTIM_STEP, optim())
    with pytest.raises(CommandLogError, match=r"seq_id 0 is behind the model's log \(next expected 1\)"):
        log.submit_command("m", "M", 0, FB, forward(1))
    with pytest.raises(CommandLogError, match="seq_id must be >= 1"):
        log.submit_command("fresh", "F", 0, FB, forward(1))  # only a model made by a load starts at 0
    log.take(MODELS)
    log.complete(first.future_id, outputs(1))
    assert log.submit_command("m", "M", 1, FB, forward(1)).status is ClientCommandStatus.DONE


def test_results_must_match_their_command() -> None:
    log = CommandLog()
    fb = log.submit_command("m", "M", 1, FB, forward(1))
    with pytest.raises(CommandLogError, match="not running"):
        log.complete(fb.future_id, outputs(1))
    log.take(MODELS)
    with pytest.raises(CommandLogError, match="needs a ForwardBackwardResult"):
        log.complete(fb.future_id, OptimStepResult())
    with pytest.raises(CommandLogError, match="2 outputs for 1 datums"):
        log.complete(fb.future_id, ForwardBackwardResult(outputs=outputs(1).outputs * 2))
    failed = log.fail(fb.future_id, "CUDA out of memory")
    assert (failed.status, failed.error, failed.category) == (
        ClientCommandStatus.FAILED, "CUDA out of memory", ErrorCategory.SERVER)
    with pytest.raises(CommandLogError, match="already failed"):
        log.fail(fb.future_id, "again")


def test_unloading_fails_queued_commands_and_the_log_skips_them() -> None:
    log = CommandLog()
    running = log.submit_command("m", "M", 1, FB, forward(1))
    log.take(MODELS)
    queued = log.submit_command("m", "M", 2, FB, forward(2))
    assert log.fail_model("m", "model M was unloaded") == [queued.future_id]
    assert log.get(queued.future_id).category is ErrorCategory.USER
    assert log.get(running.future_id).status is ClientCommandStatus.RUNNING
    log.complete(running.future_id, outputs(1))
    later = log.submit_command("m", "M", 3, FB, forward(3))
    (model,) = log.take(MODELS).models
    assert [c.future_id for c in model.work] == [later.future_id]


def test_the_log_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    log = CommandLog(RegistryStore(path))
    done = log.submit_command("m", "M", 1, FB, forward(1, 2))
    log.take(MODELS)
    log.complete(done.future_id, ForwardBackwardResult(
        outputs=[DatumOutput({"logprobs": [-0.5, -0.25], "elementwise_loss": [0.5, 0.25]}, loss=0.75)],
        metrics={"loss:sum": 0.75}))
    step = log.submit_command("m", "M", 2, ClientCommandKind.OPTIM_STEP, optim(3e-4))
    log.take(MODELS)
    queued = log.submit_command("m", "M", 3, FB, forward(3))
    created = log.record_done("create:s:0", FutureKind.CREATE_MODEL, "m", "M")

    again = CommandLog(RegistryStore(path))
    assert again.get(done.future_id) == log.get(done.future_id)  # typed request and result, as written
    assert again.get(step.future_id).status is ClientCommandStatus.RUNNING  # the driver may still report it
    assert again.get(queued.future_id) == queued
    assert again.existing("create:s:0") == created
    assert again.take(MODELS).empty  # seq 2 still runs
    again.complete(step.future_id, OptimStepResult())
    (model,) = again.take(MODELS).models
    assert [c.future_id for c in model.work] == [queued.future_id]
    assert again.submit_command("m", "M", 1, FB, forward(7)).future_id == done.future_id


async def test_wait_returns_when_the_future_finishes() -> None:
    log = CommandLog()
    save = SaveStateCommand(name="c", tinker_path="tinker://M/weights/c", directory="/d")
    future = log.submit_command("m", "M", 1, ClientCommandKind.SAVE_STATE, save)
    assert (await log.wait(future.future_id, 0.01)).status is ClientCommandStatus.PENDING
    assert not await log.wait_for_commands({}, 0.01)
    waiting = asyncio.create_task(log.wait(future.future_id, 30))
    assert await log.wait_for_commands(MODELS, 30)
    log.take(MODELS)
    log.complete(future.future_id, WeightsResult())
    assert (await asyncio.wait_for(waiting, 10)).status is ClientCommandStatus.DONE


def test_a_refused_call_holds_its_seq_id_as_a_failed_future() -> None:
    log = CommandLog()
    refused = log.refuse_command("m", "M", 1, ClientCommandKind.SAVE_STATE, "bad checkpoint name")
    assert (refused.status, refused.error, refused.category) == (
        ClientCommandStatus.FAILED, "bad checkpoint name", ErrorCategory.USER)
    assert log.refuse_command("m", "M", 1, ClientCommandKind.SAVE_STATE, "again") == refused
    after = log.submit_command("m", "M", 2, FB, forward(1))
    (model,) = log.take(MODELS).models  # seq 1 does not block seq 2
    assert [c.future_id for c in model.work] == [after.future_id]


def test_only_the_latest_forward_payloads_are_kept(tmp_path: Path) -> None:
    from miles.controller.tinker.routes import future_response

    path = tmp_path / "registry.sqlite"
    log = CommandLog(RegistryStore(path), keep_forward_payloads=2)
    futures = [log.submit_command("m", "M", seq, FB, forward(seq)) for seq in (1, 2, 3)]
    step = log.submit_command("m", "M", 4, ClientCommandKind.OPTIM_STEP, optim())
    log.take(MODELS)
    for future in futures:
        log.complete(future.future_id, outputs(1))
    log.complete(step.future_id, OptimStepResult())
    oldest = log.get(futures[0].future_id)
    assert oldest.expired and oldest.request is None and oldest.result is None
    assert oldest.status is ClientCommandStatus.DONE and log.get(futures[1].future_id).result == outputs(1)
    assert not log.get(step.future_id).expired  # only forward payloads are dropped
    answer = future_response(oldest, protobuf=True)
    assert b"expired" in answer.body and answer.media_type == "application/json"

    again = CommandLog(RegistryStore(path), keep_forward_payloads=1)  # a smaller bound applies on load
    assert again.get(futures[0].future_id).expired and again.get(futures[1].future_id).expired
    assert again.get(futures[2].future_id).result == outputs(1)
    assert again.submit_command("m", "M", 1, FB, forward(1)).future_id == futures[0].future_id  # still one future
