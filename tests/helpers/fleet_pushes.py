"""Pushes to an engine fleet of this process through the trainer's one push path, `EnginePusher`.

    pusher = fleet_pusher(fleet, mode="in_place")
    await pusher.push([(slot, version, lora_export(config, tensors))])

`FleetManager` stands in for the rollout manager (the fleet's own methods, called in this
process) and `LocalSender` for the exporting train rank: it joins each engine's
weights-update group at rank 0 and broadcasts from this process, so in-place pushes need no
train actor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from miles.backends.base import LoraExport
from miles.lora import weight_sync
from miles.main.engine_push import EnginePusher
from miles.rollout.engines.fleet import EngineFleet


class _Call:
    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


class FleetManager:
    """The rollout-manager methods a pusher calls, over a fleet in this process."""

    def __init__(self, fleet: EngineFleet, versions_in_flight: Mapping[int, int] | None = None):
        self.update_group_layout = _Call(fleet.update_group_layout)
        self.versions_in_flight = _Call(lambda: dict(versions_in_flight or {}))
        self.record_push = _Call(fleet.record_push)
        self.forget_slot = _Call(fleet.forget_slot)


class LocalSender:
    """The sender side of weights-update groups, in this process (a train rank's part of a push)."""

    def __init__(self) -> None:
        self.stores: dict[int, Any] = {}
        self.groups: dict[str, Any] = {}

    async def update_group_endpoint(self) -> tuple[str, int]:
        store = weight_sync.listening_store("127.0.0.1")
        self.stores[store.port] = store
        return "127.0.0.1", store.port

    async def join_update_group(self, spec: weight_sync.UpdateGroupSpec) -> None:
        store = self.stores.pop(spec.master_port, None)
        self.groups[spec.group_name] = await asyncio.to_thread(weight_sync.join_update_group, spec, 0, store)

    async def leave_update_group(self, group_name: str | None = None) -> None:
        for name in list(self.groups) if group_name is None else [group_name]:
            group = self.groups.pop(name, None)
            if group is not None:
                weight_sync.leave_update_group(group)

    async def broadcast_adapter(self, export: LoraExport, group_names: Sequence[str], *,
                                bucketed: bool = False) -> dict[str, str]:
        tensors = ray.get(export.tensors) if isinstance(export.tensors, ray.ObjectRef) else export.tensors
        for name in group_names:
            await asyncio.to_thread(weight_sync.broadcast_tensors, self.groups[name], tensors, bucketed=bucketed)
        return {}


def fleet_pusher(fleet: EngineFleet, mode: str, versions_in_flight: Mapping[int, int] | None = None) -> EnginePusher:
    return EnginePusher(LocalSender(), fleet.engines, FleetManager(fleet, versions_in_flight), mode=mode)


def lora_export(peft_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> LoraExport:
    """An export as a train rank makes one: the tensors in the object store, with their layout."""
    names, dtypes, shapes = weight_sync.tensor_metadata(tensors)
    return LoraExport(peft_config=peft_config, tensors=ray.put(tensors), names=names, dtypes=dtypes, shapes=shapes,
                      nbytes=sum(t.numel() * t.element_size() for t in tensors.values()))
