"""The command log of client-driven models: futures, `seq_id` order, idempotent retries.

Plain Python (no HTTP, no Ray); the gateway writes to it, the driver drains it through the
controller actor, `retrieve_future` reads it. Every change is written through to the
store, so a restarted controller answers for every future it ever issued:

    log = CommandLog(store)
    entry = log.submit_command("m", seq_id=1, kind=ClientCommandKind.FORWARD_BACKWARD, request=...)
    batch = log.take({"m": (slot, registration_id)})        # RUNNING now, seq_id order
    log.complete(entry.future_id, ForwardBackwardResult(outputs, metrics))
    await log.wait(entry.future_id, timeout_s=20)           # what retrieve_future long-polls on

Ordering (per model): commands run in `seq_id` order starting at 1, with no gaps (the SDK
numbers every call of a training client and sends the chunks of one call concurrently,
so a later one may arrive first and waits for its predecessors). A take hands out the
forward work from the next `seq_id` on, then the barrier that ends it (optim_step, save,
load), which the driver runs after that work. A model with a command still RUNNING gets nothing more until it finishes.
A retry of the same (model, seq_id) gets the same future and is never logged twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import struct
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from miles.controller.store import FutureRow, RegistryStore
from miles.utils.types import (
    AdamStep,
    ClientCommand,
    ClientCommandBatch,
    ClientCommandKind,
    ClientCommandStatus,
    ClientDatum,
    ClientLoss,
    ClientRequest,
    ClientResult,
    DatumOutput,
    ForwardBackwardResult,
    ForwardCommand,
    LoadStateCommand,
    ModelCommands,
    OptimStepCommand,
    OptimStepResult,
    SaveForSamplerCommand,
    SaveStateCommand,
    WeightsResult,
)

logger = logging.getLogger(__name__)

FIRST_SEQ_ID = 1
"""A training client's first call (the SDK sends `request_id + 1`)."""
KEEP_FORWARD_PAYLOADS = 256
"""Finished forward / forward_backward futures per model whose datums and outputs are kept
(each can be megabytes); older ones keep their status and answer that their result expired."""


class FutureKind(str, enum.Enum):
    """Every kind of future the gateway issues: the model's commands, plus its creation and unload."""

    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_STATE = "save_state"
    LOAD_STATE = "load_state"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    CREATE_MODEL = "create_model"
    UNLOAD_MODEL = "unload_model"

    @property
    def command(self) -> ClientCommandKind | None:
        """The command of the log, or None for creation and unload (done when issued)."""
        try:
            return ClientCommandKind(self.value)
        except ValueError:
            return None


class CommandLogError(ValueError):
    """A request the log cannot take as given (HTTP 400); the message says why."""


class UnknownFutureError(LookupError):
    """No future of that id was ever issued here (HTTP 404)."""


class ErrorCategory(str, enum.Enum):
    """Who caused a failed future, by the SDK's `RequestErrorCategory` values."""

    USER = "user"
    SERVER = "server"


@dataclass(frozen=True)
class Future:
    """One issued future and where it stands."""

    future_id: str
    key: str
    kind: FutureKind
    model: str | None
    """The adapter's registry name (None only for a create that failed before it had one)."""
    model_id: str | None
    seq_id: int | None
    status: ClientCommandStatus
    request: ClientRequest | None = None
    result: ClientResult | None = None
    error: str | None = None
    category: ErrorCategory | None = None
    expired: bool = False
    """Its request and result were dropped (see `KEEP_FORWARD_PAYLOADS`)."""

    def command(self) -> ClientCommand:
        kind = self.kind.command
        assert kind is not None and self.model is not None and self.seq_id is not None and self.request is not None
        return ClientCommand(future_id=self.future_id, model=self.model, seq_id=self.seq_id, kind=kind,
                             request=self.request)


