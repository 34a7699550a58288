"""Dataset files: the three formats read the same rows, and every registration error
names what to fix."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles.rollout.datasets import read_rows, validate_dataset

ROWS = [{"text": f"q{i}", "label": i, "metadata": {"k": i, "shared": "row"}} for i in range(5)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist([{"text": r["text"], "label": r["label"]} for r in ROWS]),
                   tmp_path / "d.parquet")
    return {"jsonl": jsonl, "json": str(tmp_path / "d.json"), "parquet": str(tmp_path / "d.parquet")}


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_each_format_reads_the_same_rows(files, kind):
    assert validate_dataset(files[kind], "text", "label") == 5
    assert [(r["text"], r["label"]) for r in read_rows(files[kind])] == [(r["text"], r["label"]) for r in ROWS]


def test_registration_errors_say_what_to_fix(tmp_path, files):
    with pytest.raises(ValueError, match="no such file"):
        validate_dataset(str(tmp_path / "missing.jsonl"), "text", None)
    (tmp_path / "d.csv").write_text("text\nq\n")
    with pytest.raises(ValueError, match="unsupported extension '.csv'; use one of jsonl, json, parquet"):
        validate_dataset(str(tmp_path / "d.csv"), "text", None)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        validate_dataset(str(tmp_path / "empty.jsonl"), "text", None)
    with pytest.raises(ValueError, match=r"no input_key 'prompt'; keys present: \['label', 'metadata', 'text'\]"):
        validate_dataset(files["jsonl"], "prompt", None)
    with pytest.raises(ValueError, match=r"no label_key 'answer'"):
        validate_dataset(files["parquet"], "text", "answer")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match="cannot be read.*line 2"):
        validate_dataset(str(tmp_path / "bad.jsonl"), "text", None)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot be read"):
        validate_dataset(str(tmp_path / "bad.parquet"), "text", None)
    write_jsonl(tmp_path / "num.jsonl", [{"text": 3}])
    with pytest.raises(ValueError, match="must be a string or a list of"):
        validate_dataset(str(tmp_path / "num.jsonl"), "text", None)


def test_fifo_and_device_symlink_are_reported_as_not_regular_files(tmp_path):
    """Opening either would block or never end: both are refused without being read."""
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero):
        with pytest.raises(ValueError, match="not a regular file"):
            validate_dataset(str(path), "text", "label")
    with pytest.raises(ValueError, match="no such file"):
        validate_dataset(str(tmp_path / "missing.jsonl"), "text", "label")
