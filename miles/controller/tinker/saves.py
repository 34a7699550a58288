"""The targets of a Tinker model's save and load commands: `tinker://{model}/{weights|
sampler_weights|external_weights}/{name}` and its directory under the model's save
directory, its name checked, a save over one already written or writing refused.
"""

from __future__ import annotations

from miles.controller.tinker.checkpoints import (
    CHECKPOINT_NAME,
    CheckpointPathError,
    Checkpoints,
    check_ttl,
)
from miles.controller.tinker.command_log import CommandLog
from miles.controller.tinker.errors import GatewayError, GatewayNotFoundError
from miles.controller.tinker.models import Models
from miles.utils.types import (
    ClientCommandStatus,
    LoadStateCommand,
    SaveForSamplerCommand,
    SaveStateCommand,
)

UNNAMED_SNAPSHOT_PREFIX = "sampler-seq-"
"""Name of a sampler snapshot saved without one (`save_weights_and_get_sampling_client`): this
prefix and the call's seq_id."""


def tinker_path(model_id: str, segment: str, name: str) -> str:
    return f"tinker://{model_id}/{segment}/{name}"


class SaveCommands:
    """Each save or load call's typed command, with the checkpoint it writes or reads."""

    def __init__(self, models: Models, log: CommandLog, checkpoints: Checkpoints) -> None:
        self.models = models
        self.log = log
        self.checkpoints = checkpoints

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
