"""Paging idle client-driven adapters in the registry: PAGED holds no slot, keeps the name, step
and resume point, and a page-in takes any free slot (or is refused, retryably, with none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.controller.registry import (
    AdapterAlreadyRegisteredError,
    AdapterRegistry,
    AdapterValidationError,
    NoFreeSlotError,
    NoSlotToPageInError,
)
from miles.utils.types import AdapterState, ClientModelConfig
from tests.helpers.controller_fakes import make_config

MODEL = "s-1.train.0"
PAGED_DIR = "/runs/adapters/s-1.train.0/paged"


def client_config(model_id: str = "s-1:train:0") -> ClientModelConfig:
    name = model_id.replace(":", ".")
    return ClientModelConfig(model_id=model_id, session_id=model_id.split(":")[0], base_model="tiny", rank=4,
                             alpha=8.0, seed=3, save=Path("/runs") / "adapters" / name)


def active_client(n_slots: int = 2) -> AdapterRegistry:
    registry = AdapterRegistry(n_slots=n_slots)
    assert registry.register(MODEL, client_config()) == 0
    registry.activate_clients([MODEL])
    registry.record_client_step(MODEL)
    return registry


def test_a_paged_model_frees_its_slot_and_keeps_its_name_step_and_resume_point() -> None:
    registry = active_client()
    assert registry.page_out(MODEL, PAGED_DIR) == 0
    assert registry.state(MODEL) is AdapterState.PAGED and registry.free_slots == [0, 1]
    assert registry.paged_count == 1 and registry.live_slots() == {}
    status = registry.status(MODEL)
    assert (status.slot, status.version, status.step, status.model_id) == (None, None, 1, "s-1:train:0")
    assert MODEL not in registry.snapshot().clients  # the trainer neither loads nor runs it
    with pytest.raises(AdapterAlreadyRegisteredError, match="PAGED"):
        registry.register(MODEL, client_config())
    assert registry.page_out(MODEL, PAGED_DIR) == -1  # only an ACTIVE one pages out

    # Another model takes the freed slot; the paged one comes back in the next free one.
    assert registry.register("s-1.train.1", client_config("s-1:train:1")) == 0
    assert registry.page_in(MODEL) == 1
    run = registry.snapshot().clients[MODEL]
    assert (run.state, run.slot, run.step, run.resume_from, run.resume_step) == (
        AdapterState.PENDING, 1, 1, PAGED_DIR, 1)
    assert registry.paged_count == 0
    with pytest.raises(AdapterValidationError, match="not PAGED"):
        registry.page_in(MODEL)


def test_a_page_in_with_every_slot_held_is_refused_retryably() -> None:
    registry = active_client(n_slots=1)
    registry.page_out(MODEL, PAGED_DIR)
    assert registry.register("rl", make_config("rl")) == 0
    with pytest.raises(NoSlotToPageInError, match="retry shortly") as refused:
        registry.page_in(MODEL)
    assert isinstance(refused.value, NoFreeSlotError)
    assert registry.state(MODEL) is AdapterState.PAGED


def test_a_paged_out_slot_goes_to_the_head_of_the_registration_queue() -> None:
    registry = active_client(n_slots=1)
    assert registry.register("rl", make_config("rl")) is None  # QUEUED behind the model
    registry.page_out(MODEL, PAGED_DIR)
    assert registry.state("rl") is AdapterState.PENDING and registry.live_slots() == {"rl": 0}


def test_a_paged_model_survives_a_restored_registry_and_unloads_without_a_slot() -> None:
    registry = active_client()
    registry.page_out(MODEL, PAGED_DIR)
    restored = AdapterRegistry.from_state(registry.export_state(), n_slots=1)  # its old slot may be gone
    restored.requeue_for_new_trainer()
    assert restored.state(MODEL) is AdapterState.PAGED and restored.free_slots == [0]
    assert restored.statuses() == registry.statuses()
    assert restored.page_in(MODEL) == 0
    assert restored.snapshot().clients[MODEL].resume_from == PAGED_DIR

    registry.deregister(MODEL)  # unload_model while PAGED: nothing to clean up
    assert registry.state(MODEL) is AdapterState.COMPLETED and registry.free_slots == [0, 1]
