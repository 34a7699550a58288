"""Tinker sampling sessions and the sampler snapshots they name.

A sampling session samples the base model or one immutable snapshot a model wrote
(`save_weights_for_sampler`, `tinker://{model}/sampler_weights/{name}`); it is kept in its
session's record. A snapshot is found once its save is logged done and not deleted.
"""

from __future__ import annotations

import logging

from miles.controller.tinker.checkpoints import Checkpoints
from miles.controller.tinker.command_log import CommandLog, Future
from miles.controller.tinker.errors import GatewayError, GatewayNotFoundError
from miles.controller.tinker.models import Models
from miles.controller.tinker.sessions import SamplerSession, Session, Sessions
from miles.utils.types import ClientCommandStatus, SamplerSnapshot, SaveForSamplerCommand, parse_sampler_weights_path

logger = logging.getLogger(__name__)


class SamplingSessions:
    """Every session's sampling sessions by id, and the snapshots found written, by tinker path."""

    def __init__(self, sessions: Sessions, models: Models, log: CommandLog, checkpoints: Checkpoints) -> None:
        self.sessions = sessions
        self.models = models
        self.log = log
        self.checkpoints = checkpoints
        self._snapshots: dict[str, SamplerSnapshot] = {}
        self._samplers: dict[str, SamplerSession] = {}
        self._of_save: dict[str, SamplerSession] = {}
        """save_weights_for_sampler future id -> the sampling session it made."""
        for session in sessions:
            for sampler in session.samplers:
                self._index(sampler)

    def create(self, session_id: str, sampler_seq_id: int, model_path: str | None,
               base_model: str | None) -> SamplerSession:
        """A sampling session for a snapshot this trainer wrote (`model_path`) or the base model;
        the same (session, sampler_seq_id) again returns the first one."""
        session = self.sessions.get(session_id)
        sampler_id = f"{session_id}:sample:{sampler_seq_id}"
        found = self._samplers.get(sampler_id)
        if found is not None:
            return found
        if session.finished:
            raise GatewayError(f"Session {session_id} is finished; create a new ServiceClient")
        if model_path is not None:
            snapshot = self.snapshot(model_path)
            _, config = self.models.get(snapshot.model_id)
            sampler = SamplerSession(sampler_id=sampler_id, base_model=config.base_model, model_path=model_path)
        elif base_model is not None:
            sampler = SamplerSession(sampler_id=sampler_id, base_model=self.models.served_base_model(base_model))
        else:
            raise GatewayError("create_sampling_session needs model_path (a tinker://.../sampler_weights/... path) "
                               "or base_model")
        return self._add(session, sampler)

    def create_for_save(self, model_id: str, sampler_seq_id: int, save: Future) -> SamplerSession:
        """The sampling session a `save_weights_and_get_sampling_client` makes: its snapshot is
        the one `save` writes (sampling waits for it to be written)."""
        _, config = self.models.get(model_id)
        session = self.sessions.get(config.session_id)
        sampler_id = f"{config.session_id}:sample:{sampler_seq_id}"
        found = self._samplers.get(sampler_id)
        if found is not None:
            return found
        assert isinstance(save.request, SaveForSamplerCommand)
        return self._add(session, SamplerSession(sampler_id=sampler_id, base_model=config.base_model,
                                                 model_path=save.request.tinker_path, save_future=save.future_id))

    def get(self, sampler_id: str) -> SamplerSession:
        found = self._samplers.get(sampler_id)
        if found is None:
            raise GatewayNotFoundError(f"Unknown sampling session {sampler_id!r}; create one with "
                                       "create_sampling_client")
        return found

    def made_by_save(self, future_id: str) -> SamplerSession | None:
        """The sampling session made with this save_weights_for_sampler future, if any."""
        return self._of_save.get(future_id)

    def sampling(self, model_path: str) -> SamplerSession | None:
        """A sampling session of a live session that samples this snapshot, if any."""
        for session in self.sessions:
            for sampler in session.samplers:
                if sampler.model_path == model_path and not session.finished:
                    return sampler
        return None

    def forget(self, model_path: str) -> None:
        """The snapshot was deleted."""
        self._snapshots.pop(model_path, None)

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
        name = self.models.name(model_id)
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

    def _add(self, session: Session, sampler: SamplerSession) -> SamplerSession:
        self.sessions.add_sampler(session, sampler)
        self._index(sampler)
        logger.info("Tinker sampling session %s: %s", sampler.sampler_id, sampler.model_path or sampler.base_model)
        return sampler

    def _index(self, sampler: SamplerSession) -> None:
        self._samplers[sampler.sampler_id] = sampler
        if sampler.save_future is not None:
            self._of_save[sampler.save_future] = sampler
