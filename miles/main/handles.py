"""The driver's view of the Ray actors it calls, as typed handles.

Every stage calls an actor as `await handle.method.remote(...)`. These protocols list the
methods the stages call and what each answers, so the stages type-check against them and
tests hand in in-process objects with the same shape (`tests/main/lifecycle_fakes.py`).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from miles.utils.types import ClientCommandBatch, DataPosition, MultiLoRASnapshot, RolloutBatch
from miles.utils.types.lifecycle_ops import Transition

T_co = TypeVar("T_co", covariant=True)


class Remote(Protocol[T_co]):
    """One actor method: `await method.remote(*args)` answers a `T_co`."""

    def remote(self, *args: Any, **kwargs: Any) -> Awaitable[T_co]: ...


class ApplyRemote(Protocol):
    """`await controller.apply.remote(op)`: one lifecycle transition (`miles.utils.types.lifecycle_ops`),
    answered with the registry's snapshot after it."""

    def remote(self, op: Transition[Any], /) -> Awaitable[MultiLoRASnapshot]: ...


class ControllerHandle(Protocol):
    """`miles.controller.actor.MultiLoRAController`: every call that changes the registry
    (`apply`) answers with the registry's snapshot after it (the driver never derives one)."""

    snapshot: Remote[MultiLoRASnapshot]
    apply: ApplyRemote
    wait_for_registration: Remote[int]
    # client-driven models (the Tinker command log)
    take_client_commands: Remote[ClientCommandBatch]
    wait_for_client_commands: Remote[bool]
    complete_client_command: Remote[None]
    fail_client_command: Remote[None]
    idle_client_models: Remote[list[str]]
    page_out_client: Remote[bool]


class RolloutManagerHandle(Protocol):
    """`miles.rollout.manager.RolloutManager`, as the driver's stages and the pusher use it."""

    generate: Remote[RolloutBatch]
    data_positions: Remote[dict[str, DataPosition]]
    restore_data_position: Remote[None]
    versions_in_flight: Remote[dict[int, int]]
    record_push: Remote[None]
    forget_slot: Remote[None]

