"""Client commands: the Tinker clients' work, run in the loop's own train call.

    taken = await clients.take()                                   # runnable commands, RUNNING now
    trained = await train.train(rollout_id, batch, client=taken.work)   # with the RL batch, one call
    reports = await clients.finish(taken, trained)                 # futures resolve, then the barriers

The gateway (`miles.controller.tinker`) logs each client call; `ClientCommands` is the only
stage that runs them (DESIGN §11). Each iteration takes every model's commands up to its next
barrier: the `forward`/`forward_backward` datums go into the same train call as the
server-driven RL batch (or, with no sampleable RL adapter, into a call of their own, without
waiting for a generate phase: `run_alone`); then each model's barrier runs: `optim_step`
steps that slot alone with the call's Adam settings, `save_state`/`load_state` write or read a
checkpoint directory, `save_weights_for_sampler` writes the slot's LoRA as an immutable PEFT
directory that the engines load by path on their first request for it. A command that fails
fails its client's future with the error; the others go on. `finish` (and `run_alone`) tell
what each model's commands came to (`ClientModelReport`): the run's metrics records and its
progress view are made from these (`RunProgress.record_clients`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import ray

from miles.backends.base import AdapterStepStats, TrainingBackend, TrainResult
from miles.lora.peft_io import write_peft_dir
from miles.main.handles import ControllerHandle
from miles.utils.types import (
    AdamStep,
    ClientCommand,
    ClientCommandBatch,
    ClientWork,
    DatumOutput,
    ForwardBackwardResult,
    ForwardCommand,
    LoadStateCommand,
    OptimStepCommand,
    OptimStepResult,
    RolloutBatch,
    SaveForSamplerCommand,
    SaveStateCommand,
    WeightsResult,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TakenCommands:
    """One take: the commands handed out, and the train call's share of them."""

    batch: ClientCommandBatch = field(default_factory=ClientCommandBatch)
    work: list[ClientWork] = field(default_factory=list)
    """One `ClientWork` per forward / forward_backward command, in `work_commands` order."""
    work_commands: list[ClientCommand] = field(default_factory=list)
    taken_at: float = 0.0
    """`time.perf_counter()` when they were taken."""

    @property
    def empty(self) -> bool:
        return self.batch.empty


@dataclass(frozen=True)
class ClientCall:
    """One `forward_backward` that ran: what its future resolved to, and its size."""

    metrics: dict[str, float]
    """By the SDK's names, `name:reduction` (`loss:sum`)."""
    datums: int
    tokens: int
    """Input tokens of its datums."""


@dataclass(frozen=True)
class ClientStepTaken:
    """An `optim_step` that ran: the Adam settings of its call and what the backend reported."""

    adam: AdamStep
    stats: AdapterStepStats | None


@dataclass(frozen=True)
class ClientModelReport:
    """What one model's commands of one take came to."""

    model: str
    registration_id: str
    calls: list[ClientCall] = field(default_factory=list)
    """Its `forward_backward` calls that ran (`forward` calls change nothing and are not counted)."""
    step: ClientStepTaken | None = None
    """The `optim_step` that ended the take, if one ran."""
    seconds: float = 0.0
    """Its time in the trainer: the train call that carried its datums, and its own barrier."""


def reduce_metrics(calls: list[ClientCall]) -> dict[str, float]:
    """The calls' metrics combined as the SDK combines the chunks of one call: by the reduction
    each name ends with (`sum`, `min`, `max`, and `mean` weighted by datums); a name with another
    reduction, or missing from a call, is left out.

    >>> reduce_metrics([ClientCall({"loss:sum": 2.0, "acc:mean": 1.0}, 1, 4),
    ...                 ClientCall({"loss:sum": 3.0, "acc:mean": 0.0}, 3, 12)])
    {'loss:sum': 5.0, 'acc:mean': 0.25}
    """
    if not calls:
        return {}
    reduced: dict[str, float] = {}
    for key in calls[0].metrics:
        if not all(key in call.metrics for call in calls):
            continue
        values = [call.metrics[key] for call in calls]
        reduction = key.rpartition(":")[2]
        if reduction == "sum":
            reduced[key] = sum(values)
        elif reduction == "min":
            reduced[key] = min(values)
        elif reduction == "max":
            reduced[key] = max(values)
        elif reduction == "mean":
            datums = sum(call.datums for call in calls)
            reduced[key] = (sum(v * call.datums for v, call in zip(values, calls, strict=True)) / datums
                            if datums else sum(values) / len(values))
    return reduced


def empty_batch(rollout_id: int) -> RolloutBatch:
    """A train call with no RL samples: only client work."""
    return RolloutBatch(rollout_id=rollout_id, samples=[], prompt_group_sizes=[], groups_per_adapter={},
                        step_names=[])


def datum_metrics(outputs: list[DatumOutput]) -> dict[str, float]:
    """The call's metrics as Tinker names them: the summed loss of its datums."""
    return {"loss:sum": float(sum(o.loss for o in outputs))}


class ClientTrain(Protocol):
    """What `run_alone` needs of the train stage (`TrainStep.train_client`)."""

    async def train_client(self, rollout_id: int, batch: RolloutBatch,
                           work: list[ClientWork]) -> tuple[TrainResult | None, str | None]: ...


