"""End-to-end: the single-policy trainer, and a run submitted with `ray job submit`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from miles.backends.common.checkpoint import latest_checkpoint
from miles.utils.types import DataPosition
from tests.helpers.driver_harness import DriverProcess, tiny_run_flags, write_arithmetic_dataset
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

VENV_BIN = Path(sys.executable).parent


def test_train_async_runs_rollouts_and_saves(tiny_model_dir, tmp_path):
    data = write_arithmetic_dataset(tmp_path / "add.jsonl", 100)
    save = tmp_path / "save"
    flags = tiny_run_flags(tiny_model_dir, save, n_adapters=1)
    flags += ["--prompt-data", str(data), "--num-rollout", "4", "--save-interval", "2",
              # Every batch waits for its whole rollout_batch_size (one step per rollout): the
              # harness's short wait ships a part batch when the engine is slow (a loaded machine
              # gave 3 steps in 4 rollouts once).
              "--multi-lora-max-coalesce-wait-s", "120",
              "--dump-details", str(tmp_path / "dump"), "--dump-details-keep", "2"]
    driver = DriverProcess("miles.main.train_async", flags, tmp_path / "train_async.log")
    try:
        assert driver.wait(timeout=400) == 0, driver.log_tail()
    finally:
        driver.kill()
    checkpoints = sorted(p.name for p in (save / "adapters" / "policy" / "checkpoints").iterdir())
    assert checkpoints == ["step_2", "step_4"]
    state = json.loads((save / "adapters" / "policy" / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["step"] == 4
    assert DataPosition.from_dict(state["data_position"]).index >= 4 * 2  # 100 rows: still epoch 0
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["rollout_id"] for r in records if r["kind"] == "loop") == [0, 1, 2, 3]
    assert sorted(r["step"] for r in records if r["kind"] == "adapter" and r["adapter"] == "policy") == [1, 2, 3, 4]
    assert [r["batch"] for r in records if r["kind"] == "loop"] == [{"policy": {"groups": 2, "samples": 4}}] * 4
    assert all(r["metrics"]["perf/samples_per_s"] > 0 for r in records if r["kind"] == "adapter")
    # --dump-details: the last two rollouts of the policy, one file each.
    dumped = sorted((tmp_path / "dump" / "rollouts" / "policy").iterdir())
    assert [p.name for p in dumped] == ["rollout_00000002.json", "rollout_00000003.json"]
    document = json.loads(dumped[-1].read_text())
    assert (document["adapter"], document["rollout_id"], document["step"]) == ("policy", 3, 4)
    assert len(document["groups"]) == 2
    specials = {"<pad>", "<s>", "</s>", "<unk>"}
    for group in document["groups"]:
        assert group["prompt"] and group["version"] is not None
        assert [s["index"] for s in group["samples"]] == [0, 1]
        for sample in group["samples"]:
            assert sample["advantage"] is not None and sample["status"] in ("completed", "truncated")
            assert len(sample["tokens"]) == len(sample["logprobs"]) >= 1
            assert "".join(t for t in sample["tokens"] if t not in specials) == sample["response"]


def test_train_async_requires_prompt_data(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "miles.main.train_async"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--prompt-data is required" in proc.stderr


JOB_API_LINE = re.compile(r"RAY_API_SERVER_ADDRESS='(http://[^']+)'")
"""How `ray start --head` tells where its job API (the dashboard) listens."""


def finished(status: JobStatus) -> JobStatus | None:
    return status if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED) else None


def ray_cli(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def stop_process_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue


class JobAgentNotReady(Exception):
    """`ray job submit` could not reach the job agent yet."""


def test_ray_job_submit_to_a_local_head(tiny_model_dir, tmp_path):
    """`ray start --head` on loopback, then `ray job submit` of a tiny non-service run."""
    data = write_arithmetic_dataset(tmp_path / "add.jsonl", 100)
    adapter_yaml = tmp_path / "add.yaml"
    adapter_yaml.write_text(f"data: {data}\nnum_step: 2\n")
    save = tmp_path / "save"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    head_log = tmp_path / "ray_head.log"
    # Ray's default ports would clash with any other Ray cluster on this machine: every port is
    # 0 (Ray binds a free one; the job API's address is read back from the head's output) but
    # the Ray client server's, which Ray refuses to put on 0 (and would put on 10001). For it
    # the test holds a free port with SO_REUSEPORT: no other process can take it, and the
    # client server, a gRPC server (which binds with SO_REUSEPORT), still can.
    client_port = socket.socket()
    client_port.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    client_port.bind(("127.0.0.1", 0))
    # --block keeps the head's processes in one process group that this test owns, so it
    # is stopped without `ray stop`, which would kill every Ray cluster on the machine.
    with head_log.open("w") as log:
        head = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--dashboard-host", "127.0.0.1", "--num-cpus", "4", "--temp-dir", temp_dir, "--disable-usage-stats",
             *(arg for flag in ("--port", "--dashboard-port", "--dashboard-agent-listen-port",
                                "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")
               for arg in (flag, "0")),
             "--ray-client-server-port", str(client_port.getsockname()[1])],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def head_alive() -> bool:
        return head.poll() is None

    try:
        address = wait_until(lambda: JOB_API_LINE.search(head_log.read_text(errors="replace")), 180,
                             "the Ray head to print its job API address", alive=head_alive).group(1)
        flags = tiny_run_flags(tiny_model_dir, save, n_adapters=1)
        flags += ["--multi-lora-disable-service-mode", "--multi-lora-adapters", str(adapter_yaml)]
        entrypoint = " ".join([sys.executable, "-m", "miles.main.train_multi_lora_async", *flags])

        def submit() -> subprocess.CompletedProcess:
            # --no-wait, then the job's status: tailing its logs over the dashboard's
            # websocket can drop on a busy machine although the job runs on.
            submitted = ray_cli("job", "submit", "--address", address, "--no-wait", "--submission-id", "tiny-run",
                                "--", *entrypoint.split(), env=env, timeout=120)
            if submitted.returncode != 0 and ("Connection" in submitted.stderr or "try again" in submitted.stderr):
                raise JobAgentNotReady(submitted.stderr[-2000:])
            return submitted

        # The job agent comes up a little after the head prints its address.
        submitted = wait_until(submit, 180, "the job agent to take the job", poll_s=3, retry_on=(JobAgentNotReady,),
                               alive=head_alive)
        assert submitted.returncode == 0, submitted.stdout[-4000:] + submitted.stderr[-4000:]
        client = JobSubmissionClient(address)
        status = wait_until(lambda: finished(client.get_job_status("tiny-run")), 600, "the job to finish", poll_s=0.5,
                            alive=head_alive)
        assert status == JobStatus.SUCCEEDED, client.get_job_logs("tiny-run")[-4000:]
    finally:
        stop_process_group(head)
        client_port.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
    checkpoint = latest_checkpoint(save / "adapters" / "add")
    assert checkpoint is not None and checkpoint.name == "step_2"