@dataclass
class _ModelLog:
    next_seq: int = FIRST_SEQ_ID
    """The next seq_id to hand out: every lower one was taken (or failed)."""
    by_seq: dict[int, str] = field(default_factory=dict)
    """seq_id -> future id."""
    running: set[str] = field(default_factory=set)
    """Its RUNNING futures (a take hands out nothing more while there are any)."""
    pending: set[str] = field(default_factory=set)
    """Its PENDING futures: logged, not handed to the driver yet."""
    finished_forward: deque[str] = field(default_factory=deque)
    """Finished forward / forward_backward futures still holding their payloads, oldest first."""


class CommandLog:
    def __init__(self, store: RegistryStore | None = None, keep_forward_payloads: int = KEEP_FORWARD_PAYLOADS) -> None:
        self.store = store
        self.keep_forward_payloads = keep_forward_payloads
        self._futures: dict[str, Future] = {}
        self._by_key: dict[str, str] = {}
        self._models: dict[str, _ModelLog] = {}
        self._waiters: dict[str, asyncio.Event] = {}
        self._changed = asyncio.Event()
        """Set when something may have become runnable; `wait_for_commands` clears it."""
        if store is not None:
            for row in store.load_futures():
                self._index(_future_from_row(row))
            for model_log in self._models.values():
                taken = [seq for seq, fid in model_log.by_seq.items()
                         if self._futures[fid].status is not ClientCommandStatus.PENDING]
                # Nothing taken yet: a model made by a load starts at seq 0 (its load), others at 1.
                model_log.next_seq = max(taken) + 1 if taken else min([FIRST_SEQ_ID, *model_log.by_seq])
                for seq in sorted(model_log.by_seq):
                    self._keep_payload(self._futures[model_log.by_seq[seq]])

    # ---- writing ----------------------------------------------------------------------

    def _index(self, future: Future) -> None:
        self._futures[future.future_id] = future
        self._by_key[future.key] = future.future_id
        if future.kind.command is not None and future.model is not None and future.seq_id is not None:
            model_log = self._models.setdefault(future.model, _ModelLog())
            model_log.by_seq[future.seq_id] = future.future_id
            for status, ids in ((ClientCommandStatus.RUNNING, model_log.running),
                                (ClientCommandStatus.PENDING, model_log.pending)):
                if future.status is status:
                    ids.add(future.future_id)
                else:
                    ids.discard(future.future_id)

    def _write(self, future: Future) -> Future:
        previous = self._futures.get(future.future_id)
        self._index(future)
        if self.store is not None:
            if previous is None:
                self.store.put_future(_future_to_row(future))
            else:  # a new status: the request stays as written, the result is written once
                fresh = future.result is not None and previous.result is None
                self.store.update_future(future.future_id, future.status.value, _record(future),
                                         _encode_result(future.result) if fresh and future.result else None)
        self._keep_payload(future)
        if future.status.finished:
            waiter = self._waiters.pop(future.future_id, None)
            if waiter is not None:
                waiter.set()
        self._changed.set()
        return future

    def _keep_payload(self, future: Future) -> None:
        """Count a finished forward future; beyond `keep_forward_payloads` for its model, the
        oldest one's payloads are dropped (in memory and in the store)."""
        if (not future.status.finished or future.expired or future.model is None
                or future.kind not in (FutureKind.FORWARD, FutureKind.FORWARD_BACKWARD)):
            return
        kept = self._models[future.model].finished_forward
        kept.append(future.future_id)
        while len(kept) > self.keep_forward_payloads:
            old = replace(self._futures[kept.popleft()], request=None, result=None, expired=True)
            self._futures[old.future_id] = old
            if self.store is not None:
                self.store.update_future(old.future_id, old.status.value, _record(old), drop_payloads=True)

    def existing(self, key: str) -> Future | None:
        """The future already issued under this idempotency key, if any."""
        future_id = self._by_key.get(key)
        return None if future_id is None else self._futures[future_id]

    def record_done(self, key: str, kind: FutureKind, model: str, model_id: str) -> Future:
        """A future that is done as soon as it is issued (`create_model`, `unload_model`)."""
        found = self.existing(key)
        if found is not None:
            return found
        return self._write(Future(future_id=_new_id(), key=key, kind=kind, model=model, model_id=model_id,
                                  seq_id=None, status=ClientCommandStatus.DONE))

    def record_failed(self, key: str, kind: FutureKind, model: str, model_id: str, error: str) -> Future:
        """A future that failed as it was issued (outside any model's seq_id order)."""
        found = self.existing(key)
        if found is not None:
            return found
        return self._write(Future(future_id=_new_id(), key=key, kind=kind, model=model, model_id=model_id,
                                  seq_id=None, status=ClientCommandStatus.FAILED, error=error,
                                  category=ErrorCategory.USER))

    def submit_command(self, model: str, model_id: str, seq_id: int, kind: ClientCommandKind,
                       request: ClientRequest) -> Future:
        """Log one call; the same (model, seq_id) again returns the future issued the first time."""
        key = command_key(model, seq_id)
        found = self.retry_of(model, model_id, seq_id, kind)
        if found is not None:
            return found
        model_log = self._models.get(model)
        if model_log is None and seq_id < FIRST_SEQ_ID:
            raise CommandLogError(f"Model {model_id}: seq_id must be >= {FIRST_SEQ_ID}, got {seq_id}")
        if model_log is not None and seq_id < model_log.next_seq:
            raise CommandLogError(f"Model {model_id}: seq_id {seq_id} is behind the model's log "
                                  f"(next expected {model_log.next_seq})")
        future = Future(future_id=_new_id(), key=key, kind=FutureKind(kind.value), model=model, model_id=model_id,
                        seq_id=seq_id, status=ClientCommandStatus.PENDING, request=request)
        return self._write(future)

    def retry_of(self, model: str, model_id: str, seq_id: int, kind: ClientCommandKind) -> Future | None:
        """The future issued for (model, seq_id) if any: a retried call gets it again. A call
        of another kind at a used seq_id is refused (`CommandLogError`), never answered with
        the other call's future."""
        found = self.existing(command_key(model, seq_id))
        if found is not None and found.kind.value != kind.value:
            raise CommandLogError(
                f"Model {model_id}: seq_id {seq_id} was already used by a {found.kind.value} request, "
                f"not {kind.value}; each call of a training client needs its own seq_id")
        return found

    def open_at(self, model: str, seq_id: int) -> None:
        """A model whose log starts at `seq_id` (0: a model made by loading a checkpoint, whose
        load is its first command); before anything is logged for it."""
        if model in self._models:
            raise CommandLogError(f"the log of {model!r} is already open")
        self._models[model] = _ModelLog(next_seq=seq_id)

    def refuse_command(self, model: str, model_id: str, seq_id: int, kind: ClientCommandKind, error: str) -> Future:
        """Log a call that cannot run (bad input) as FAILED at its seq_id: the client's future
        raises with `error`, and the model's later calls do not wait for this seq_id forever."""
        key = command_key(model, seq_id)
        found = self.retry_of(model, model_id, seq_id, kind)
        if found is not None:
            return found
        if seq_id < FIRST_SEQ_ID:
            raise CommandLogError(f"Model {model_id}: seq_id must be >= {FIRST_SEQ_ID}, got {seq_id}")
        return self._write(Future(future_id=_new_id(), key=key, kind=FutureKind(kind.value), model=model,
                                  model_id=model_id, seq_id=seq_id, status=ClientCommandStatus.FAILED,
                                  error=error, category=ErrorCategory.USER))

    # ---- the driver's side ---------------------------------------------------------------

    def take(self, models: dict[str, tuple[int, str]]) -> ClientCommandBatch:
        """Mark RUNNING and return each model's runnable commands (see the module docstring).

        `models`: the live client-driven adapters that may run work, name -> (slot, registration id).
        """
        taken: list[ModelCommands] = []
        for name in sorted(models):
            model_log = self._models.get(name)
            if model_log is None or self._running(name):
                continue
            work: list[Future] = []
            barrier: Future | None = None
            while (future_id := model_log.by_seq.get(model_log.next_seq)) is not None:
                future = self._futures[future_id]
                if future.status is not ClientCommandStatus.PENDING:
                    model_log.next_seq += 1  # failed before it ran (its model was unloaded)
                    continue
                kind = future.kind.command
                assert kind is not None
                if kind.barrier:  # runs after the forward work before it, and ends this take
                    barrier = future
                    model_log.next_seq += 1
                    break
                work.append(future)
                model_log.next_seq += 1
            if not work and barrier is None:
                continue
            running = [self._write(replace(f, status=ClientCommandStatus.RUNNING)) for f in work]
            if barrier is not None:
                barrier = self._write(replace(barrier, status=ClientCommandStatus.RUNNING))
            slot, registration_id = models[name]
            taken.append(ModelCommands(
                model=name, slot=slot, registration_id=registration_id, work=[f.command() for f in running],
                barrier=None if barrier is None else barrier.command()))
        self._changed.clear()
        return ClientCommandBatch(models=taken)

    def runnable(self, models: dict[str, tuple[int, str]]) -> bool:
        """Whether `take(models)` would hand something out (without taking it)."""
        for name in models:
            model_log = self._models.get(name)
            if model_log is None or self._running(name):
                continue
            future_id = model_log.by_seq.get(model_log.next_seq)
            if future_id is not None and self._futures[future_id].status is ClientCommandStatus.PENDING:
                return True
        return False

    async def wait_for_commands(self, models: dict[str, tuple[int, str]], timeout_s: float) -> bool:
        """Until something is runnable for `models`, or `timeout_s`; returns whether it is."""
        if self.runnable(models):
            return True
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self.runnable(models)

    def _running(self, model: str) -> bool:
        return bool(self._models[model].running)

    def complete(self, future_id: str, result: ClientResult) -> Future:
        """A RUNNING command finished with `result` (its type must match the command's kind)."""
        future = self._running_future(future_id)
        _check_result(future, result)
        return self._write(replace(future, status=ClientCommandStatus.DONE, result=result))

    def fail(self, future_id: str, error: str, category: ErrorCategory = ErrorCategory.SERVER) -> Future:
        """A PENDING or RUNNING command failed; its client's `.result()` raises with `error`."""
        future = self.get(future_id)
        if future.status.finished:
            raise CommandLogError(f"future {future_id} already {future.status.value}; it cannot fail now")
        return self._write(replace(future, status=ClientCommandStatus.FAILED, error=error, category=category))

    def fail_model(self, model: str, error: str, *, running: bool = False) -> list[str]:
        """Fail the model's PENDING commands (and RUNNING ones with `running`); returns their ids."""
        model_log = self._models.get(model)
        if model_log is None:
            return []
        statuses = {ClientCommandStatus.PENDING} | ({ClientCommandStatus.RUNNING} if running else set())
        failed = [f for f in model_log.by_seq.values() if self._futures[f].status in statuses]
        for future_id in failed:
            self.fail(future_id, error, ErrorCategory.USER if not running else ErrorCategory.SERVER)
        return failed

    def fail_running(self, error: str) -> list[str]:
        """Every RUNNING command failed (a new trainer starts: what the old one ran is gone)."""
        failed = [f.future_id for f in self._futures.values() if f.status is ClientCommandStatus.RUNNING]
        for future_id in failed:
            self.fail(future_id, error)
        return failed

    def _running_future(self, future_id: str) -> Future:
        future = self.get(future_id)
        if future.status is not ClientCommandStatus.RUNNING:
            raise CommandLogError(f"future {future_id} is {future.status.value}, not running: "
                                  "only a command handed out by take_client_commands can complete")
        return future

    # ---- reading ------------------------------------------------------------------------

    def get(self, future_id: str) -> Future:
        future = self._futures.get(future_id)
        if future is None:
            raise UnknownFutureError(f"Unknown future {future_id!r}")
        return future

    async def wait(self, future_id: str, timeout_s: float) -> Future:
        """The future once finished, or as it stands after `timeout_s` (a long poll)."""
        future = self.get(future_id)
        if future.status.finished or timeout_s <= 0:
            return future
        waiter = self._waiters.setdefault(future_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wait(), timeout_s)
        return self.get(future_id)

    def pending_count(self, model: str) -> int:
        """How many of the model's commands are logged and not handed to the driver yet."""
        model_log = self._models.get(model)
        return 0 if model_log is None else len(model_log.pending)

    def busy(self, model: str) -> bool:
        """The model has a command in flight: logged and not taken, or RUNNING (its future not
        completed yet). A busy model is never paged out."""
        model_log = self._models.get(model)
        return model_log is not None and bool(model_log.pending or model_log.running)

    def commands(self, model: str) -> list[Future]:
        """The model's logged commands in seq_id order."""
        model_log = self._models.get(model)
        if model_log is None:
            return []
        return [self._futures[model_log.by_seq[seq]] for seq in sorted(model_log.by_seq)]


