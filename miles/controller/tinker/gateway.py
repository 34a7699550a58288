"""The Tinker gateway's logic: sessions, models as client-driven adapters, the command log.

No HTTP here (the routes in `routes.py` parse the wire and call these methods) and no
trainer: a call is validated, translated into our typed commands and logged; the driver
takes the commands through the controller actor and reports results back:

    gateway = TinkerGateway(backend, GatewayConfig(base_model="Qwen3-0.6B"), store)
    session = gateway.create_session(SessionInfo(tags=[], user_metadata={}, sdk_version="0.38.0"))
    created = gateway.create_model(session, 0, "Qwen3-0.6B", LoraLayout(rank=8), {})  # done at once
    future = gateway.submit(created.model_id, 1, ClientCommandKind.FORWARD_BACKWARD, command)
    batch = gateway.take_commands()                              # the driver: RUNNING now
    gateway.complete(future.future_id, ForwardBackwardResult(outputs, metrics))

A model is an adapter of kind CLIENT in the same registry and slots as the RL adapters,
named after its model id (`{session}:train:{n}` -> `{session}.train.{n}`, since adapter
names take no ':'); `unload_model` deregisters it and the normal lifecycle frees its slot.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles.controller.backend import MultiLoRABackend
from miles.controller.registry import AdapterValidationError, NoFreeSlotError, NoSlotToPageInError
from miles.controller.store import RegistryStore
from miles.controller.tinker.checkpoints import (
    CHECKPOINT_NAME,
    CheckpointPath,
    CheckpointPathError,
    CheckpointRecord,
    Checkpoints,
    CheckpointType,
    check_ttl,
)
from miles.controller.tinker.command_log import (
    CommandLog,
    CommandLogError,
    ErrorCategory,
    Future,
    FutureKind,
    command_key,
)
from miles.controller.tinker.sampling import SampleFutures
from miles.utils.types import (
    AdapterKind,
    AdapterState,
    ClientCommandBatch,
    ClientCommandKind,
    ClientCommandStatus,
    ClientModelConfig,
    ClientRequest,
    ClientResult,
    ForwardBackwardResult,
    LoadStateCommand,
    SamplerSnapshot,
    SaveForSamplerCommand,
    SaveStateCommand,
    parse_sampler_weights_path,
)
from miles.utils.types.lifecycle_ops import PageIn, PageOut, RecordClientCheckpoint, RecordClientStep

logger = logging.getLogger(__name__)

RETRIEVE_POLL_S = 20.0
"""How long `retrieve_future` holds a request for an unfinished future (the SDK waits 45 s)."""
SESSION_TIMEOUT_S = 600.0
"""A session silent this long is finished and its models unloaded (the SDK heartbeats every 10 s)."""
UNNAMED_SNAPSHOT_PREFIX = "sampler-seq-"
"""Name of a sampler snapshot saved without one (`save_weights_and_get_sampling_client`): this
prefix and the call's seq_id."""


class GatewayError(Exception):
    """A request the gateway refuses; `status` is its HTTP status. The SDK retries none of them,
    except those marked `retryable` (sent without `x-should-retry: false`)."""

    status = 400
    retryable = False


class GatewayNotFoundError(GatewayError):
    status = 404


class GatewayBodyTooLargeError(GatewayError):
    status = 413


class GatewayInUseError(GatewayError):
    """A deletion refused because something still uses the object; the message names what.

    HTTP 400, not 409: the SDK's RestClient retries a 409 for five minutes whatever
    `x-should-retry` says, and waiting does not free a model's resume point."""


class GatewaySessionFinishedError(GatewayError):
    """A heartbeat for a finished session (HTTP 410: the SDK stops its heartbeat loop)."""

    status = 410


class GatewayCapacityError(GatewayError):
    """No free slot for a new model (HTTP 409, marked not to be retried)."""

    status = 409


class GatewayBusyError(GatewayError):
    """A paged-out model's command found no free slot to page it back into (HTTP 429, which
    the SDK retries with backoff, as it does 408/409/5xx): nothing was logged, and the same
    call sent again pages the model in once a slot frees."""

    status = 429
    retryable = True


@dataclass(frozen=True)
class GatewayConfig:
    base_model: str | None = None
    """The base model the trainer serves (its name as clients give it); None accepts any name."""
    tokenizer_id: str | None = None
    """What `get_info` names as the tokenizer (the base model's HF id or path)."""
    target_modules: str = "all-linear"
    """The slots' LoRA layout (`--target-modules`): which `create_model` layouts are possible."""
    lora_unembed: bool = False
    """The slots carry LoRA on the unembedding (`--lora-unembed`): `train_unembed=True` is possible."""
    retrieve_poll_s: float = RETRIEVE_POLL_S
    session_timeout_s: float | None = SESSION_TIMEOUT_S
    """None: sessions never expire (their models stay until unloaded or the session finishes)."""


