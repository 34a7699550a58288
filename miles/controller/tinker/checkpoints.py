"""The checkpoints a Tinker client's models wrote: one record per finished save, by tinker path.

A `save_state` (`tinker://{model_id}/weights/{name}`), a `save_weights_for_sampler`
(`.../sampler_weights/{name}`) and a `save_weights_external` (`.../external_weights/{name}`)
become a `CheckpointRecord` once the driver reports the directory written. Records are rows of
the registry's SQLite file, so a restarted controller lists the same checkpoints; deleting one
removes its directory and its row. The rules about who may delete what (a model's resume
point, a snapshot a sampling session samples) are the gateway's; this module only keeps the
records and serves their files:

    checkpoints = Checkpoints(store, clock)
    checkpoints.add(CheckpointRecord(...))               # the gateway, when a save completes
    checkpoints.of_model("s-1:train:0")                  # newest first
    urls = checkpoints.file_urls(record, "http://host:port")   # signed, for get_external_weights_urls
    checkpoints.open_file(model_id, checkpoint_id, file, expires, signature)   # the download route

A file URL carries its own authentication (the SDK downloads with plain `urllib`, without the
API key): an HMAC of the checkpoint, the file and the expiry, keyed by a secret drawn when
the controller starts, so URLs stop working at their expiry or on a restart (sign again).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

from miles.controller.store import RegistryStore

CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
"""A checkpoint's name: it becomes one directory name under the model's directory."""
URL_LIFETIME_S = 3600.0
"""How long a signed file URL works (the SDK's CLI signs again five minutes before)."""
FILES_ROUTE = "/api/v1/checkpoint_files"
"""The download route's prefix; requests under it are authenticated by their signature."""
MAX_TTL_S = 10 * 365 * 24 * 3600
MIN_TTL_S = 3600


class CheckpointType(str, enum.Enum):
    """A checkpoint's kind, by the SDK's `CheckpointType` values."""

    TRAINING = "training"
    SAMPLER = "sampler"
    EXTERNAL = "external"

    @property
    def segment(self) -> str:
        """Its tinker path segment (and directory under the model's)."""
        return {CheckpointType.TRAINING: "weights", CheckpointType.SAMPLER: "sampler_weights",
                CheckpointType.EXTERNAL: "external_weights"}[self]

    @classmethod
    def of_segment(cls, segment: str) -> CheckpointType:
        for kind in cls:
            if kind.segment == segment:
                return kind
        raise CheckpointPathError(f"{segment!r} is not a checkpoint kind: use weights, sampler_weights "
                                  "or external_weights")


class CheckpointPathError(ValueError):
    """A tinker path or checkpoint id that names no possible checkpoint (HTTP 400)."""


class CheckpointFileError(PermissionError):
    """A download whose signature is missing, wrong or expired (HTTP 401)."""


class CheckpointFileNotFoundError(LookupError):
    """A signed download of a checkpoint or file that is not there (HTTP 404)."""


@dataclass(frozen=True)
class CheckpointPath:
    """A checkpoint named by its model id, kind and name (each checked: no '/', no '..')."""

    model_id: str
    kind: CheckpointType
    name: str

    @classmethod
    def parse(cls, tinker_path: str) -> CheckpointPath:
        """`tinker://{model_id}/{weights|sampler_weights|external_weights}/{name}`."""
        prefix = "tinker://"
        if not tinker_path.startswith(prefix):
            raise CheckpointPathError(f"tinker_path {tinker_path!r} must start with tinker://")
        model_id, _, checkpoint_id = tinker_path[len(prefix):].partition("/")
        return cls.of(model_id, checkpoint_id)

    @classmethod
    def of(cls, model_id: str, checkpoint_id: str) -> CheckpointPath:
        """A model id and the SDK's checkpoint id (`weights/{name}`, `sampler_weights/{name}`, ...)."""
        if not model_id or "/" in model_id or model_id in (".", ".."):
            raise CheckpointPathError(f"training run id {model_id!r} is not a model id")
        segment, _, name = checkpoint_id.partition("/")
        kind = CheckpointType.of_segment(segment)
        if not CHECKPOINT_NAME.fullmatch(name) or name in (".", ".."):
            raise CheckpointPathError(f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-' "
                                      "(one directory name)")
        return cls(model_id=model_id, kind=kind, name=name)

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind.segment}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.checkpoint_id}"


@dataclass(frozen=True)
class CheckpointRecord:
    """One written checkpoint."""

    path: CheckpointPath
    directory: str
    """Where it is: `{model's save directory}/{segment}/{name}`."""
    time: float
    """When the driver reported it written (epoch seconds)."""
    size_bytes: int | None
    """Its files' total size when written; None if the directory was not readable then."""
    expires_at: float | None = None
    """Removed after this (epoch seconds); None: kept until deleted. Only exports expire."""

    def to_json(self) -> dict[str, Any]:
        return {"model_id": self.path.model_id, "kind": self.path.kind.value, "name": self.path.name,
                "directory": self.directory, "time": self.time, "size_bytes": self.size_bytes,
                "expires_at": self.expires_at}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CheckpointRecord:
        path = CheckpointPath(model_id=raw["model_id"], kind=CheckpointType(raw["kind"]), name=raw["name"])
        return cls(path=path, directory=raw["directory"], time=raw["time"], size_bytes=raw["size_bytes"],
                   expires_at=raw["expires_at"])


