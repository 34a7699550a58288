"""What a Tinker model may save, load, delete and let expire: the save and load commands'
targets (`tinker://{model}/{weights|sampler_weights|external_weights}/{name}` and their
directories under the model's save directory), and the rules over the written checkpoints
that `checkpoints.py` records (a resume point, a pending load or a sampled snapshot stays).
"""

from __future__ import annotations

import logging

from miles.controller.backend import MultiLoRABackend
from miles.controller.tinker.checkpoints import (
    CHECKPOINT_NAME,
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
from miles.utils.types import (
    AdapterState,
    ClientCommandStatus,
    LoadStateCommand,
    SaveForSamplerCommand,
    SaveStateCommand,
)

logger = logging.getLogger(__name__)

UNNAMED_SNAPSHOT_PREFIX = "sampler-seq-"
"""Name of a sampler snapshot saved without one (`save_weights_and_get_sampling_client`): this
prefix and the call's seq_id."""


def tinker_path(model_id: str, segment: str, name: str) -> str:
    return f"tinker://{model_id}/{segment}/{name}"


class Saves:
    """The models' save and load commands, and their written checkpoints' lookups, deletions and TTLs."""

    def __init__(self, backend: MultiLoRABackend, models: Models, log: CommandLog, checkpoints: Checkpoints,
                 samplers: SamplingSessions) -> None:
        self.backend = backend
        self.models = models
        self.log = log
        self.checkpoints = checkpoints
        self.samplers = samplers

    # ---- the commands ------------------------------------------------------------------

    def save_state_command(self, model_id: str, name: str | None, overwrite: bool) -> SaveStateCommand:
        checkpoint = self._checkpoint_name(name)
        model, config = self.models.get(model_id)
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
        model, config = self.models.get(model_id)
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
        model, config = self.models.get(model_id)
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

    def load_state_command(self, path: str, optimizer: bool) -> LoadStateCommand:
        """A load of a checkpoint saved by a model this trainer knows (`tinker://{model}/weights/{name}`)."""
        prefix = "tinker://"
        parts = path[len(prefix):].split("/") if path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] != "weights":
            raise GatewayError(f"path {path!r} is not a training checkpoint: use tinker://<model_id>/weights/<name>, "
                               "as save_state returned it")
        source, config = self.models.get(parts[0])
        checkpoint = self._checkpoint_name(parts[2])
        directory = config.save / "weights" / checkpoint
        if not self._saved(parts[0], source, checkpoint) and not directory.is_dir():
            raise GatewayNotFoundError(f"No checkpoint {path!r}: model {parts[0]} never saved one by that name")
        return LoadStateCommand(tinker_path=path, directory=str(directory), optimizer=optimizer)

    def written(self, request: SaveStateCommand | SaveForSamplerCommand) -> CheckpointRecord:
        """The driver reported the save done: its checkpoint is recorded."""
        ttl = request.ttl_seconds if isinstance(request, SaveForSamplerCommand) else None
        return self.checkpoints.add(CheckpointPath.parse(request.tinker_path), request.directory, ttl)

    # ---- the written checkpoints ---------------------------------------------------------

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
