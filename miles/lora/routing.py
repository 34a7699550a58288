"""Which `SlotBatch` each multi-LoRA layer runs, per thread or asyncio task.

`miles.lora.model.use_slots` routes a batch through a model's layers; a layer's forward
reads its own with `batch_of`. A layer recomputed in the backward puts back the routing of
its first forward with `active_routing` and `restore_routing`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

from miles.lora.slot_batch import SlotBatch

# One mapping per context (thread or asyncio task): id of a multi-LoRA layer -> the
# batch being run. Keyed per layer object so that two models (or a deep copy) never
# see each other's slots. Never mutated: `routed` and `restore_routing` set a new one
# (the default, no routing at all, is read-only).
_ACTIVE: contextvars.ContextVar[Mapping[int, SlotBatch]] = contextvars.ContextVar(
    "miles_lora_slots", default=MappingProxyType({})
)


def batch_of(layer: object) -> SlotBatch | None:
    """The batch routed through `layer` here; None outside any `use_slots` block."""
    return _ACTIVE.get().get(id(layer))


@contextlib.contextmanager
def routed(layers: Iterable[object], batch: SlotBatch) -> Iterator[None]:
    """Run the block with `batch` routed through `layers` (beside what is routed already)."""
    token = _ACTIVE.set({**_ACTIVE.get(), **dict.fromkeys(map(id, layers), batch)})
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_routing() -> Mapping[int, SlotBatch]:
    """The slot routing in effect here (what the enclosing `use_slots` blocks set), for
    `restore_routing` to put back later: a layer recomputed in the backward
    (`miles.backends.torch.recompute`) must see the slots of its first forward, whichever
    thread and context the autograd engine runs it in."""
    return _ACTIVE.get()


@contextlib.contextmanager
def restore_routing(routing: Mapping[int, SlotBatch]) -> Iterator[None]:
    """Run the block with `routing` (from `active_routing`) in effect."""
    token = _ACTIVE.set(routing)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