def command_key(model: str, seq_id: int) -> str:
    return f"cmd:{model}:{seq_id}"


def _new_id() -> str:
    return uuid.uuid4().hex


def _check_result(future: Future, result: ClientResult) -> None:
    kind = future.kind
    if kind in (FutureKind.FORWARD, FutureKind.FORWARD_BACKWARD):
        if not isinstance(result, ForwardBackwardResult):
            raise CommandLogError(f"{kind.value} {future.future_id} needs a ForwardBackwardResult, "
                                  f"got {type(result).__name__}")
        assert isinstance(future.request, ForwardCommand)
        if len(result.outputs) != len(future.request.datums):
            raise CommandLogError(f"{kind.value} {future.future_id}: {len(result.outputs)} outputs for "
                                  f"{len(future.request.datums)} datums")
    elif kind is FutureKind.OPTIM_STEP:
        if not isinstance(result, OptimStepResult):
            raise CommandLogError(f"optim_step {future.future_id} needs an OptimStepResult, "
                                  f"got {type(result).__name__}")
    elif not isinstance(result, WeightsResult):
        raise CommandLogError(f"{kind.value} {future.future_id} needs a WeightsResult, got {type(result).__name__}")


# ---- payloads, as the store keeps them ------------------------------------------------------
# A forward call's datums and outputs can be megabytes: they are written once, as a small JSON
# header followed by the raw numeric arrays (what JSON of float lists would cost ~10x in time
# and size); the small requests and results are JSON alone.

