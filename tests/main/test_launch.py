"""What the launcher does with the flags: the controller's registration hooks (the
dataset rows that fit `--rollout-max-prompt-len`, so `num_step` is derived after the
filter as in Miles), a real `trainer_run` on the session's Ray (control plane, engine
behind the router, train ranks, Miles' W&B flags, and everything stopped on the way out),
the Ray instance a driver without RAY_ADDRESS starts, and a stop cancelling a waiting actor call."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from miles.controller.backend import MultiLoRABackend
from miles.main import launch as launch_module
from miles.main.registration_checks import controller_hooks
from miles.recipes.tiny_model import build_char_tokenizer
from miles.rollout.data_source import DatasetCheck
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.arguments import parse_args
from tests.helpers.waiting import wait_until, wait_until_async


@pytest.mark.parametrize("max_len, num_step", [(None, 5), (4, 3)])
async def test_num_step_is_counted_after_the_max_prompt_len_filter(tmp_path, max_len, num_step):
    tokenizer_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * n, "label": str(n)}) + "\n" for n in (2, 7, 3, 9, 4)))
    argv = ["--hf-checkpoint", str(tokenizer_dir), "--multi-lora-n-adapters", "2", "--rm-type", "math",
            "--save", str(tmp_path / "save")]
    cfg = parse_args(argv + ([] if max_len is None else ["--rollout-max-prompt-len", str(max_len)]))
    hooks = controller_hooks(cfg)
    assert hooks.validate_dataset == DatasetCheck.from_config(cfg)
    backend = MultiLoRABackend(cfg.multi_lora_n_adapters, AdapterDefaults.from_config(cfg), None, hooks)
    await backend.register("a", config={"data": str(data), "label_key": "label", "rollout_batch_size": 1,
                                        "n_samples_per_prompt": 2})
    assert backend.registry.snapshot().pending["a"].config.num_step == num_step


class RecordingWandb:
    """Stands in for the `wandb` module: records what the run's logger asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.util = type("util", (), {"generate_id": staticmethod(lambda: "r4nd0m")})

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, kwargs))


def _refuses(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2.0, trust_env=False)
    except httpx.TransportError:
        return True
    return False


def _dead(actor) -> bool:
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(actor.__ray_ready__.remote(), timeout=10)
    except RayActorError:
        return True
    return False


async def test_trainer_run_starts_what_the_flags_ask_for_and_stops_all_of_it(
        ray_session, tiny_model_dir, tmp_path, monkeypatch):
    """The real `trainer_run` on this session's Ray: the controller serves on the port the OS
    gave (--multi-lora-api-port 0) and counts rows after --rollout-max-prompt-len, one engine
    serves behind the router, --actor-num-workers train ranks start, the W&B flags reach
    wandb; on the way out every server and actor it started is stopped."""
    import ray

    from miles.controller.client import ControlPlaneClient
    from miles.rollout.engines.router import Router

    wandb = RecordingWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)  # the logger imports it at start
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * n, "label": str(n)}) + "\n" for n in (2, 7, 3, 9, 4)))
    cfg = parse_args([
        "--hf-checkpoint", str(tiny_model_dir), "--multi-lora-n-adapters", "2", "--multi-lora-api-port", "0",
        "--multi-lora-allowed-roots", str(tmp_path), "--rollout-max-prompt-len", "4", "--rollout-num-engines", "1",
        "--rm-type", "math",
        "--actor-num-workers", "2", "--save", str(tmp_path / "save"), "--run-dir", str(tmp_path / "run"),
        "--use-wandb", "--wandb-group", "g", "--disable-wandb-random-suffix",
    ])
    loop = asyncio.get_running_loop()
    try:
        async with launch_module.trainer_run(cfg) as run:
            c = run.components
            api = f"http://127.0.0.1:{await c.controller.api_port.remote()}"
            ControlPlaneClient(api).register("a", config={"data": str(data), "rollout_batch_size": 1})
            snapshot = await c.controller.snapshot.remote()
            assert snapshot.pending["a"].config.num_step == 3  # rows of 2, 3 and 4 tokens fit in 4
            engines = await c.rollout_manager.engines.remote()
            assert len(engines) == 1
            engine_url = await engines[0].url.remote()
            router_url = await c.rollout_manager.get_router_address.remote()
            assert await Router(router_url, None).workers() == [engine_url]
            assert httpx.get(engine_url + "/health", timeout=10, trust_env=False).status_code == 200
            ranks = list(c.backend.actors)
            assert len(ranks) == 2
            assert wandb.calls == [("init", {"project": "miles-multi-lora", "group": "g", "name": "g",
                                             "dir": str(cfg.resolved_run_dir)})]
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # trainer_run's stop handlers, on the test's loop
            loop.remove_signal_handler(signum)
    assert wandb.calls[-1][0] == "finish"
    for url in (api, engine_url, router_url):
        wait_until(lambda url=url: _refuses(url), 30, f"{url} to stop serving")
    for rank in ranks:
        wait_until(lambda rank=rank: _dead(rank), 30, "a train rank to be gone")
    # The controller and rollout manager actors live on with the driver, as in a run (they go
    # with its Ray); here the session's Ray outlives the test, so they are taken down by hand.
    for actor in (c.controller, c.rollout_manager):
        ray.kill(actor)


def test_a_driver_without_ray_address_starts_its_own_ray_beside_another(ray_session):
    """A cluster that `ray start` left on the machine (here: this session's, named in Ray's
    current-cluster file) is not joined without RAY_ADDRESS: joining it with the driver's
    CPU count fails, and it may be anyone's."""
    session = ray_session.get_runtime_context().gcs_address
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths must stay short
    try:
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text(session)
        code = ("import ray; from miles.main.launch import init_ray; from miles.utils.arguments import parse_args; "
                "init_ray(parse_args([])); print(ray.get_runtime_context().gcs_address); ray.shutdown()")
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": str(temp)}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] != session


async def test_a_stop_cancels_a_waiting_actor_call_at_once(ray_session):
    """`unless_stopped` over a Ray call: the stop answers None within the 2 s a stop may take,
    and the async actor's method, which would have waited on, is cancelled where it waits."""

    @ray_session.remote
    class Waiter:
        def __init__(self) -> None:
            self.state = "idle"

        async def wait_for_groups(self) -> str:
            self.state = "waiting"
            try:
                await asyncio.Event().wait()  # groups that never come
            except asyncio.CancelledError:
                self.state = "cancelled"
                raise
            return "batch"

        async def get_state(self) -> str:
            return self.state

    waiter = Waiter.remote()
    stop = asyncio.Event()
    call = asyncio.ensure_future(launch_module.unless_stopped(waiter.wait_for_groups.remote(), stop))
    await wait_until_async(lambda: _is(waiter.get_state.remote(), "waiting"), 60, "the actor call to wait")
    stop.set()
    assert await asyncio.wait_for(call, timeout=2.0) is None
    await wait_until_async(lambda: _is(waiter.get_state.remote(), "cancelled"), 10, "the actor's method cancelled")
    assert await launch_module.unless_stopped(waiter.get_state.remote(), asyncio.Event()) == "cancelled"
    ray_session.kill(waiter)


async def _is(answer, expected: str) -> bool:
    return await answer == expected
