"""Tinker sessions: a client's `ServiceClient`, its heartbeats, and the record of its models
and sampling sessions, kept in the registry's SQLite store so a restarted controller knows them.

    sessions = Sessions(store, clock, timeout_s=600.0)
    session_id = sessions.create(SessionInfo(sdk_version="0.38.0"))
    sessions.heartbeat(session_id)
    sessions.silent()          # ids of the live sessions not heard from for timeout_s
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from miles.controller.store import RegistryStore
from miles.controller.tinker.errors import GatewayNotFoundError, GatewaySessionFinishedError

logger = logging.getLogger(__name__)


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


class Sessions:
    """Every session by id, each written through to the store when it changes."""

    def __init__(self, store: RegistryStore | None = None, clock: Callable[[], float] = time.time,
                 timeout_s: float | None = None) -> None:
        self.store = store
        self.clock = clock
        self.timeout_s = timeout_s
        """A live session silent this long is due to be finished; None: never."""
        self._sessions: dict[str, Session] = {}
        if store is not None:
            for raw in store.load_sessions():
                session = Session.from_json(raw)
                session.last_heartbeat = clock()  # a restarted controller gives every client time to call again
                self._sessions[session.session_id] = session

    def create(self, info: SessionInfo) -> str:
        now = self.clock()
        session = Session(session_id=f"s-{uuid.uuid4().hex[:16]}", info=info, created=now, last_heartbeat=now)
        self._sessions[session.session_id] = session
        self._persist(session)
        logger.info("Tinker session %s created (sdk %s)", session.session_id, info.sdk_version or "?")
        return session.session_id

    def heartbeat(self, session_id: str) -> None:
        session = self.get(session_id)
        if session.finished:
            raise GatewaySessionFinishedError(f"Session {session_id} is finished (closed, or silent for too long)")
        session.last_heartbeat = self.clock()

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise GatewayNotFoundError(f"Unknown session {session_id!r}; create one with create_session")
        return session

    def __iter__(self) -> Iterator[Session]:
        """Every session, oldest first."""
        return iter(list(self._sessions.values()))

    def all(self) -> list[Session]:
        """Every session, newest first."""
        return sorted(self._sessions.values(), key=lambda s: s.created, reverse=True)

    def finish(self, session_id: str) -> Session:
        session = self.get(session_id)
        session.finished = True
        self._persist(session)
        return session

    def silent(self) -> list[str]:
        """The live sessions silent for over `timeout_s`."""
        timeout = self.timeout_s
        if timeout is None:
            return []
        now = self.clock()
        return [s.session_id for s in self._sessions.values() if not s.finished and now - s.last_heartbeat > timeout]

    def add_model(self, session: Session, model_id: str) -> None:
        session.model_ids.append(model_id)
        self._persist(session)

    def add_sampler(self, session: Session, sampler: SamplerSession) -> None:
        session.samplers.append(sampler)
        self._persist(session)

    def _persist(self, session: Session) -> None:
        if self.store is not None:
            self.store.put_session(session.session_id, session.to_json())