_HEAD = struct.Struct("<I")


def _pack(header: dict[str, Any], arrays: list[np.ndarray]) -> bytes:
    head = json.dumps(header).encode()
    return _HEAD.pack(len(head)) + head + b"".join(a.tobytes() for a in arrays)


class _Unpacker:
    def __init__(self, blob: bytes) -> None:
        (size,) = _HEAD.unpack_from(blob)
        self.header: dict[str, Any] = json.loads(blob[_HEAD.size:_HEAD.size + size])
        self.blob, self.offset = blob, _HEAD.size + size

    def take(self, dtype: str, count: int) -> list[Any]:
        array = np.frombuffer(self.blob, dtype=dtype, count=count, offset=self.offset)
        self.offset += array.nbytes
        return array.tolist()  # type: ignore[no-any-return]


def _numbers(values: list[float] | list[int]) -> tuple[str, np.ndarray]:
    array = np.asarray(values)
    return ("i", array.astype("<i8")) if array.dtype.kind in "iub" else ("f", array.astype("<f8"))


def _encode_request(request: ClientRequest) -> bytes:
    if not isinstance(request, ForwardCommand):
        return _pack({"json": asdict(request)}, [])
    arrays: list[np.ndarray] = []
    datums = []
    for datum in request.datums:
        arrays.append(np.asarray(datum.tokens, dtype="<i8"))
        inputs = []
        for name, values in datum.inputs.items():
            code, array = _numbers(values)
            inputs.append([name, code, len(values)])
            arrays.append(array)
        datums.append({"n": len(datum.tokens), "inputs": inputs})
    header = {"loss": {"name": request.loss.name, "config": request.loss.config}, "datums": datums}
    return _pack(header, arrays)


