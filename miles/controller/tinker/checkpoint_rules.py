"""The rules over the checkpoints a Tinker model wrote (`checkpoints.py` keeps their records):
a lookup says why a checkpoint is missing, and a deletion or an export's expiry spares one
still needed (a live model's resume point, a load still to run, a snapshot being sampled).
"""

from __future__ import annotations

import logging

from miles.controller.backend import MultiLoRABackend
from miles.controller.tinker.checkpoints import (
    CheckpointPath,
    CheckpointPathError,
    CheckpointRecord,
    Checkpoints,
    CheckpointType,
    check_ttl,
)
from miles.controller.tinker.command_log import CommandLog
from miles.controller.tinker.errors import GatewayError, GatewayInUseError, GatewayNotFoundError
from miles.controller.tinker.models import Models
from miles.controller.tinker.sampling_sessions import SamplingSessions
from miles.utils.types import AdapterState, LoadStateCommand, SaveForSamplerCommand, SaveStateCommand

logger = logging.getLogger(__name__)


class CheckpointRules:
    """Lookups, deletions and TTLs of the written checkpoints, and the record of each save done."""

    def __init__(self, backend: MultiLoRABackend, models: Models, log: CommandLog, checkpoints: Checkpoints,
                 samplers: SamplingSessions) -> None:
        self.backend = backend
        self.models = models
        self.log = log
        self.checkpoints = checkpoints
        self.samplers = samplers

    def record(self, request: SaveStateCommand | SaveForSamplerCommand) -> CheckpointRecord:
        """The driver reported the save done: its checkpoint is recorded."""
        ttl = request.ttl_seconds if isinstance(request, SaveForSamplerCommand) else None
        return self.checkpoints.add(CheckpointPath.parse(request.tinker_path), request.directory, ttl)

    def checkpoints_of(self, model_id: str | None = None) -> list[CheckpointRecord]:
        """The model's written checkpoints (every model's when None), newest first; expired
        exports are removed first."""
        if model_id is not None:
            self.models.get(model_id)
        self.expire()
        return self.checkpoints.all() if model_id is None else self.checkpoints.of_model(model_id)

    def checkpoint(self, path: CheckpointPath) -> CheckpointRecord:
        """A written checkpoint; 404 naming the path (and why) when there is none."""
        model, _ = self.models.get(path.model_id)
        self.expire()
        record = self.checkpoints.get(path.tinker_path)
        if record is not None:
            return record
        writing = any(isinstance(f.request, SaveStateCommand | SaveForSamplerCommand)
                      and f.request.tinker_path == path.tinker_path and not f.status.finished
                      for f in self.log.commands(model))
        why = "its save has not finished" if writing else f"model {path.model_id} has no such checkpoint"
        raise GatewayNotFoundError(f"No checkpoint {path.tinker_path!r}: {why}")

    def delete(self, path: CheckpointPath) -> CheckpointRecord:
        """Remove a checkpoint's directory and record, unless something still needs it (400 naming what)."""
        record = self.checkpoint(path)
        reason = self._in_use(record)
        if reason is not None:
            raise GatewayInUseError(f"Checkpoint {path.tinker_path} is not deleted: {reason}")
        self.checkpoints.remove(record)
        self.samplers.forget(path.tinker_path)
        logger.info("Tinker checkpoint %s deleted (%s)", path.tinker_path, record.directory)
        return record

    def set_ttl(self, path: CheckpointPath, ttl_seconds: int | None) -> CheckpointRecord:
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

    def expire(self) -> list[str]:
        """Delete the exports whose TTL ran out; returns their tinker paths."""
        expired = [r for r in self.checkpoints.expired() if self._in_use(r) is None]
        for record in expired:
            self.checkpoints.remove(record)
            logger.info("Tinker export %s expired and was deleted", record.path.tinker_path)
        return [r.path.tinker_path for r in expired]

    def _in_use(self, record: CheckpointRecord) -> str | None:
        """Why the checkpoint must stay, or None."""
        path = record.path.tinker_path
        for run in self.backend.snapshot().clients.values():
            if run.state in (AdapterState.PENDING, AdapterState.ACTIVE) and run.resume_from == record.directory:
                return (f"it is the resume point of live model {run.config.model_id} (a restarted trainer loads "
                        "it from there); save a newer state or unload the model first")
        for model in self.models.names():
            for future in self.log.commands(model):
                if isinstance(future.request, LoadStateCommand) and future.request.tinker_path == path \
                        and not future.status.finished:
                    return f"model {future.model_id} has a load_state of it still to run"
        sampler = self.samplers.sampling(path)
        if sampler is not None:
            return (f"sampling session {sampler.sampler_id} samples it; close its ServiceClient "
                    "(or let its session end) first")
        return None
