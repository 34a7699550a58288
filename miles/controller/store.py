"""The registry on disk: one SQLite file, written through after every change.

The registry stays a pure state machine; after each successful change the backend calls
`RegistryStore.write_through(registry)`, which writes the rows of the records the registry
says changed (`take_changes`), so a change costs the same however many records are kept,
and a controller that starts (a fresh trainer with the same run directory, or the
controller actor restarted by Ray) rebuilds the registry from `load()`:

    store = RegistryStore(run_dir / "controller" / "registry.sqlite")
    state = store.load()                      # None on first start
    registry = AdapterRegistry.from_state(state, n_slots) if state else AdapterRegistry(n_slots)
    ...; store.write_through(registry)        # one transaction, only the rows that changed
    store.save(registry.export_state())       # the whole state (what a first write_through does)

The database runs in WAL mode with `synchronous=NORMAL`: a change has reached the
operating system when `save` returns, so a process killed at any point (SIGKILL, an
actor crash) leaves the last committed state; a power cut may lose the last few changes
but never corrupts the file. One write costs well under a millisecond (no fsync per
change), so the control plane's loop is never held up by the disk.
Rows: one per adapter (live, QUEUED and finished; a queued row's `position` keeps the
queue's order), one per recorded batch, and a few `meta` keys (slot versions, slot count,
the control plane's bound port).

The Tinker gateway (DESIGN §11) keeps its state here too, one row per change: `sessions`
(a client's session and its last heartbeat) and `futures`, the command log: every call of
a client-driven model with its future id, idempotency key (model and `seq_id`), status,
typed request and result, as JSON written by `miles.controller.tinker.command_log`:

    store.put_future(FutureRow(...)); store.load_futures()    # oldest first
    store.put_session("s-1", {...}); store.load_sessions()

and `tinker_checkpoints`, one row per checkpoint a client's model wrote (`checkpoints.py`).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.controller.registry import AdapterRegistry
from miles.controller.registry_records import RegistryChanges, RegistryState
from miles.utils.types import AdapterState

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS adapters (name TEXT PRIMARY KEY, position INTEGER NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (rollout_id INTEGER PRIMARY KEY, position INTEGER NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tinker_futures (
    future_id TEXT PRIMARY KEY, position INTEGER NOT NULL, key TEXT NOT NULL UNIQUE, model TEXT,
    seq_id INTEGER, kind TEXT NOT NULL, status TEXT NOT NULL, record TEXT NOT NULL, request BLOB, result BLOB
);
CREATE TABLE IF NOT EXISTS tinker_checkpoints (tinker_path TEXT PRIMARY KEY, record TEXT NOT NULL);
"""


@dataclass(frozen=True)
class FutureRow:
    """One future of the command log as stored: plain values, the typed parts as JSON text."""

    future_id: str
    key: str
    """Idempotency key: a retried request with the same key is the same future."""
    model: str | None
    seq_id: int | None
    kind: str
    status: str
    record: str
    """JSON of the small parts (model id, error, category, ...)."""
    request: bytes | None = None
    """The typed request, encoded by the log (datums can be megabytes: written once)."""
    result: bytes | None = None



class RegistryStoreError(RuntimeError):
    """The registry file cannot be opened or is not one this version understands."""


class RegistryStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # durable across a crash of the process
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise RegistryStoreError(f"Cannot open the registry file {self.path} ({exc}); "
                                     "move it away to start with an empty registry") from exc
        version = self.get_meta("schema_version")
        if version is None:
            self.set_meta("schema_version", SCHEMA_VERSION)
        elif version != SCHEMA_VERSION:
            raise RegistryStoreError(f"Registry file {self.path} has schema version {version}, "
                                     f"this build reads {SCHEMA_VERSION}")
        self._written: dict[tuple[str, Any], str] = self._read_rows()
        self._texts: dict[tuple[int, int], tuple[dict[str, Any], str]] = {}
        self._positions: dict[tuple[str, Any], int] = {
            key: json.loads(text)["position"] for key, text in self._written.items() if key[0] != "meta"}
        """Each adapter's and batch's written `position`; the order of queued, finished and
        batch rows, kept by each row for as long as its place in that order holds."""
        self._top = max(self._positions.values(), default=0)
        """The highest position ever handed out: a row that must move after others gets the next."""
        self._batch_ids = {key[1] for key in self._written if key[0] == "batches"}
        """The batches with a row."""
        self._synced: int | None = None
        """id() of the registry whose every row this file holds, as of its last `take_changes`
        (None: the next `write_through` writes the whole state)."""

    def close(self) -> None:
        self._db.close()

    # ---- meta ---------------------------------------------------------------------------

    def get_meta(self, key: str) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    # ---- the Tinker gateway's sessions and command log ---------------------------------------

    def put_session(self, session_id: str, record: dict[str, Any]) -> None:
        self._db.execute("INSERT OR REPLACE INTO sessions (session_id, record) VALUES (?, ?)",
                         (session_id, json.dumps(record, sort_keys=True)))

    def load_sessions(self) -> list[dict[str, Any]]:
        return [json.loads(r[0]) for r in self._db.execute("SELECT record FROM sessions ORDER BY rowid")]

    def put_future(self, row: FutureRow) -> None:
        """Write a new future, payloads included."""
        self._db.execute(
            "INSERT INTO tinker_futures "
            "(future_id, position, key, model, seq_id, kind, status, record, request, result) "
            "VALUES (?, (SELECT COALESCE(MAX(position), 0) + 1 FROM tinker_futures), ?, ?, ?, ?, ?, ?, ?, ?)",
            (row.future_id, row.key, row.model, row.seq_id, row.kind, row.status, row.record, row.request, row.result))

    def update_future(self, future_id: str, status: str, record: str, result: bytes | None = None, *,
                      drop_payloads: bool = False) -> None:
        """A future's new status (and its result, once it has one), without rewriting its request;
        `drop_payloads` forgets its request and result."""
        if drop_payloads:
            self._db.execute("UPDATE tinker_futures SET status = ?, record = ?, request = NULL, result = NULL "
                             "WHERE future_id = ?", (status, record, future_id))
        else:
            self._db.execute("UPDATE tinker_futures SET status = ?, record = ?, result = COALESCE(?, result) "
                             "WHERE future_id = ?", (status, record, result, future_id))

    def load_futures(self) -> list[FutureRow]:
        """Every logged future, in the order they were first written."""
        rows = self._db.execute("SELECT future_id, key, model, seq_id, kind, status, record, request, result "
                                "FROM tinker_futures ORDER BY position")
        return [FutureRow(*row) for row in rows]

    def put_checkpoint(self, tinker_path: str, record: dict[str, Any]) -> None:
        self._db.execute("INSERT OR REPLACE INTO tinker_checkpoints (tinker_path, record) VALUES (?, ?)",
                         (tinker_path, json.dumps(record, sort_keys=True)))

    def delete_checkpoint(self, tinker_path: str) -> None:
        self._db.execute("DELETE FROM tinker_checkpoints WHERE tinker_path = ?", (tinker_path,))

    def load_checkpoints(self) -> list[dict[str, Any]]:
        return [json.loads(r[0]) for r in self._db.execute("SELECT record FROM tinker_checkpoints ORDER BY rowid")]

    # ---- registry -------------------------------------------------------------------------

    def load(self) -> RegistryState | None:
        """The last saved registry, or None if nothing was ever saved here."""
        n_slots = self.get_meta("n_slots")
        if n_slots is None:
            return None
        adapters = self._db.execute("SELECT record FROM adapters ORDER BY position").fetchall()
        records = [json.loads(r[0]) for r in adapters]
        batches = self._db.execute("SELECT rollout_id, record FROM batches ORDER BY position").fetchall()
        states = [AdapterState(r["state"]) for r in records]
        return RegistryState(
            n_slots=n_slots, slot_versions=self.get_meta("slot_versions"),
            live=sorted((r for r, state in zip(records, states) if state.holds_slot or state is AdapterState.PAGED),
                        key=lambda r: r["slot"]),
            finished=[r for r, state in zip(records, states) if state.terminal],
            batches=[(rollout_id, json.loads(text)) for rollout_id, text in batches],
            queued=[r for r, state in zip(records, states) if state is AdapterState.QUEUED],
        )

    def write_through(self, registry: AdapterRegistry) -> None:
        """Write what changed in `registry` since the last call, in one transaction: only its
        changed rows (`take_changes`), so a change costs the same however many records are
        kept. The first call for a registry, and any after a failed write or a change the
        registry cannot describe row by row, writes its whole state (`save`)."""
        changes = registry.take_changes()
        if changes is None or self._synced != id(registry):
            self._synced = None
            self.save(registry.export_state())
            self._synced = id(registry)
            return
        self._synced = None  # until this write is in
        self._save_changes(changes)
        self._synced = id(registry)

    def save(self, state: RegistryState) -> None:
        """Write `state` in one transaction, touching only the rows that changed."""
        rows, positions = self._rows(state)
        changed = {key: text for key, text in rows.items() if self._written.get(key) != text}
        removed = [key for key in self._written if key not in rows]
        self._commit(changed, removed)
        self._positions = positions
        self._batch_ids = {rollout_id for rollout_id, _ in state.batches}

    def _save_changes(self, changes: RegistryChanges) -> None:
        """The rows `changes` names: each changed live record where it was (or at a new
        position), each changed finished one after every other row, the queue and the batches
        in their order (few rows, rewritten only where their text changed), forgotten names
        deleted."""
        rows: dict[tuple[str, Any], str] = {
            ("meta", "n_slots"): json.dumps(changes.n_slots),
            ("meta", "slot_versions"): json.dumps(changes.slot_versions),
        }
        positions: dict[tuple[str, Any], int] = {}
        placed = [(r, p) for r, p in zip(changes.live, self._place("adapters", [r["name"] for r in changes.live],
                                                                    False, positions), strict=True)]
        queue_names = [r["name"] for r in changes.queued]
        placed += zip(changes.queued, self._place("adapters", queue_names, True, positions), strict=True)
        for record in changes.finished:  # the end of the retention order: after every row so far
            self._top += 1
            positions[("adapters", record["name"])] = self._top
            placed.append((record, self._top))
        for record, position in placed:
            rows[("adapters", record["name"])] = json.dumps({**record, "position": position}, sort_keys=True)
        batch_ids = [rollout_id for rollout_id, _ in changes.batches]
        for (rollout_id, batch), position in zip(changes.batches, self._place("batches", batch_ids, True, positions),
                                                 strict=True):
            rows[("batches", rollout_id)] = json.dumps({**batch, "position": position}, sort_keys=True)
        removed = [("adapters", name) for name in changes.removed if ("adapters", name) in self._written]
        kept_batches = set(batch_ids)
        removed += [("batches", rollout_id) for rollout_id in self._batch_ids if rollout_id not in kept_batches]
        changed = {key: text for key, text in rows.items() if self._written.get(key) != text}
        self._commit(changed, removed)
        for key in removed:
            self._positions.pop(key, None)
        self._positions.update(positions)
        self._batch_ids = kept_batches

    def _commit(self, changed: dict[tuple[str, Any], str], removed: list[tuple[str, Any]]) -> None:
        """Write `changed` rows and delete `removed` ones in one transaction."""
        if not changed and not removed:
            return
        try:
            self._db.execute("BEGIN IMMEDIATE")
            for (table, key), text in changed.items():
                if table == "meta":
                    self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, text))
                    continue
                position = json.loads(text)["position"]
                if table == "adapters":
                    self._db.execute("INSERT OR REPLACE INTO adapters (name, position, record) VALUES (?, ?, ?)",
                                     (key, position, text))
                else:
                    self._db.execute("INSERT OR REPLACE INTO batches (rollout_id, position, record) VALUES (?, ?, ?)",
                                     (key, position, text))
            for table, key in removed:
                column = "name" if table == "adapters" else "rollout_id"
                self._db.execute(f"DELETE FROM {table} WHERE {column} = ?", (key,))  # noqa: S608 - fixed names
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        for key in removed:
            del self._written[key]
        self._written.update(changed)

    def _read_rows(self) -> dict[tuple[str, Any], str]:
        rows: dict[tuple[str, Any], str] = {}
        for key, value in self._db.execute("SELECT key, value FROM meta WHERE key IN ('n_slots', 'slot_versions')"):
            rows[("meta", key)] = value
        for name, record in self._db.execute("SELECT name, record FROM adapters"):
            rows[("adapters", name)] = record
        for rollout_id, record in self._db.execute("SELECT rollout_id, record FROM batches"):
            rows[("batches", rollout_id)] = record
        return rows


    def _rows(self, state: RegistryState) -> tuple[dict[tuple[str, Any], str], dict[tuple[str, Any], int]]:
        """Each row's stored text, and each adapter's and batch's position. Rows are read back
        in `position` order: queued, finished and batch rows keep the registry's order; live
        rows need none (they are read back by slot). A row keeps its position while it stays
        after the previous row of its list, so a registration, a finished adapter or a record
        read (moved to the end of the retention order) rewrites that one row, not every row
        after it. The registry hands back the same dict for an unchanged record, so its text
        is reused."""
        rows: dict[tuple[str, Any], str] = {
            ("meta", "n_slots"): json.dumps(state.n_slots),
            ("meta", "slot_versions"): json.dumps(state.slot_versions),
        }
        positions: dict[tuple[str, Any], int] = {}
        texts: dict[tuple[int, int], tuple[dict[str, Any], str]] = {}
        for records, ordered in ((state.live, False), (state.queued, True), (state.finished, True)):
            for record, position in zip(records, self._place("adapters", [r["name"] for r in records], ordered,
                                                             positions), strict=True):
                key = (id(record), position)
                cached = self._texts.get(key)
                if cached is None or cached[0] is not record:
                    cached = (record, json.dumps({**record, "position": position}, sort_keys=True))
                texts[key] = cached
                rows[("adapters", record["name"])] = cached[1]
        self._texts = texts
        batch_positions = self._place("batches", [rollout_id for rollout_id, _ in state.batches], True, positions)
        for (rollout_id, batch), position in zip(state.batches, batch_positions, strict=True):
            rows[("batches", rollout_id)] = json.dumps({**batch, "position": position}, sort_keys=True)
        return rows, positions

    def _place(self, table: str, keys: list[Any], ordered: bool, positions: dict[tuple[str, Any], int]) -> list[int]:
        """The positions of a list's rows: each its written one, unless it has none or (when
        `ordered`) it is not after the previous row's; then the next one past every other."""
        placed, last = [], 0
        for key in keys:
            position = self._positions.get((table, key))
            if position is None or (ordered and position <= last):
                self._top += 1
                position = self._top
            positions[(table, key)] = last = position
            placed.append(position)
        return placed


def registry_statuses(path: Path) -> list[dict[str, Any]] | None:
    """The adapters a run's registry file holds, as `GET /adapter_runs` words them; None
    when there is no such file (the standalone dashboard reads a finished run's)."""
    if not path.is_file():
        return None
    store = RegistryStore(path)
    try:
        state = store.load()
    finally:
        store.close()
    if state is None:
        return []
    registry = AdapterRegistry.from_state(state, state.n_slots)
    return [s.model_dump(mode="json") for s in registry.statuses()]
