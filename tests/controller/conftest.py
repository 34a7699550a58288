"""Fixtures of the control-plane tests (the pieces themselves are in controller_fakes.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.utils.adapter_config import AdapterDefaults
from tests.helpers.controller_fakes import LoopbackRouter, write_dataset


@pytest.fixture
def loopback_servers() -> Iterator[list[LoopbackRouter]]:
    """Collects LoopbackRouters made by a test and closes them afterwards."""
    servers: list[LoopbackRouter] = []
    yield servers
    for server in servers:
        server.close()


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    write_dataset(tmp_path / "data" / "train.jsonl")
    return tmp_path


@pytest.fixture
def defaults(data_root: Path) -> AdapterDefaults:
    return AdapterDefaults(lora_rank=8, rollout_batch_size=4, n_samples_per_prompt=2, save=str(data_root / "save"),
                           rm_type="math", max_adapter_global_batch_size=64)
