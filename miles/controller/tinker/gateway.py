"""The Tinker gateway: the owners of sessions, models, paging, sampling sessions, save
commands and checkpoint rules, composed over one command log, and the calls that span
them (no HTTP, no trainer).

The routes (`routes.py`) parse the wire and call the gateway or one of its owners; the
driver takes the logged commands through the controller actor and reports results back:

    gateway = TinkerGateway(backend, GatewayConfig(base_model="Qwen3-0.6B"), store)
    session = gateway.sessions.create(SessionInfo(sdk_version="0.38.0"))
    created = gateway.create_model(session, 0, "Qwen3-0.6B", LoraLayout(rank=8), {})  # done at once
    future = gateway.submit(created.model_id, 1, ClientCommandKind.FORWARD_BACKWARD, command)
    batch = gateway.take_commands()                              # the driver: RUNNING now
    gateway.complete(future.future_id, ForwardBackwardResult(outputs, metrics))
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from miles.controller.backend import MultiLoRABackend
from miles.controller.store import RegistryStore
from miles.controller.tinker.checkpoint_rules import CheckpointRules
from miles.controller.tinker.checkpoints import Checkpoints
from miles.controller.tinker.command_log import (
    CommandLog,
    CommandLogError,
    ErrorCategory,
    Future,
    FutureKind,
    command_key,
)
from miles.controller.tinker.errors import GatewayCapacityError, GatewayError, GatewayNotFoundError
from miles.controller.tinker.models import LoraLayout, Models, model_name
from miles.controller.tinker.paging import ModelPaging
from miles.controller.tinker.sampling import SampleFutures
from miles.controller.tinker.sampling_sessions import SamplingSessions
from miles.controller.tinker.saves import SaveCommands
from miles.controller.tinker.sessions import Sessions
from miles.utils.types import (
    AdapterState,
    ClientCommandBatch,
    ClientCommandKind,
    ClientRequest,
    ClientResult,
    ForwardBackwardResult,
    LoadStateCommand,
    SaveForSamplerCommand,
    SaveStateCommand,
)
from miles.utils.types.lifecycle_ops import RecordClientCheckpoint, RecordClientStep

logger = logging.getLogger(__name__)

RETRIEVE_POLL_S = 20.0
"""How long `retrieve_future` holds a request for an unfinished future (the SDK waits 45 s)."""
SESSION_TIMEOUT_S = 600.0
"""A session silent this long is finished and its models unloaded (the SDK heartbeats every 10 s)."""


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


class TinkerGateway:
    """The Tinker protocol's owners over one command log; the routes and the controller actor call it."""

    def __init__(self, backend: MultiLoRABackend, config: GatewayConfig | None = None,
                 store: RegistryStore | None = None, clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.config = config = config or GatewayConfig()
        self.store = store
        self.log = CommandLog(store)
        self.checkpoints = Checkpoints(store, clock)
        """Every checkpoint the models wrote (saves the driver reported done), kept in the store."""
        self.samples = SampleFutures(lambda: backend.router_url)
        """Samples in flight and finished (`asample`), through the router the controller knows."""
        self.sessions = Sessions(store, clock, timeout_s=config.session_timeout_s)
        self.models = Models(backend, self.sessions, self.log, base_model=config.base_model,
                             target_modules=config.target_modules, lora_unembed=config.lora_unembed)
        self.paging = ModelPaging(backend, self.log, clock)
        self.samplers = SamplingSessions(self.sessions, self.models, self.log, self.checkpoints)
        self.saves = SaveCommands(self.models, self.log, self.checkpoints)
        self.checkpoint_rules = CheckpointRules(backend, self.models, self.log, self.checkpoints, self.samplers)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock every owner reads (set here, it is set for all of them)."""
        return self.sessions.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.sessions.clock = self.paging.clock = self.checkpoints.clock = clock

    # ---- sessions and models -----------------------------------------------------------

    def finish_session(self, session_id: str) -> list[str]:
        """The client closed its session: its models are unloaded (their slots freed). Returns them."""
        session = self.sessions.finish(session_id)
        unloaded = [m for m in session.model_ids if self.models.unload(m)]
        logger.info("Tinker session %s finished; unloaded %s", session_id, unloaded or "no models")
        return unloaded

    def expire_sessions(self) -> list[str]:
        """Finish every session silent for over `session_timeout_s` (its models unloaded, their
        slots freed by the lifecycle); returns their ids. Runs whenever the driver takes commands."""
        expired = self.sessions.silent()
        for session_id in expired:
            logger.warning("Tinker session %s sent no heartbeat for %.0f s; finishing it", session_id,
                           self.sessions.timeout_s)
            self.finish_session(session_id)
        return expired

    def create_model(self, session_id: str, model_seq_id: int, base_model: str, lora: LoraLayout | None,
                     user_metadata: dict[str, Any]) -> Future:
        """Register a client-driven adapter (PENDING in the lowest free slot); the future is done at once.

        The same (session, model_seq_id) again returns the first call's future."""
        key = f"create:{session_id}:{model_seq_id}"
        found = self.log.existing(key)
        if found is not None:
            return found
        session = self.sessions.get(session_id)
        model_id = self.models.new_model_id(session, model_seq_id)
        name = self.models.register(session, self.models.config(model_id, session_id, base_model, lora,
                                                                user_metadata))
        return self.log.record_done(key, FutureKind.CREATE_MODEL, name, model_id)

    def create_model_from_state(self, session_id: str, model_seq_id: int, path: str, optimizer: bool,
                                base_model: str | None, user_metadata: dict[str, Any]) -> Future:
        """A model made by loading a checkpoint (`create_training_client_from_state*`): the
        checkpoint's model's LoRA layout, registered like `create_model`, with the load as its
        first command (seq_id 0); the future is that load's. The same call again returns it."""
        session = self.sessions.get(session_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        found = self.log.existing(command_key(model_name(model_id), 0))
        if found is not None:
            return found
        model_id = self.models.new_model_id(session, model_seq_id)
        load = self.saves.load_state_command(path, optimizer)
        _, source = self.models.get(path[len("tinker://"):].split("/")[0])
        lora = LoraLayout(rank=source.rank, seed=source.seed, train_mlp=source.train_mlp,
                          train_attn=source.train_attn, train_unembed=source.train_unembed)
        config = self.models.config(model_id, session_id, base_model or source.base_model, lora, user_metadata)
        try:
            name = self.models.register(session, config)
        except GatewayCapacityError as exc:
            # The SDK sends this call with retries on 409 for minutes: fail its future instead.
            return self.log.record_failed(command_key(model_name(model_id), 0), FutureKind.LOAD_STATE,
                                          model_name(model_id), model_id, str(exc))
        self.log.open_at(name, 0)
        return self.log.submit_command(name, model_id, 0, ClientCommandKind.LOAD_STATE, load)

    def unload_model(self, model_id: str) -> Future:
        """Deregister the model (RETIRING; the driver frees its slot); its unrun commands fail."""
        name, _ = self.models.get(model_id)
        self.models.unload(model_id)
        return self.log.record_done(f"unload:{model_id}", FutureKind.UNLOAD_MODEL, name, model_id)

    # ---- commands ----------------------------------------------------------------------

    def submit(self, model_id: str, seq_id: int | None, kind: ClientCommandKind,
               build: Callable[[], ClientRequest]) -> Future:
        """Log one call of a live model; `build` translates its body (raising `GatewayError`).

        A retry of a seq_id returns the logged future (its body is not read again). A body
        that cannot run is logged as a failed future at its seq_id (the client's `.result()`
        raises with the reason), so the model's later calls do not wait for that seq_id. A
        paged-out model's command pages it back in first."""
        name, _ = self.models.get(model_id)
        if seq_id is None:
            raise GatewayError(f"Model {model_id}: seq_id is required (the training client's call number)")
        try:
            found = self.log.retry_of(name, model_id, seq_id, kind)
            if found is not None:
                return found
            state = self.backend.registry.state(name)
            if state is AdapterState.PAGED:
                self.paging.page_in(name)
            elif state not in (AdapterState.PENDING, AdapterState.ACTIVE):
                raise GatewayNotFoundError(f"Model {model_id} was unloaded; create a new training client")
            self.paging.touch(name)
            try:
                request = build()
            except GatewayError as exc:  # the model itself was found above: this is about the body
                logger.info("Model %s: %s refused at seq_id %d: %s", model_id, kind.value, seq_id, exc)
                return self.log.refuse_command(name, model_id, seq_id, kind, str(exc))
            return self.log.submit_command(name, model_id, seq_id, kind, request)
        except CommandLogError as exc:
            raise GatewayError(str(exc)) from None

    # ---- the driver's side (through the controller actor) ------------------------------

    def take_commands(self, loaded: Collection[str] | None = None) -> ClientCommandBatch:
        self.expire_sessions()
        return self.log.take(self.models.runnable(loaded))

    async def wait_for_commands(self, timeout_s: float, loaded: Collection[str] | None = None) -> bool:
        self.expire_sessions()
        return await self.log.wait_for_commands(self.models.runnable(loaded), timeout_s)

    def complete(self, future_id: str, result: ClientResult) -> Future:
        """A command the driver ran finished. Completing an `optim_step` is what steps the model
        in the registry (one call: the command and the step never disagree); a completed save or
        load becomes the model's resume point."""
        if isinstance(result, ForwardBackwardResult):
            result = _with_loss_sum(result)
        future = self.log.complete(future_id, result)
        if future.model is None:
            return future
        self.paging.touch(future.model)
        if future.kind is FutureKind.OPTIM_STEP:
            self.backend.apply_now(RecordClientStep(future.model))
        elif isinstance(future.request, SaveStateCommand | LoadStateCommand):
            self.backend.apply_now(RecordClientCheckpoint(future.model, future.request.directory))
        if isinstance(future.request, SaveStateCommand | SaveForSamplerCommand):
            self.checkpoint_rules.record(future.request)
        return future

    def fail(self, future_id: str, error: str, category: ErrorCategory = ErrorCategory.SERVER) -> Future:
        future = self.log.fail(future_id, error, category)
        if future.model is not None:
            self.paging.touch(future.model)
        return future

    def fail_running(self, error: str) -> list[str]:
        return self.log.fail_running(error)

    def idle_models(self, idle_s: float) -> list[str]:
        return self.paging.idle_models(idle_s)

    def page_out(self, name: str, directory: str) -> bool:
        return self.paging.page_out(name, directory)

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
