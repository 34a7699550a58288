"""What the dashboard reads: a run directory's `metrics.jsonl` and its rollout dump.

    files = RunFiles(Path("runs/demo"), dump_dir=Path("runs/demo/details/rollouts"))
    page = files.records(offset=0)             # {"offset": 1234, "records": [...], "more": False, "reset": False}
    page = files.records(offset=page["offset"])  # only what was appended since
    files.rollouts("a")                          # [{"rollout_id": 7, "step": 3, ...}], oldest first
    files.rollout("a", 7)                        # one dump document (miles.main.rollout_dump)

The same reader serves the control plane's `/ui` while a trainer runs and
`python -m miles.dashboard RUN_DIR` over a finished run. Reads are incremental (the page
keeps the byte offset it got), so a page left open costs one small read per poll.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.utils.adapter_config import ADAPTER_NAME_PATTERN

METRICS_FILE = "metrics.jsonl"
DEFAULT_LIMIT = 5000
MAX_LIMIT = 20000
ROLLOUT_PREFIX, ROLLOUT_SUFFIX = "rollout_", ".json"
DUMP_SUBDIR = "rollouts"
"""`--dump-details DIR` writes the rollouts under `DIR/rollouts/{adapter}/`."""


class UnknownRolloutError(LookupError):
    """An adapter or rollout the dump does not hold (HTTP 404)."""


@dataclass(frozen=True)
class RunFiles:
    run_dir: Path | None
    """Holds `metrics.jsonl`; None: the control plane was started without a run directory."""
    dump_dir: Path | None = None
    """`{--dump-details}/rollouts`; None: no rollouts are dumped."""

    @property
    def metrics_path(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / METRICS_FILE

    def records(self, offset: int = 0, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
        """The whole records of `metrics.jsonl` from byte `offset`, at most `limit` of them.

        `offset` is where the next call starts; `more`: records are left after these;
        `reset`: the file is shorter than `offset` (a new run replaced it), so these
        records start from its beginning and the caller drops what it had."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        limit = max(1, min(limit, MAX_LIMIT))
        path = self.metrics_path
        try:
            size = os.stat(path).st_size if path is not None else 0
        except FileNotFoundError:
            size = 0
        reset = offset > size
        if reset:
            offset = 0
        if path is None or size == offset:
            return {"offset": offset, "records": [], "more": False, "reset": reset}
        records: list[dict[str, Any]] = []
        with open(path, "rb") as f:
            f.seek(offset)
            while len(records) < limit:
                line = f.readline()
                if not line.endswith(b"\n"):  # the end, or a line still being written
                    break
                offset += len(line)
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn line from a killed writer: skipped, never fatal
                if isinstance(record, dict):
                    records.append(record)
        return {"offset": offset, "records": records, "more": offset < size and len(records) >= limit,
                "reset": reset}

    def rollouts(self, adapter: str) -> list[dict[str, Any]]:
        """The dumped rollouts of `adapter` the dump still keeps, oldest first (by the time written)."""
        folder = self._adapter_dir(adapter)
        out = []
        for rollout_id in sorted(_rollout_ids(folder)):
            try:
                document = self._read(folder, rollout_id)
            except UnknownRolloutError:
                continue  # pruned between the listing and the read
            out.append({"rollout_id": rollout_id, "step": document.get("step"), "time": document.get("time"),
                        "groups": len(document.get("groups") or [])})
        # By time: a restarted trainer numbers its rollouts from 0 again, beside the older files.
        return sorted(out, key=lambda r: (r["time"] if isinstance(r["time"], (int, float)) else 0.0, r["rollout_id"]))

    def rollout(self, adapter: str, rollout_id: int) -> dict[str, Any]:
        return self._read(self._adapter_dir(adapter), rollout_id)

    def dumped_adapters(self) -> list[str]:
        if self.dump_dir is None or not self.dump_dir.is_dir():
            return []
        return sorted(p.name for p in self.dump_dir.iterdir() if p.is_dir() and _valid_name(p.name))

    def _adapter_dir(self, adapter: str) -> Path:
        if self.dump_dir is None:
            raise UnknownRolloutError("No rollouts are dumped: start the trainer with --dump-details DIR")
        if not _valid_name(adapter):
            raise UnknownRolloutError(f"No adapter named {adapter!r}: names match {ADAPTER_NAME_PATTERN.pattern}")
        folder = self.dump_dir / adapter
        if not folder.is_dir():
            raise UnknownRolloutError(f"No rollouts dumped for adapter {adapter!r}")
        return folder

    @staticmethod
    def _read(folder: Path, rollout_id: int) -> dict[str, Any]:
        path = folder / f"{ROLLOUT_PREFIX}{rollout_id:08d}{ROLLOUT_SUFFIX}"
        try:
            document = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise UnknownRolloutError(f"Rollout {rollout_id} of adapter {folder.name!r} is not in the dump "
                                      "(it keeps the latest --dump-details-keep per adapter)") from None
        if not isinstance(document, dict):
            raise UnknownRolloutError(f"Rollout {rollout_id} of adapter {folder.name!r} is not a dump document")
        return document


def adapters_from_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each adapter the records name, at its latest recorded step (a run without a registry file)."""
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.get("kind") == "adapter" and isinstance(record.get("adapter"), str):
            latest[record["adapter"]] = {"name": record["adapter"], "kind": record.get("adapter_kind", "server"),
                                         "state": "RECORDED", "step": record.get("step")}
    return [latest[name] for name in sorted(latest)]


def _valid_name(name: str) -> bool:
    return bool(ADAPTER_NAME_PATTERN.fullmatch(name)) and name not in (".", "..")


def _rollout_ids(folder: Path) -> list[int]:
    ids = []
    for entry in os.listdir(folder):
        if entry.startswith(ROLLOUT_PREFIX) and entry.endswith(ROLLOUT_SUFFIX):
            digits = entry[len(ROLLOUT_PREFIX):-len(ROLLOUT_SUFFIX)]
            if digits.isdigit():
                ids.append(int(digits))
    return ids