class ClientCommands:
    def __init__(self, backend: TrainingBackend, controller: ControllerHandle, loaded: Callable[[], list[str]], *,
                 wait_s: float = 1.0) -> None:
        self.backend = backend
        self.controller = controller
        self.loaded = loaded
        """The client models the backend holds in their slots (`AdapterSlots`): only theirs run;
        a model created since the last reconcile waits for the next one."""
        self.wait_s = wait_s
        """How long a clients-only iteration waits for a command before the loop looks again."""

    async def take(self) -> TakenCommands:
        """Every live model's runnable commands (RUNNING from now on), and their train work."""
        batch = await self.controller.take_client_commands.remote(self.loaded())
        work: list[ClientWork] = []
        commands: list[ClientCommand] = []
        for model in batch.models:
            for command in model.work:
                request = command.request
                assert isinstance(request, ForwardCommand), command
                work.append(ClientWork(adapter=model.model, slot=model.slot, datums=request.datums,
                                       loss=request.loss, backward=command.kind.value == "forward_backward"))
                commands.append(command)
        return TakenCommands(batch, work, commands, taken_at=time.perf_counter())

    async def finish(self, taken: TakenCommands, result: TrainResult | None,
                     error: str | None = None) -> list[ClientModelReport]:
        """The train call that carried `taken.work` gave `result` (or failed with `error`):
        resolve those futures, then run each model's barrier. Returns one report per model taken."""
        calls: dict[str, list[ClientCall]] = {}
        for index, (command, work) in enumerate(zip(taken.work_commands, taken.work, strict=True)):
            if result is None or index >= len(result.client):
                await self.controller.fail_client_command.remote(command.future_id,
                                                                 error or "the train call failed")
                continue
            outputs = result.client[index]
            metrics = datum_metrics(outputs)
            await self.controller.complete_client_command.remote(
                command.future_id, ForwardBackwardResult(outputs=outputs, metrics=metrics))
            if work.backward:
                calls.setdefault(work.adapter, []).append(
                    ClientCall(metrics, datums=len(work.datums), tokens=sum(len(d.tokens) for d in work.datums)))
        trained_s = time.perf_counter() - taken.taken_at if taken.work else 0.0
        reports = []
        for model in taken.batch.models:
            start = time.perf_counter()
            step = None if model.barrier is None else await self._run_barrier(model.model, model.barrier)
            shared = trained_s if model.work else 0.0
            reports.append(ClientModelReport(model.model, model.registration_id, calls.get(model.model, []), step,
                                             seconds=shared + time.perf_counter() - start))
        return reports

    async def run_alone(self, rollout_id: int, train: ClientTrain) -> list[ClientModelReport]:
        """With no sampleable RL adapter: wait up to `wait_s` for a client command and run
        what is runnable in a call of its own. Returns what ran (empty: nothing did)."""
        if not await self.controller.wait_for_client_commands.remote(self.wait_s, self.loaded()):
            return []
        taken = await self.take()
        if taken.empty:
            return []
        result, error = None, None
        if taken.work:
            result, error = await train.train_client(rollout_id, empty_batch(rollout_id), taken.work)
        return await self.finish(taken, result, error)

    async def _run_barrier(self, name: str, command: ClientCommand) -> ClientStepTaken | None:
        """Run one barrier command; returns the optim_step it took (None: another kind, or it failed)."""
        request = command.request
        try:
            if isinstance(request, OptimStepCommand):
                steps = await self.backend.step_adapters([name], adam={name: request.adam})
                stats: AdapterStepStats | None = steps.get(name)
                metrics = {} if stats is None else {"grad_norm": stats.grad_norm, "learning_rate": stats.lr}
                # completing it steps the model in the registry
                await self.controller.complete_client_command.remote(command.future_id, OptimStepResult(metrics))
                return ClientStepTaken(request.adam, stats)
            elif isinstance(request, SaveStateCommand):
                await self.backend.save_client_state(name, request.directory)
                await self.controller.complete_client_command.remote(command.future_id, WeightsResult())
            elif isinstance(request, LoadStateCommand):
                await self.backend.load_client_state(name, request.directory, optimizer=request.optimizer)
                await self.controller.complete_client_command.remote(command.future_id, WeightsResult())
            elif isinstance(request, SaveForSamplerCommand):
                export = await self.backend.export_adapter(name)
                tensors = export.tensors
                if isinstance(tensors, ray.ObjectRef):  # in the object store, for the engines
                    tensors = await tensors
                await asyncio.to_thread(write_peft_dir, request.directory, tensors, export.peft_config)
                await self.controller.complete_client_command.remote(command.future_id, WeightsResult())
            else:
                raise TypeError(f"unknown client command {command.kind}")
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc
            logger.warning("Client command %s of '%s' (seq_id %d) failed: %s", command.kind.value, name,
                           command.seq_id, cause)
            await self.controller.fail_client_command.remote(command.future_id, f"{type(cause).__name__}: {cause}",
                                                             isinstance(cause, ValueError))
        return None