@dataclass(frozen=True)
class SessionInfo:
    tags: list[str] = field(default_factory=list)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    sdk_version: str = ""
    display_name: str | None = None


@dataclass(frozen=True)
class SamplerSession:
    """A sampling session (`create_sampling_session`, or a `save_weights_and_get_sampling_client`):
    what a sampling client samples from."""

    sampler_id: str
    base_model: str
    model_path: str | None = None
    """The `tinker://.../sampler_weights/...` snapshot; None: the base model."""
    save_future: str | None = None
    """The save_weights_for_sampler future that writes its snapshot (made by the save itself)."""


@dataclass
class Session:
    session_id: str
    info: SessionInfo
    created: float
    last_heartbeat: float
    finished: bool = False
    model_ids: list[str] = field(default_factory=list)
    samplers: list[SamplerSession] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "tags": self.info.tags, "user_metadata": self.info.user_metadata,
                "sdk_version": self.info.sdk_version, "display_name": self.info.display_name,
                "created": self.created, "last_heartbeat": self.last_heartbeat, "finished": self.finished,
                "model_ids": self.model_ids, "samplers": [asdict(s) for s in self.samplers]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Session:
        info = SessionInfo(tags=raw["tags"], user_metadata=raw["user_metadata"], sdk_version=raw["sdk_version"],
                           display_name=raw["display_name"])
        return cls(session_id=raw["session_id"], info=info, created=raw["created"],
                   last_heartbeat=raw["last_heartbeat"], finished=raw["finished"], model_ids=raw["model_ids"],
                   samplers=[SamplerSession(**s) for s in raw.get("samplers", [])])