def _decode_request(kind: FutureKind, blob: bytes) -> ClientRequest:
    unpacker = _Unpacker(blob)
    header = unpacker.header
    if kind not in (FutureKind.FORWARD, FutureKind.FORWARD_BACKWARD):
        raw = header["json"]
        if kind is FutureKind.OPTIM_STEP:
            return OptimStepCommand(adam=AdamStep(**raw["adam"]))
        return _REQUESTS[kind](**raw)  # type: ignore[no-any-return]
    datums = []
    for entry in header["datums"]:
        tokens = unpacker.take("<i8", entry["n"])
        inputs = {name: unpacker.take("<i8" if code == "i" else "<f8", n) for name, code, n in entry["inputs"]}
        datums.append(ClientDatum(tokens=tokens, inputs=inputs))
    return ForwardCommand(datums=datums, loss=ClientLoss(**header["loss"]))


def _encode_result(result: ClientResult) -> bytes:
    if not isinstance(result, ForwardBackwardResult):
        return _pack({"json": asdict(result)}, [])
    outputs = [{"loss": o.loss, "fields": [[name, len(values)] for name, values in o.outputs.items()]}
               for o in result.outputs]
    arrays = [np.asarray(values, dtype="<f8") for o in result.outputs for values in o.outputs.values()]
    return _pack({"metrics": result.metrics, "outputs": outputs}, arrays)


