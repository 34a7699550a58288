"""End-to-end: the multi-LoRA trainer as users run it (real Ray, router, engines, model).

Each test starts `python -m miles.main.train_multi_lora_async` as a subprocess on a tiny
random model and drives it over the control plane's HTTP API.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from miles.backends.common.checkpoint import latest_checkpoint
from miles.controller.client import ControlPlaneClient
from miles.rollout.engines.router import Router
from miles.utils.types import AdapterState, engine_lora_name
from tests.helpers.driver_harness import DriverProcess, descendant_pids, tiny_run_flags
from tests.helpers.service_scenario import TRAINER, run_service_lifecycle, write_scenario_data

pytestmark = pytest.mark.slow


@pytest.fixture
def workdir(tmp_path):
    write_scenario_data(tmp_path)
    return tmp_path


def test_service_mode_lifecycle_over_http(tiny_model_dir, workdir):
    run_service_lifecycle(tiny_model_dir, workdir)


def test_an_adapter_whose_reward_fails_every_group_fails_alone(tiny_model_dir, workdir):
    """`bad` asks for the dict reward `dapo` without --reward-key, so its reward raises on every
    group: after 4 in a row it is FAILED with that error in its status (one log line when its
    failures start, one when it is given up), its slot is freed for a fixed registration of the
    name, and `good` beside it trains on throughout."""
    save = workdir / "save"
    flags = tiny_run_flags(tiny_model_dir, save, n_adapters=2) + ["--multi-lora-max-consecutive-failures", "4"]
    driver = DriverProcess(TRAINER, flags, workdir / "trainer.log")
    try:
        client = ControlPlaneClient(driver.wait_for_api_url())
        add = str(workdir / "data" / "add.jsonl")
        client.register("good", config={"data": add})
        client.register("bad", config={"data": add, "rm_type": "dapo"})
        client.wait_for_state("bad", AdapterState.FAILED, timeout=240)
        failed = client.status("bad")
        assert failed.last_error is not None and failed.last_error.groups >= 4
        assert "--reward-key" in failed.last_error.message and failed.version is None
        step = client.status("good").step
        driver.wait_until(lambda: client.status("good").step >= step + 2, 240, "good to step on after bad failed")
        log = driver.log_path.read_text()
        assert log.count("Adapter 'bad': a prompt group failed") == 1 and "Prompt group failed" not in log
        assert log.count("Adapter 'bad': giving up on it") == 1

        assert client.register("bad", config={"data": add}) == failed.slot  # fixed: the default reward
        client.wait_for_state("bad", AdapterState.ACTIVE, timeout=240)
        assert client.status("bad").last_error is None
        assert driver.terminate() == 0, driver.log_tail()
        assert latest_checkpoint(save / "adapters" / "good") is not None
    finally:
        driver.kill()


def test_non_service_mode_exits_when_adapters_finish(tiny_model_dir, workdir):
    save = workdir / "save"
    adapter_yaml = workdir / "add.yaml"
    adapter_yaml.write_text(f"data: {workdir / 'data' / 'add.jsonl'}\nnum_step: 2\n")
    flags = tiny_run_flags(tiny_model_dir, save, n_adapters=1)
    flags += ["--multi-lora-disable-service-mode", "--multi-lora-adapters", str(adapter_yaml),
              "--actor-num-cpus-per-worker", "2"]
    driver = DriverProcess(TRAINER, flags, workdir / "trainer.log")
    try:
        assert driver.wait(timeout=400) == 0, driver.log_tail()
        log = driver.log_path.read_text()
        assert "No adapters; exiting." in log
        assert "Started 1 torch train rank(s); torch threads per rank: 2" in log  # two CPUs reserved, two threads
        checkpoint = latest_checkpoint(save / "adapters" / "add")
        assert checkpoint is not None and checkpoint.name == "step_2"
        assert (save / "metrics.jsonl").exists()
    finally:
        driver.kill()


def _server_pids(root_pid: int) -> list[int]:
    """Builtin inference servers among the descendants of `root_pid` (this trainer's own)."""
    found = []
    for pid in descendant_pids(root_pid):
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if b"miles.rollout.engines.builtin_server" in cmdline:
            found.append(pid)
    return found


PUSH_LINE = re.compile(r"Pushed (\d+) adapter\(s\), (\d+) bytes per engine, in ([0-9.]+)s")
ACTOR_RESTORED = re.compile(r"Engine (\d+) was restarted by Ray; its server is back at (\S+) behind router (\S+) ")


def _parent_pid(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def _loaded_loras(url: str) -> set[str]:
    return set(httpx.get(url + "/get_server_info", timeout=10, trust_env=False).json()["loaded_loras"])


@pytest.mark.parametrize("mode", ["in_place", "versioned"])
def test_update_modes_survive_a_killed_server_mid_rollout(tiny_model_dir, workdir, mode):
    """Two engines; a server is SIGKILLed while both adapters generate: its engine restarts it
    with every slot, the groups it held are regenerated, and every adapter keeps stepping.
    Then the other engine's actor process is SIGKILLed: Ray restarts the actor, the fleet
    starts its server with every live slot and puts it back behind the router, and every
    adapter keeps stepping."""
    flags = tiny_run_flags(tiny_model_dir, workdir / "save", n_adapters=2)
    flags[flags.index("--rollout-num-engines") + 1] = "2"
    flags += ["--engine-lora-update", mode]
    driver = DriverProcess(TRAINER, flags, workdir / "trainer.log")
    try:
        url = driver.wait_for_api_url()
        client = ControlPlaneClient(url)
        client.register("a", config={"data": str(workdir / "data" / "add.jsonl")})
        client.register("b", config={"data": str(workdir / "data" / "sub.jsonl")})
        driver.wait_until(lambda: min(client.status(n).step for n in "ab") >= 1, 240, "both adapters to step")
        servers = driver.wait_until(lambda: _server_pids(driver.proc.pid), 30, "the engine servers")
        assert len(servers) == 2
        steps = {n: client.status(n).step for n in "ab"}
        os.kill(servers[0], signal.SIGKILL)
        driver.wait_until(lambda: "is back at" in driver.log_path.read_text(), 240, "the server to be restarted")
        driver.wait_until(lambda: all(client.status(n).step >= steps[n] + 1 for n in "ab"), 240,
                   "both adapters to keep stepping after the kill")

        # The other engine's actor process dies (its server goes with it): Ray restarts the actor.
        steps = {n: client.status(n).step for n in "ab"}
        os.kill(_parent_pid(servers[1]), signal.SIGKILL)
        restored = driver.wait_until(lambda: ACTOR_RESTORED.search(driver.log_path.read_text()), 240,
                              "the fleet to restore the restarted engine actor")
        _, engine_url, router_url = restored.groups()
        workers = set(asyncio.run(Router(router_url, None).workers()))
        assert engine_url in workers and len(workers) == 2, workers  # the dead server was taken out
        peer = (workers - {engine_url}).pop()

        def serves_current_versions() -> bool:
            names = {engine_lora_name(s.slot, s.version, mode) for s in (client.status(n) for n in "ab")}
            loaded = _loaded_loras(engine_url)
            return names <= loaded and loaded == _loaded_loras(peer)

        driver.wait_until(serves_current_versions, 30, "the restored engine to serve what its peer serves")
        driver.wait_until(lambda: all(client.status(n).step >= steps[n] + 1 for n in "ab"), 240,
                          "both adapters to keep stepping after the actor restart")
        # A retired adapter leaves the engines; the other one keeps training.
        client.deregister("a")
        client.wait_for_state("a", AdapterState.COMPLETED, timeout=240)
        step_b = client.status("b").step
        driver.wait_until(lambda: client.status("b").step > step_b, 240, "b to keep stepping after a left")
        assert driver.terminate() == 0, driver.log_tail()

        log = driver.log_path.read_text()
        assert "rollout producer died" not in log
        if mode == "in_place":  # one group per engine; the restarted server's is rebuilt before its next push
            assert log.count("Weights-update group miles_lora_update_") >= 3
        pushes = [(int(n), int(b), float(s)) for n, b, s in PUSH_LINE.findall(log)]
        assert pushes and all(b > 0 for _, b, _ in pushes)
        per_adapter = [b / n for n, b, _ in pushes]
        print(f"\n{mode}: {len(pushes)} pushes, {per_adapter[0]:.0f} bytes per adapter per engine, "
              f"median push {sorted(s for _, _, s in pushes)[len(pushes) // 2] * 1000:.1f} ms")
    finally:
        driver.kill()