@dataclass(frozen=True)
class LoraLayout:
    """`create_model`'s LoRA config, by the SDK's field names."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


def model_name(model_id: str) -> str:
    """The registry name of a model id (adapter names take no ':')."""
    return model_id.replace(":", ".")


def tinker_path(model_id: str, segment: str, name: str) -> str:
    return f"tinker://{model_id}/{segment}/{name}"


class TinkerGateway:
    def __init__(self, backend: MultiLoRABackend, config: GatewayConfig | None = None,
                 store: RegistryStore | None = None, clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.config = config or GatewayConfig()
        self.store = store
        self.clock = clock
        self.log = CommandLog(store)
        self.checkpoints = Checkpoints(store, clock)
        """Every checkpoint the models wrote (saves the driver reported done), kept in the store."""
        self._snapshots: dict[str, SamplerSnapshot] = {}
        """Sampler snapshots found written, by tinker:// path."""
        self.samples = SampleFutures(lambda: backend.router_url)
        """Samples in flight and finished (`asample`), through the router the controller knows."""
        self._sessions: dict[str, Session] = {}
        self._samplers: dict[str, SamplerSession] = {}
        """Every session's sampling sessions by id (`retrieve_future` and `asample` look them up)."""
        self._sampler_of_save: dict[str, SamplerSession] = {}
        """save_weights_for_sampler future id -> the sampling session it made."""
        if store is not None:
            for raw in store.load_sessions():
                session = Session.from_json(raw)
                session.last_heartbeat = clock()  # a restarted controller gives every client time to call again
                self._sessions[session.session_id] = session
                for sampler in session.samplers:
                    self._index_sampler(sampler)
        self._models: dict[str, str] = {}
        """model id -> registry name, for every client-driven adapter the registry knows."""
        for status in backend.statuses():
            if status.kind is AdapterKind.CLIENT and status.model_id is not None:
                self._models[status.model_id] = status.name
        self._last_active: dict[str, float] = {}
        """Registry name -> when a command of the model was last logged or finished (its
        creation, or this gateway's start, before that): how long it has been idle."""

    # ---- sessions -------------------------------------------------------------------------

    def create_session(self, info: SessionInfo) -> str:
        now = self.clock()
        session = Session(session_id=f"s-{uuid.uuid4().hex[:16]}", info=info, created=now, last_heartbeat=now)
        self._sessions[session.session_id] = session
        self._persist_session(session)
        logger.info("Tinker session %s created (sdk %s)", session.session_id, info.sdk_version or "?")
        return session.session_id

    def heartbeat(self, session_id: str) -> None:
        session = self.session(session_id)
        if session.finished:
            raise GatewaySessionFinishedError(f"Session {session_id} is finished (closed, or silent for too long)")
        session.last_heartbeat = self.clock()

    def session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise GatewayNotFoundError(f"Unknown session {session_id!r}; create one with create_session")
        return session

    def sessions(self) -> list[Session]:
        """Every session, newest first."""
        return sorted(self._sessions.values(), key=lambda s: s.created, reverse=True)

    def finish_session(self, session_id: str) -> list[str]:
        """The client closed its session: its models are unloaded (their slots freed). Returns them."""
        session = self.session(session_id)
        session.finished = True
        self._persist_session(session)
        unloaded = [m for m in session.model_ids if self._unload(m)]
        logger.info("Tinker session %s finished; unloaded %s", session_id, unloaded or "no models")
        return unloaded

    def expire_sessions(self) -> list[str]:
        """Finish every session silent for over `session_timeout_s` (its models unloaded, their
        slots freed by the lifecycle); returns their ids. Runs whenever the driver takes commands."""
        timeout = self.config.session_timeout_s
        if timeout is None:
            return []
        now = self.clock()
        expired = [s.session_id for s in self._sessions.values()
                   if not s.finished and now - s.last_heartbeat > timeout]
        for session_id in expired:
            logger.warning("Tinker session %s sent no heartbeat for %.0f s; finishing it", session_id, timeout)
            self.finish_session(session_id)
        return expired

    def _persist_session(self, session: Session) -> None:
        if self.store is not None:
            self.store.put_session(session.session_id, session.to_json())

    # ---- models -----------------------------------------------------------------------------

    def create_model(self, session_id: str, model_seq_id: int, base_model: str, lora: LoraLayout | None,
                     user_metadata: dict[str, Any]) -> Future:
        """Register a client-driven adapter (PENDING in the lowest free slot); the future is done at once.

        The same (session, model_seq_id) again returns the first call's future."""
        key = f"create:{session_id}:{model_seq_id}"
        found = self.log.existing(key)
        if found is not None:
            return found
        session = self.session(session_id)
        model_id = self._new_model_id(session, model_seq_id)
        config = self._model_config(model_id, session_id, base_model, lora, user_metadata)
        name = self._register(session, config)
        return self.log.record_done(key, FutureKind.CREATE_MODEL, name, model_id)

    def create_model_from_state(self, session_id: str, model_seq_id: int, path: str, optimizer: bool,
                                base_model: str | None, user_metadata: dict[str, Any]) -> Future:
        """A model made by loading a checkpoint (`create_training_client_from_state*`): the
        checkpoint's model's LoRA layout, registered like `create_model`, with the load as its
        first command (seq_id 0); the future is that load's. The same call again returns it."""
        session = self.session(session_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        found = self.log.existing(command_key(model_name(model_id), 0))
        if found is not None:
            return found
        model_id = self._new_model_id(session, model_seq_id)
        load = self.load_state_command(path, optimizer)
        _, source = self.model(path[len("tinker://"):].split("/")[0])
        lora = LoraLayout(rank=source.rank, seed=source.seed, train_mlp=source.train_mlp,
                          train_attn=source.train_attn, train_unembed=source.train_unembed)
        config = self._model_config(model_id, session_id, base_model or source.base_model, lora, user_metadata)
        try:
            name = self._register(session, config)
        except GatewayCapacityError as exc:
            # The SDK sends this call with retries on 409 for minutes: fail its future instead.
            return self.log.record_failed(command_key(model_name(model_id), 0), FutureKind.LOAD_STATE,
                                          model_name(model_id), model_id, str(exc))
        self.log.open_at(name, 0)
        return self.log.submit_command(name, model_id, 0, ClientCommandKind.LOAD_STATE, load)

    def _new_model_id(self, session: Session, model_seq_id: int) -> str:
        if session.finished:
            raise GatewayError(f"Session {session.session_id} is finished; create a new ServiceClient")
        if model_seq_id < 0:
            raise GatewayError(f"model_seq_id must be >= 0, got {model_seq_id}")
        model_id = f"{session.session_id}:train:{model_seq_id}"
        if model_id in self._models:
            raise GatewayError(f"Model {model_id} already exists; use the next model_seq_id")
        return model_id

    def _register(self, session: Session, config: ClientModelConfig) -> str:
        """Register the model's adapter; returns its name."""
        model_id = config.model_id
        name = model_name(model_id)
        try:
            self.backend.register_client(name, config)
        except NoFreeSlotError as exc:
            raise GatewayCapacityError(str(exc)) from None
        except AdapterValidationError as exc:
            raise GatewayError(str(exc)) from None
        self._models[model_id] = name
        session.model_ids.append(model_id)
        self._persist_session(session)
        logger.info("Tinker model %s created: adapter '%s', rank %d", model_id, name, config.rank)
        return name

    def _model_config(self, model_id: str, session_id: str, base_model: str, lora: LoraLayout | None,
                      user_metadata: dict[str, Any]) -> ClientModelConfig:
        self.served_base_model(base_model)
        if lora is None:
            raise GatewayError("lora_config is required: this trainer trains LoRA adapters only")
        defaults = self.backend.defaults
        if lora.rank <= 0 or lora.rank > defaults.lora_rank:
            raise GatewayError(f"lora_config.rank {lora.rank} must be in 1..{defaults.lora_rank} "
                               f"(the slot width, --lora-rank); lower rank")
        if self.config.target_modules.strip() != "all-linear":
            raise GatewayError(f"this trainer's slots cover only --target-modules {self.config.target_modules!r}, "
                               "not a Tinker layout (train_mlp/train_attn); restart it with "
                               "--target-modules all-linear")
        if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
            raise GatewayError("lora_config trains nothing: train_mlp, train_attn and train_unembed are all False; "
                               "set at least one")
        if lora.train_unembed and not self.config.lora_unembed:
            raise GatewayError("lora_config.train_unembed=True needs LoRA on the unembedding (lm_head), which this "
                               "trainer's slots do not carry: restart it with --lora-unembed, or pass "
                               "train_unembed=False")
        if defaults.save is None:
            raise GatewayError("this trainer has no --save directory, so a model could not save its state; "
                               "restart it with --save")
        save = (Path(defaults.save).expanduser() / "adapters" / model_name(model_id)).resolve()
        return ClientModelConfig(model_id=model_id, session_id=session_id, base_model=base_model, rank=lora.rank,
                                 alpha=defaults.lora_alpha, seed=lora.seed, save=save, user_metadata=user_metadata,
                                 train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                                 train_unembed=lora.train_unembed)

    def model(self, model_id: str) -> tuple[str, ClientModelConfig]:
        """A known model's registry name and config (live or completed)."""
        name = self._models.get(model_id)
        config = None if name is None else self.backend.registry.client_config(name)
        if name is None or config is None:
            raise GatewayNotFoundError(f"Unknown model {model_id!r}; create it with create_model")
        return name, config

    def model_state(self, model_id: str) -> AdapterState | None:
        name, _ = self.model(model_id)
        return self.backend.registry.state(name)

    def unload_model(self, model_id: str) -> Future:
        """Deregister the model (RETIRING; the driver frees its slot); its unrun commands fail."""
        name, _ = self.model(model_id)
        self._unload(model_id)
        return self.log.record_done(f"unload:{model_id}", FutureKind.UNLOAD_MODEL, name, model_id)

    def _unload(self, model_id: str) -> bool:
        name = self._models.get(model_id)
        if name is None or self.backend.registry.state(name) not in (AdapterState.PENDING, AdapterState.ACTIVE,
                                                                      AdapterState.PAGED):
            return False
        self.backend.deregister(name)
        failed = self.log.fail_model(name, f"model {model_id} was unloaded before this command ran")
        logger.info("Tinker model %s unloaded (%d queued commands failed)", model_id, len(failed))
        return True

    # ---- commands --------------------------------------------------------------------------

    def submit(self, model_id: str, seq_id: int | None, kind: ClientCommandKind,
               build: Callable[[], ClientRequest]) -> Future:
        """Log one call of a live model; `build` translates its body (raising `GatewayError`).

        A retry of a seq_id returns the logged future (its body is not read again). A body
        that cannot run is logged as a failed future at its seq_id (the client's `.result()`
        raises with the reason), so the model's later calls do not wait for that seq_id."""
        name, _ = self.model(model_id)
        if seq_id is None:
            raise GatewayError(f"Model {model_id}: seq_id is required (the training client's call number)")
        try:
            found = self.log.retry_of(name, model_id, seq_id, kind)
            if found is not None:
                return found
            state = self.backend.registry.state(name)
            if state is AdapterState.PAGED:
                self._page_in(name)
            elif state not in (AdapterState.PENDING, AdapterState.ACTIVE):
                raise GatewayNotFoundError(f"Model {model_id} was unloaded; create a new training client")
            self._last_active[name] = self.clock()
            try:
                request = build()
            except GatewayError as exc:  # the model itself was found above: this is about the body
                logger.info("Model %s: %s refused at seq_id %d: %s", model_id, kind.value, seq_id, exc)
                return self.log.refuse_command(name, model_id, seq_id, kind, str(exc))
            return self.log.submit_command(name, model_id, seq_id, kind, request)
        except CommandLogError as exc:
            raise GatewayError(str(exc)) from None

    def _page_in(self, name: str) -> None:
        try:
            slot = self.backend.apply_now(PageIn(name))
        except NoSlotToPageInError as exc:
            raise GatewayBusyError(str(exc)) from None
        logger.info("Tinker model '%s' was paged out while idle; its command pages it back in (slot %d)", name, slot)

    # ---- paging idle models (the driver, through the controller actor) ---------------------

    def idle_models(self, idle_s: float) -> list[str]:
        """The ACTIVE client-driven models with no command in flight (none logged and not
        taken, none running) whose last command was logged or finished `idle_s` or more ago."""
        now = self.clock()
        return sorted(name for name, run in self.backend.snapshot().clients.items()
                      if run.state is AdapterState.ACTIVE and not self.log.busy(name)
                      and now - self._last_active.setdefault(name, now) >= idle_s)

    def page_out(self, name: str, directory: str) -> bool:
        """The trainer wrote the model's whole state to `directory` and emptied its slot: PAGED,
        its slot free. False (nothing changes; the trainer loads it back) if a command of it came
        in meanwhile, or it is not ACTIVE any more."""
        if self.log.busy(name):
            return False
        return self.backend.apply_now(PageOut(name, directory)) >= 0

    def paged_count(self) -> int:
        return self.backend.registry.paged_count

    def save_state_command(self, model_id: str, name: str | None, overwrite: bool) -> SaveStateCommand:
        checkpoint = self._checkpoint_name(name)
        model, config = self.model(model_id)
        if not overwrite and self._saved(model_id, model, checkpoint):
            raise GatewayError(f"Model {model_id} already has a checkpoint named {checkpoint!r}; "
                               "pick another name or pass overwrite=True")
        return SaveStateCommand(name=checkpoint, tinker_path=tinker_path(model_id, "weights", checkpoint),
                                directory=str(config.save / "weights" / checkpoint))

    def sampler_command(self, model_id: str, name: str | None, seq_id: int | None = None) -> SaveForSamplerCommand:
        """The save of a sampler snapshot; without a name (`save_weights_and_get_sampling_client`)
        it is named after the call's seq_id."""
        if name is None:
            if seq_id is None:
                raise GatewayError("save_weights_for_sampler needs a name (path) or a seq_id")
            name = f"{UNNAMED_SNAPSHOT_PREFIX}{seq_id}"
        checkpoint = self._checkpoint_name(name)
        model, config = self.model(model_id)
        path = tinker_path(model_id, "sampler_weights", checkpoint)
        if any(isinstance(f.request, SaveForSamplerCommand) and f.request.tinker_path == path
               and f.status is not ClientCommandStatus.FAILED for f in self.log.commands(model)):
            raise GatewayError(f"Model {model_id} already has sampler weights named {checkpoint!r} ({path}); "
                               "sampler snapshots are immutable: pick another name")
        return SaveForSamplerCommand(name=checkpoint, tinker_path=tinker_path(model_id, "sampler_weights", checkpoint),
                                     directory=str(config.save / "sampler_weights" / checkpoint))

    def external_command(self, model_id: str, name: str, ttl_seconds: int | None) -> SaveForSamplerCommand:
        """`save_weights_external`: the slot's LoRA exported as a PEFT directory to download
        (`get_external_weights_urls`), deleted `ttl_seconds` after it is written if given."""
        checkpoint = self._checkpoint_name(name)
        model, config = self.model(model_id)
        path = tinker_path(model_id, "external_weights", checkpoint)
        writing = any(isinstance(f.request, SaveForSamplerCommand) and f.request.tinker_path == path
                      and not f.status.finished for f in self.log.commands(model))
        if path in self.checkpoints or writing:
            raise GatewayError(f"Model {model_id} already has external weights named {checkpoint!r}; pick "
                               "another name or delete them first")
        try:
            ttl = check_ttl(ttl_seconds)
        except CheckpointPathError as exc:
            raise GatewayError(str(exc)) from None
        return SaveForSamplerCommand(name=checkpoint, tinker_path=path, ttl_seconds=ttl,
                                     directory=str(config.save / "external_weights" / checkpoint))

    # ---- training runs and their checkpoints ---------------------------------------------------

    def training_runs(self) -> list[str]:
        """Every model id this trainer knows (live or unloaded), newest first."""
        return list(reversed(self._models))

    def last_request_time(self, model_id: str) -> float:
        """When the model's session was last heard from (a restart counts as now)."""
        _, config = self.model(model_id)
        return self.session(config.session_id).last_heartbeat

    def checkpoints_of(self, model_id: str | None = None) -> list[CheckpointRecord]:
        """The model's written checkpoints (every model's when None), newest first; expired
        exports are removed first."""
        if model_id is not None:
            self.model(model_id)
        self.expire_checkpoints()
        return self.checkpoints.all() if model_id is None else self.checkpoints.of_model(model_id)

    def checkpoint(self, path: CheckpointPath) -> CheckpointRecord:
        """A written checkpoint; 404 naming the path (and why) when there is none."""
        model, _ = self.model(path.model_id)
        self.expire_checkpoints()
        record = self.checkpoints.get(path.tinker_path)
        if record is not None:
            return record
        writing = any(isinstance(f.request, SaveStateCommand | SaveForSamplerCommand)
                      and f.request.tinker_path == path.tinker_path and not f.status.finished
                      for f in self.log.commands(model))
        why = "its save has not finished" if writing else f"model {path.model_id} has no such checkpoint"
        raise GatewayNotFoundError(f"No checkpoint {path.tinker_path!r}: {why}")

    def delete_checkpoint(self, path: CheckpointPath) -> CheckpointRecord:
        """Remove a checkpoint's directory and record, unless something still needs it (400 naming what)."""
        record = self.checkpoint(path)
        reason = self._checkpoint_in_use(record)
        if reason is not None:
            raise GatewayInUseError(f"Checkpoint {path.tinker_path} is not deleted: {reason}")
        self.checkpoints.remove(record)
        self._snapshots.pop(path.tinker_path, None)
        logger.info("Tinker checkpoint %s deleted (%s)", path.tinker_path, record.directory)
        return record

    def set_checkpoint_ttl(self, path: CheckpointPath, ttl_seconds: int | None) -> CheckpointRecord:
        """An export's expiry, from now (None: kept until deleted). Checkpoints and snapshots
        never expire: a model resumes from them, samplers load them."""
        record = self.checkpoint(path)
        if path.kind is not CheckpointType.EXTERNAL:
            raise GatewayError(f"TTL is served for external_weights exports only, not for {path.tinker_path}: "
                               "delete it when it is no longer needed")
        try:
            return self.checkpoints.set_ttl(record, check_ttl(ttl_seconds))
        except CheckpointPathError as exc:
            raise GatewayError(str(exc)) from None

    def expire_checkpoints(self) -> list[str]:
        """Delete the exports whose TTL ran out; returns their tinker paths."""
        expired = [r for r in self.checkpoints.expired() if self._checkpoint_in_use(r) is None]
        for record in expired:
            self.checkpoints.remove(record)
            logger.info("Tinker export %s expired and was deleted", record.path.tinker_path)
        return [r.path.tinker_path for r in expired]

    def _checkpoint_in_use(self, record: CheckpointRecord) -> str | None:
        """Why the checkpoint must stay, or None."""
        path = record.path.tinker_path
        for run in self.backend.snapshot().clients.values():
            if run.state in (AdapterState.PENDING, AdapterState.ACTIVE) and run.resume_from == record.directory:
                return (f"it is the resume point of live model {run.config.model_id} (a restarted trainer loads "
                        "it from there); save a newer state or unload the model first")
        for model in self._models.values():
            for future in self.log.commands(model):
                if isinstance(future.request, LoadStateCommand) and future.request.tinker_path == path \
                        and not future.status.finished:
                    return f"model {future.model_id} has a load_state of it still to run"
        for session in self._sessions.values():
            for sampler in session.samplers:
                if sampler.model_path == path and not session.finished:
                    return (f"sampling session {sampler.sampler_id} samples it; close its ServiceClient "
                            "(or let its session end) first")
        return None

    # ---- sampling sessions --------------------------------------------------------------------

    def create_sampler(self, session_id: str, sampler_seq_id: int, model_path: str | None,
                       base_model: str | None) -> SamplerSession:
        """A sampling session for a snapshot this trainer wrote (`model_path`) or the base model;
        the same (session, sampler_seq_id) again returns the first one."""
        session = self.session(session_id)
        sampler_id = f"{session_id}:sample:{sampler_seq_id}"
        found = self._find_sampler(sampler_id)
        if found is not None:
            return found
        if session.finished:
            raise GatewayError(f"Session {session_id} is finished; create a new ServiceClient")
        if model_path is not None:
            snapshot = self.snapshot(model_path)
            _, config = self.model(snapshot.model_id)
            sampler = SamplerSession(sampler_id=sampler_id, base_model=config.base_model, model_path=model_path)
        elif base_model is not None:
            sampler = SamplerSession(sampler_id=sampler_id, base_model=self.served_base_model(base_model))
        else:
            raise GatewayError("create_sampling_session needs model_path (a tinker://.../sampler_weights/... path) "
                               "or base_model")
        return self._add_sampler(session, sampler)

    def sampler_of_save(self, model_id: str, sampler_seq_id: int, save: Future) -> SamplerSession:
        """The sampling session a `save_weights_and_get_sampling_client` makes: its snapshot is
        the one `save` writes (sampling waits for it to be written)."""
        _, config = self.model(model_id)
        session = self.session(config.session_id)
        sampler_id = f"{config.session_id}:sample:{sampler_seq_id}"
        found = self._find_sampler(sampler_id)
        if found is not None:
            return found
        assert isinstance(save.request, SaveForSamplerCommand)
        return self._add_sampler(session, SamplerSession(sampler_id=sampler_id, base_model=config.base_model,
                                                         model_path=save.request.tinker_path,
                                                         save_future=save.future_id))

    def _add_sampler(self, session: Session, sampler: SamplerSession) -> SamplerSession:
        session.samplers.append(sampler)
        self._index_sampler(sampler)
        self._persist_session(session)
        logger.info("Tinker sampling session %s: %s", sampler.sampler_id, sampler.model_path or sampler.base_model)
        return sampler

    def _index_sampler(self, sampler: SamplerSession) -> None:
        self._samplers[sampler.sampler_id] = sampler
        if sampler.save_future is not None:
            self._sampler_of_save[sampler.save_future] = sampler

    def _find_sampler(self, sampler_id: str) -> SamplerSession | None:
        return self._samplers.get(sampler_id)

    def sampler(self, sampler_id: str) -> SamplerSession:
        found = self._find_sampler(sampler_id)
        if found is None:
            raise GatewayNotFoundError(f"Unknown sampling session {sampler_id!r}; create one with "
                                       "create_sampling_client")
        return found

    def sampler_for_save(self, future_id: str) -> SamplerSession | None:
        """The sampling session made with this save_weights_for_sampler future, if any."""
        return self._sampler_of_save.get(future_id)

    def snapshot(self, model_path: str) -> SamplerSnapshot:
        """The sampler snapshot a finished `save_weights_for_sampler` of a known model wrote.

        Raises `GatewayNotFoundError` naming the path when no such save was logged, or it has
        not finished (or failed)."""
        known = self._snapshots.get(model_path)
        if known is not None:
            return known
        try:
            model_id, checkpoint = parse_sampler_weights_path(model_path)
        except ValueError as exc:
            raise GatewayError(str(exc)) from None
        name = self._models.get(model_id)
        if name is None:
            raise GatewayNotFoundError(f"No sampler weights {model_path!r}: model {model_id!r} is unknown here")
        saves = [f for f in self.log.commands(name)
                 if isinstance(f.request, SaveForSamplerCommand) and f.request.tinker_path == model_path]
        done = [f for f in saves if f.status is ClientCommandStatus.DONE]
        if done and model_path not in self.checkpoints:
            raise GatewayNotFoundError(f"No sampler weights {model_path!r}: they were deleted")
        if done:
            request = done[-1].request
            assert isinstance(request, SaveForSamplerCommand)
            snapshot = SamplerSnapshot(model_id=model_id, name=checkpoint, directory=request.directory)
            self._snapshots[model_path] = snapshot  # written once, never changes: no need to look again
            return snapshot
        if not saves:
            raise GatewayNotFoundError(f"No sampler weights {model_path!r}: model {model_id} never ran "
                                       f"save_weights_for_sampler({checkpoint!r})")
        if any(f.status is ClientCommandStatus.FAILED for f in saves):
            raise GatewayNotFoundError(f"No sampler weights {model_path!r}: its save_weights_for_sampler failed")
        raise GatewayNotFoundError(f"Sampler weights {model_path!r} are not written yet: wait for the "
                                   "save_weights_for_sampler future, then sample")

    def served_base_model(self, base_model: str) -> str:
        served = self.config.base_model
        if served is not None and base_model not in (served, Path(served).name):
            raise GatewayError(f"base_model {base_model!r} is not served here; this trainer serves {served!r}")
        return base_model

    def load_state_command(self, path: str, optimizer: bool) -> LoadStateCommand:
        """A load of a checkpoint saved by a model this trainer knows (`tinker://{model}/weights/{name}`)."""
        prefix = "tinker://"
        parts = path[len(prefix):].split("/") if path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] != "weights":
            raise GatewayError(f"path {path!r} is not a training checkpoint: use tinker://<model_id>/weights/<name>, "
                               "as save_state returned it")
        source, config = self.model(parts[0])
        checkpoint = self._checkpoint_name(parts[2])
        directory = config.save / "weights" / checkpoint
        if not self._saved(parts[0], source, checkpoint) and not directory.is_dir():
            raise GatewayNotFoundError(f"No checkpoint {path!r}: model {parts[0]} never saved one by that name")
        return LoadStateCommand(tinker_path=path, directory=str(directory), optimizer=optimizer)

    def _saved(self, model_id: str, model: str, checkpoint: str) -> bool:
        """A save_state of that name is written (and not deleted since), or logged and not finished."""
        return tinker_path(model_id, "weights", checkpoint) in self.checkpoints or any(
            isinstance(f.request, SaveStateCommand) and f.request.name == checkpoint and not f.status.finished
            for f in self.log.commands(model))

    @staticmethod
    def _checkpoint_name(name: str | None) -> str:
        if name is None or not CHECKPOINT_NAME.fullmatch(name) or name in (".", ".."):
            raise GatewayError(f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-' "
                               "(it becomes a directory name)")
        return name

    # ---- the driver's side (through the controller actor) ----------------------------------------

    def runnable_models(self, loaded: Collection[str] | None = None) -> dict[str, tuple[int, str]]:
        """Live client-driven adapters that may run commands: name -> (slot, registration id);
        only those of `loaded` (the ones the trainer holds in their slots) when given."""
        return {name: (run.slot, run.registration_id) for name, run in self.backend.snapshot().clients.items()
                if run.state in (AdapterState.PENDING, AdapterState.ACTIVE) and (loaded is None or name in loaded)}

    def take_commands(self, loaded: Collection[str] | None = None) -> ClientCommandBatch:
        self.expire_sessions()
        return self.log.take(self.runnable_models(loaded))

    async def wait_for_commands(self, timeout_s: float, loaded: Collection[str] | None = None) -> bool:
        self.expire_sessions()
        return await self.log.wait_for_commands(self.runnable_models(loaded), timeout_s)

    def complete(self, future_id: str, result: ClientResult) -> Future:
        """A command the driver ran finished. Completing an `optim_step` is what steps the model
        in the registry (one call: the command and the step never disagree); a completed save or
        load becomes the model's resume point."""
        if isinstance(result, ForwardBackwardResult):
            result = _with_loss_sum(result)
        future = self.log.complete(future_id, result)
        if future.model is None:
            return future
        self._last_active[future.model] = self.clock()
        if future.kind is FutureKind.OPTIM_STEP:
            self.backend.apply_now(RecordClientStep(future.model))
        elif isinstance(future.request, SaveStateCommand | LoadStateCommand):
            self.backend.apply_now(RecordClientCheckpoint(future.model, future.request.directory))
        if isinstance(future.request, SaveStateCommand | SaveForSamplerCommand):
            ttl = future.request.ttl_seconds if isinstance(future.request, SaveForSamplerCommand) else None
            self.checkpoints.add(CheckpointPath.parse(future.request.tinker_path), future.request.directory, ttl)
        return future

    def fail(self, future_id: str, error: str, category: ErrorCategory = ErrorCategory.SERVER) -> Future:
        future = self.log.fail(future_id, error, category)
        if future.model is not None:
            self._last_active[future.model] = self.clock()
        return future

    def fail_running(self, error: str) -> list[str]:
        return self.log.fail_running(error)

    async def aclose(self) -> None:
        """Cancel the samples still running and close the sampler's connections."""
        await self.samples.aclose()


def _with_loss_sum(result: ForwardBackwardResult) -> ForwardBackwardResult:
    """The SDK reduces metrics by the suffix after ':' and reads `loss:sum`; every key needs one."""
    bad = [key for key in result.metrics if key.count(":") != 1]
    if bad:
        raise CommandLogError(f"metric names must be 'name:reduction' (e.g. 'loss:sum'), got {bad}")
    metrics = dict(result.metrics)
    metrics.setdefault("loss:sum", float(sum(o.loss for o in result.outputs)))
    return ForwardBackwardResult(outputs=result.outputs, metrics=metrics)
