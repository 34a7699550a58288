"""The controller as a named Ray actor: HTTP registrations show up in its snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.controller.actor import (
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    create_multilora_controller,
    destroy_multi_lora_controller,
    get_multi_lora_controller,
)
from miles.controller.client import ControlPlaneClient
from miles.controller.registry import AdapterNotFoundError, AdapterValidationError
from miles.utils.arguments import config_from_dict
from miles.utils.types import AdapterState, MultiLoRASnapshot


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

        assert ray.get(handle.record_weight_update.remote(["a"])) == {"a": 1}
        ray.get(handle.set_adapter_step.remote("a", 4))
        ray.get(handle.record_batch_adapters.remote(0, {"a": 2}, ["a"]))
        assert ray.get(handle.mark_batch_trained.remote(0)) == ["a"]
        assert ray.get(handle.adapter_step.remote("a")) == 5
        assert ray.get(handle.adapter_status.remote("a")).state is AdapterState.ACTIVE

        # Registry errors keep their type through Ray.
        with pytest.raises(AdapterValidationError, match="Invalid adapter name"):
            ray.get(handle.register_adapter.remote("a::b", {"data": "x.jsonl"}))
        with pytest.raises(AdapterNotFoundError):
            ray.get(handle.adapter_step.remote("ghost"))

        assert ray.get(handle.deregister_adapter.remote("a")) is AdapterState.RETIRING
        assert ray.get(handle.retire_adapters.remote()) == ["a"]
        assert ray.get(handle.free_slot.remote("a")) == 0
        assert ray.get(handle.snapshot.remote()).all_adapters_cleaned_up
    finally:
        destroy_multi_lora_controller()
    with pytest.raises(ValueError):
        ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