class Checkpoints:
    """Every written checkpoint's record, by tinker path, written through to the store."""

    def __init__(self, store: RegistryStore | None = None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._secret = os.urandom(32)
        self._records: dict[str, CheckpointRecord] = {}
        if store is not None:
            for raw in store.load_checkpoints():
                record = CheckpointRecord.from_json(raw)
                self._records[record.path.tinker_path] = record

    def __contains__(self, tinker_path: str) -> bool:
        return tinker_path in self._records

    def get(self, tinker_path: str) -> CheckpointRecord | None:
        return self._records.get(tinker_path)

    def add(self, path: CheckpointPath, directory: str, ttl_s: float | None = None) -> CheckpointRecord:
        """Record a checkpoint just written (replacing one of the same path: an overwrite)."""
        now = self.clock()
        record = CheckpointRecord(path=path, directory=directory, time=now, size_bytes=_size(Path(directory)),
                                  expires_at=None if ttl_s is None else now + ttl_s)
        self._write(record)
        return record

    def set_ttl(self, record: CheckpointRecord, ttl_s: float | None) -> CheckpointRecord:
        updated = replace(record, expires_at=None if ttl_s is None else self.clock() + ttl_s)
        self._write(updated)
        return updated

    def remove(self, record: CheckpointRecord) -> None:
        """Delete the checkpoint's directory, then its record."""
        shutil.rmtree(record.directory, ignore_errors=True)
        self._records.pop(record.path.tinker_path, None)
        if self.store is not None:
            self.store.delete_checkpoint(record.path.tinker_path)

    def expired(self) -> list[CheckpointRecord]:
        now = self.clock()
        return [r for r in self._records.values() if r.expires_at is not None and r.expires_at <= now]

    def of_model(self, model_id: str) -> list[CheckpointRecord]:
        """The model's checkpoints, newest first."""
        return [r for r in self.all() if r.path.model_id == model_id]

    def all(self) -> list[CheckpointRecord]:
        """Every checkpoint, newest first."""
        return sorted(self._records.values(), key=lambda r: r.time, reverse=True)

    def _write(self, record: CheckpointRecord) -> None:
        self._records[record.path.tinker_path] = record
        if self.store is not None:
            self.store.put_checkpoint(record.path.tinker_path, record.to_json())

    # ---- files -------------------------------------------------------------------------------

    def files(self, record: CheckpointRecord) -> list[str]:
        """Its regular files, relative to its directory (links are never followed or served)."""
        root = Path(record.directory)
        real = root.resolve()
        return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                      if p.is_file() and not p.is_symlink() and p.resolve().is_relative_to(real))

    def file_urls(self, record: CheckpointRecord, base_url: str) -> tuple[dict[str, str], float]:
        """A signed URL per file (relative path -> URL) and when they expire (epoch seconds)."""
        expires = int(self.clock() + URL_LIFETIME_S)
        urls = {}
        for file in self.files(record):
            route = f"{FILES_ROUTE}/{quote(record.path.model_id)}/{record.path.checkpoint_id}/{quote(file)}"
            urls[file] = f"{base_url}{route}?expires={expires}&signature={self._sign(record.path, file, expires)}"
        return urls, float(expires)

    def open_file(self, path: CheckpointPath, file: str, expires: int, signature: str) -> Path:
        """The file a signed URL names, once its signature and expiry are checked."""
        if not hmac.compare_digest(signature, self._sign(path, file, expires)):
            raise CheckpointFileError("invalid download signature: ask get_external_weights_urls for new URLs")
        if expires < self.clock():
            raise CheckpointFileError("this download URL expired: ask get_external_weights_urls for new URLs")
        record = self._records.get(path.tinker_path)
        if record is None:
            raise CheckpointFileNotFoundError(f"no checkpoint {path.tinker_path!r} (deleted since the URL was signed)")
        root = Path(record.directory).resolve()
        target = (root / file).resolve()
        if not target.is_relative_to(root) or file not in self.files(record):
            raise CheckpointFileNotFoundError(f"checkpoint {path.tinker_path!r} has no file {file!r}")
        return target

    def _sign(self, path: CheckpointPath, file: str, expires: int) -> str:
        message = f"{path.tinker_path}\n{file}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def check_ttl(ttl_s: int | None) -> int | None:
    if ttl_s is not None and not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        raise CheckpointPathError(f"ttl_seconds {ttl_s} must be between {MIN_TTL_S} (1 hour) and "
                                  f"{MAX_TTL_S} (10 years), or None for no expiry")
    return ttl_s


def _size(directory: Path) -> int | None:
    try:
        return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    except OSError:
        return None