def _decode_result(kind: FutureKind, blob: bytes) -> ClientResult:
    unpacker = _Unpacker(blob)
    header = unpacker.header
    if kind is FutureKind.OPTIM_STEP:
        return OptimStepResult(**header["json"])
    if kind not in (FutureKind.FORWARD, FutureKind.FORWARD_BACKWARD):
        return WeightsResult()
    outputs = [DatumOutput({name: unpacker.take("<f8", n) for name, n in o["fields"]}, loss=o["loss"])
               for o in header["outputs"]]
    return ForwardBackwardResult(outputs=outputs, metrics=header["metrics"])


_REQUESTS: dict[FutureKind, type] = {
    FutureKind.SAVE_STATE: SaveStateCommand, FutureKind.LOAD_STATE: LoadStateCommand,
    FutureKind.SAVE_WEIGHTS_FOR_SAMPLER: SaveForSamplerCommand,
}


def _record(future: Future) -> str:
    return json.dumps({"model_id": future.model_id, "error": future.error,
                       "category": None if future.category is None else future.category.value,
                       "expired": future.expired})


def _future_to_row(future: Future) -> FutureRow:
    return FutureRow(future_id=future.future_id, key=future.key, model=future.model, seq_id=future.seq_id,
                     kind=future.kind.value, status=future.status.value, record=_record(future),
                     request=None if future.request is None else _encode_request(future.request),
                     result=None if future.result is None else _encode_result(future.result))


def _future_from_row(row: FutureRow) -> Future:
    kind = FutureKind(row.kind)
    record = json.loads(row.record)
    return Future(
        future_id=row.future_id, key=row.key, kind=kind, model=row.model, model_id=record["model_id"],
        seq_id=row.seq_id, status=ClientCommandStatus(row.status),
        request=None if row.request is None else _decode_request(kind, row.request),
        result=None if row.result is None else _decode_result(kind, row.result),
        error=record["error"], category=None if record["category"] is None else ErrorCategory(record["category"]),
        expired=record["expired"],
    )
