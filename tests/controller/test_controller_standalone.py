"""`python -m miles.main.control_plane` as a subprocess: serves the API, stops cleanly on signals."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from miles.controller.client import ControlPlaneClient, ControlPlaneError
from miles.utils.types import AdapterState
from tests.helpers.controller_process import start, stop


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serves_and_stops_cleanly(sig: int, data_root: Path) -> None:
    args = ["--multi-lora-n-adapters", "1", "--multi-lora-api-port", "0", "--save", str(data_root / "save"),
            "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--lora-rank", "4", "--multi-lora-allowed-roots", str(data_root), "--multi-lora-queue-size", "1"]
    process, url, lines = start(args, env={"MILES_API_TOKEN": "tok"})
    tail = ""
    try:
        with ControlPlaneClient(url, token="tok") as client:
            assert client.health()
            # The trainer's registration checks: rewards, plug-in modules, generate functions.
            for config, words in [({"rm_type": "no_such_reward"}, "unknown rm_type"),
                                  ({"custom_rm_path": "os.system"}, "is outside the modules"),
                                  ({"custom_generate_function_path": "miles.utils.plugins.plugin_module"},
                                   "must be an async function")]:
                with pytest.raises(ControlPlaneError) as err:
                    client.register("b", config={"data": str(data_root / "data" / "train.jsonl"), **config})
                assert err.value.status_code == 400 and words in err.value.detail, (config, err.value)
            assert client.register("a", config={"data": str(data_root / "data" / "train.jsonl")}) == 0
            status = client.status("a")
            assert (status.state, status.rank, status.rollout_batch_size) == (AdapterState.PENDING, 4, 2)
            assert status.num_step == 2  # the dataset was read: 4 rows, 2 groups a step
            # The one slot is held: b waits in the queue, and c finds it full (--multi-lora-queue-size 1).
            assert client.register("b", config={"data": str(data_root / "data" / "train.jsonl")}) is None
            assert (client.status("b").state, client.status("b").queue_position) == (AdapterState.QUEUED, 1)
            with pytest.raises(ControlPlaneError) as err:
                client.register("c", config={"data": str(data_root / "data" / "train.jsonl")})
            assert err.value.status_code == 409 and "registration queue is full" in err.value.detail
        with ControlPlaneClient(url) as anonymous, pytest.raises(ControlPlaneError) as err:
            anonymous.list()
        assert err.value.status_code == 401
    finally:
        if process.poll() is None:
            tail = stop(process, sig, lines)
    assert "Stopping the control plane" in tail


def test_refuses_to_start_without_slots() -> None:
    result = subprocess.run([sys.executable, "-m", "miles.main.control_plane", "--multi-lora-api-port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "set --multi-lora-n-adapters" in result.stderr
