"""Each lifecycle operation (`miles.utils.types.lifecycle_ops`) run on the registry: the one
place an operation meets the registry method that performs it, and the adapters whose
in-flight requests are aborted around it. `MultiLoRABackend.apply` calls these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles.controller.registry import AdapterRegistry
from miles.utils.types import AdapterState
from miles.utils.types.lifecycle_ops import (
    ActivateClients,
    BeginWeightUpdate,
    FailAdapter,
    FreeSlots,
    MarkBatchTrained,
    PageIn,
    PageOut,
    RecordBatch,
    RecordClientCheckpoint,
    RecordClientStep,
    RecordWeightUpdate,
    RequeueForNewTrainer,
    RetireAdapters,
    SetStep,
    Transition,
)


def run(registry: AdapterRegistry, op: Transition[Any]) -> Any:
    """Apply `op` to the registry; answers what the registry's transition answers."""
    match op:
        case RetireAdapters():
            return registry.retire_adapters()
        case FailAdapter(name, registration_id, failure):
            return registry.fail(name, registration_id, failure)
        case FreeSlots(names):
            return [registry.free_slot(name) for name in names]
        case BeginWeightUpdate(names):
            return registry.begin_weight_update(list(names))
        case RecordWeightUpdate(names):
            return registry.record_weight_update(list(names))
        case RecordBatch(rollout_id, groups, step_names):
            return registry.record_batch_adapters(rollout_id, groups, list(step_names))
        case MarkBatchTrained(rollout_id):
            return registry.mark_batch_trained(rollout_id)
        case SetStep(name, step, accumulated_groups):
            return registry.set_step(name, step, accumulated_groups)
        case RequeueForNewTrainer():
            return registry.requeue_for_new_trainer()
        case ActivateClients(names):
            return registry.activate_clients(list(names))
        case PageOut(name, directory):
            return registry.page_out(name, directory)
        case PageIn(name):
            return registry.page_in(name)
        case RecordClientStep(name):
            return registry.record_client_step(name)
        case RecordClientCheckpoint(name, directory):
            return registry.record_client_checkpoint(name, directory)
    raise TypeError(f"{type(op).__name__} is not a lifecycle operation of miles.utils.types.lifecycle_ops")


def aborts_before(registry: AdapterRegistry, op: Transition[Any]) -> Sequence[str]:
    """Adapters whose in-flight requests are aborted before `op` runs."""
    if isinstance(op, FreeSlots):  # one more abort round for those still in CLEANUP
        return [name for name in op.names if registry.state(name) is AdapterState.CLEANUP]
    return ()


def aborts_after(op: Transition[Any], result: Any) -> Sequence[str]:
    """Adapters whose in-flight requests are aborted after `op` ran with `result`."""
    if isinstance(op, RetireAdapters):
        return result
    if isinstance(op, FailAdapter):
        return [op.name] if result else []
    return ()
