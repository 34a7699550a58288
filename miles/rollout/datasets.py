"""Dataset files of adapters: reading jsonl/json/parquet rows and checking their keys.

`validate_dataset` runs once when an adapter registers (the controller is handed it at
launch and calls it off its event loop), so a bad file is a 400 at the control plane and
its row count fixes the adapter's `num_step`; the data source reads the rows again with
`read_rows` + `check_rows` when the adapter becomes live.

    rows = validate_dataset("data/gsm8k.jsonl", "text", "label")   # row count
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")


def read_rows(path: str) -> list[dict[str, Any]]:
    """All rows of a jsonl, json (a list of objects) or parquet file; ValueError if bad."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        raise ValueError(f"dataset {path}: unsupported extension {suffix or '(none)'!r}; "
                         "use one of jsonl, json, parquet")
    if not file.exists():
        raise ValueError(f"dataset {path}: no such file")
    if not file.is_file():  # a FIFO or device would block or never end
        raise ValueError(f"dataset {path}: not a regular file")
    try:
        rows = _READERS[suffix](file)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"dataset {path}: cannot be read ({exc})") from exc
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"dataset {path}: row {number} is a {type(row).__name__}, expected an object")
    return rows


def _read_jsonl(file: Path) -> list[Any]:
    rows = []
    with file.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {line_number} is not valid JSON: {exc}") from exc
    return rows


def _read_json(file: Path) -> list[Any]:
    data = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"expected a JSON list of rows, got a {type(data).__name__}")
    return data


def _read_parquet(file: Path) -> list[Any]:
    import pyarrow.parquet as pq
    from pyarrow import ArrowException

    try:
        return pq.read_table(file).to_pylist()
    except ArrowException as exc:
        raise ValueError(str(exc)) from exc


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_rows(rows: list[dict[str, Any]], path: str, input_key: str, label_key: str | None) -> None:
    """ValueError naming the first missing key (and the keys the rows do have) or the
    first prompt that is neither a string nor a list of chat messages."""
    required = [input_key] + ([label_key] if label_key is not None else [])
    for number, row in enumerate(rows):
        for key in required:
            if key not in row:
                kind = "input_key" if key == input_key else "label_key"
                raise ValueError(
                    f"dataset {path}: row {number} has no {kind} {key!r}; "
                    f"keys present: {sorted(row)}. Set {kind} in the adapter config to one of them"
                )
        prompt = row[input_key]
        if not isinstance(prompt, str) and not _is_messages(prompt):
            raise ValueError(
                f"dataset {path}: row {number}: {input_key!r} must be a string or a list of "
                f"{{'role', 'content'}} messages, got {type(prompt).__name__}"
            )


def validate_dataset(path: str, input_key: str, label_key: str | None) -> int:
    """Read and check a dataset at registration; returns its row count."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"dataset {path}: empty, it needs at least one row")
    check_rows(rows, path, input_key, label_key)
    return len(rows)
