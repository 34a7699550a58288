"""The controller as a named Ray actor: HTTP registrations show up in its snapshot, and a
killed actor comes back with its registry and port."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from miles.controller.actor import (
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    create_multilora_controller,
    destroy_multi_lora_controller,
    get_multi_lora_controller,
)
from miles.controller.client import ControlPlaneClient
from miles.controller.registry import AdapterAlreadyRegisteredError, AdapterNotFoundError, AdapterValidationError
from miles.utils.arguments import config_from_dict
from miles.utils.types import AdapterState, MultiLoRASnapshot
from miles.utils.types.lifecycle_ops import (
    FreeSlots,
    MarkBatchTrained,
    RecordBatch,
    RecordWeightUpdate,
    RetireAdapters,
    SetStep,
)
from tests.helpers.controller_fakes import ROLLOUT_HOOKS
from tests.helpers.waiting import call_actor, wait_until


def test_named_actor_serves_http_and_snapshots(ray_session, data_root: Path) -> None:
    ray = ray_session
    cfg = config_from_dict(dict(
        multi_lora_n_adapters=2, multi_lora_api_port=0, save=str(data_root / "save"), rm_type="math",
        rollout_batch_size=2, n_samples_per_prompt=2, multi_lora_allowed_roots=[str(data_root)],
    ))
    controller = create_multilora_controller(cfg, router_url=None)
    try:
        assert ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)._actor_id == controller._actor_id
        host, port = ray.get([controller.http_host.remote(), controller.api_port.remote()])
        assert host == "127.0.0.1" and port > 0
        with ControlPlaneClient(f"http://{host}:{port}") as client:
            assert client.register("a", config={"data": str(data_root / "data" / "train.jsonl")}) == 0

        handle = get_multi_lora_controller()
        snapshot = ray.get(handle.snapshot.remote())
        assert isinstance(snapshot, MultiLoRASnapshot)
        assert set(snapshot.pending) == {"a"} and snapshot.pending["a"].slot == 0
        assert snapshot.pending["a"].config.rollout_batch_size == 2

        assert ray.get(handle.apply.remote(RecordWeightUpdate(["a"]))).active["a"].version == 1
        assert ray.get(handle.apply.remote(SetStep("a", 4))).active["a"].step == 4
        ray.get(handle.apply.remote(RecordBatch(0, {"a": 2}, ["a"])))
        assert ray.get(handle.apply.remote(MarkBatchTrained(0))).active["a"].step == 5
        assert ray.get(handle.adapter_step.remote("a")) == 5
        assert ray.get(handle.adapter_status.remote("a")).state is AdapterState.ACTIVE

        # Registry errors keep their type through Ray.
        with pytest.raises(AdapterValidationError, match="Invalid adapter name"):
            ray.get(handle.register_adapter.remote("a::b", {"data": "x.jsonl"}))
        with pytest.raises(AdapterNotFoundError):
            ray.get(handle.adapter_step.remote("ghost"))

        assert ray.get(handle.deregister_adapter.remote("a")) is AdapterState.RETIRING
        assert ray.get(handle.apply.remote(RetireAdapters())).cleanup == {"a"}
        assert ray.get(handle.apply.remote(FreeSlots(["a"]))).completed == {"a"}
        assert ray.get(handle.snapshot.remote()).all_adapters_cleaned_up
    finally:
        destroy_multi_lora_controller()
    with pytest.raises(ValueError):
        ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)


def wait_for_health(url: str, timeout: float = 60.0) -> None:
    """Until GET /health answers 200 at `url`."""
    wait_until(lambda: httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200, timeout,
               f"{url}/health to answer", retry_on=(httpx.TransportError,))


def test_killed_controller_comes_back_with_its_registry_and_port(ray_session, data_root: Path) -> None:
    """Ray restarts the killed actor; it reloads the registry file and serves the same port.
    Then a new controller over the same run directory (a restarted trainer) resumes it too."""
    ray = ray_session
    cfg = config_from_dict(dict(
        multi_lora_n_adapters=3, multi_lora_api_port=0, save=str(data_root / "save"), rm_type="math",
        rollout_batch_size=2, n_samples_per_prompt=2, multi_lora_allowed_roots=[str(data_root)],
    ))
    data = str(data_root / "data" / "train.jsonl")
    controller = create_multilora_controller(cfg, router_url=None, hooks=ROLLOUT_HOOKS)
    try:
        port = ray.get(controller.api_port.remote())
        url = f"http://127.0.0.1:{port}"
        with ControlPlaneClient(url) as client:
            client.register("a", config={"data": data, "num_step": 50})
            assert ray.get(controller.register_adapter.remote("b", {"data": data, "num_step": 50})) == 1
            ray.get(controller.register_adapter.remote("c", {"data": data}))
            ray.get(controller.apply.remote(RecordWeightUpdate(["a", "b"])))
            ray.get(controller.apply.remote(RecordBatch(0, {"a": 2, "b": 1}, ["a"])))
            ray.get(controller.apply.remote(MarkBatchTrained(0)))
            ray.get(controller.apply.remote(RecordBatch(1, {"a": 2}, ["a"])))
            ray.get(controller.set_router_url.remote("http://127.0.0.1:9"))
            client.deregister("c")
            before = ray.get(controller.snapshot.remote())
            listed = client.list()

        pid = ray.get(controller.__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(controller, no_restart=False)
        # ray.kill returns before the process is gone: a call right after it may still reach it.
        # Wait for the restarted process (calls in between are retried on it).
        wait_until(lambda: call_actor(controller.__ray_call__, lambda self: os.getpid(), timeout=60) != pid, 60,
                   "Ray to restart the killed controller")
        after = ray.get(controller.snapshot.remote(), timeout=60)
        assert after == before
        assert after.active["a"].step == 1 and after.active["b"].accumulated_groups == 1
        assert {n: r.registration_id for n, r in after.live.items()} == \
               {n: r.registration_id for n, r in before.live.items()}
        wait_for_health(url)
        assert ray.get(controller.api_port.remote()) == port
        with ControlPlaneClient(url) as client:
            assert client.list() == listed
        # The recorded batch commits after the restart, and pushes continue the versions.
        assert ray.get(controller.apply.remote(MarkBatchTrained(1))).active["a"].step == 2
        assert ray.get(controller.apply.remote(RecordWeightUpdate(["a"]))).active["a"].version == 2
        before_trainer_restart = ray.get(controller.snapshot.remote())
    finally:
        destroy_multi_lora_controller()

    controller = create_multilora_controller(cfg, router_url=None, hooks=ROLLOUT_HOOKS)
    try:
        assert ray.get(controller.snapshot.remote()) == before_trainer_restart
        with pytest.raises(AdapterAlreadyRegisteredError, match="already registered"):
            ray.get(controller.register_adapter.remote("a", {"data": data}, exist_ok=False))
        assert ray.get(controller.register_adapter.remote("a", {"data": data})) == 0  # the trainer's re-registration
        assert ray.get(controller.snapshot.remote()) == before_trainer_restart
    finally:
        destroy_multi_lora_controller()
