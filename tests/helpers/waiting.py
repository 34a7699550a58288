"""Waiting in tests: for a condition, with a deadline, never for a fixed time.

    from tests.helpers.waiting import wait_until, wait_until_async, call_actor

Every wait names what it waits for; on time-out it fails with that name and the last value
(or error) the condition gave, so a red test says what never happened. A condition may
raise one of `retry_on` while the thing it reads is still coming up (a server not bound
yet, a Ray actor being restarted): that counts as "not yet".
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.05


class WaitTimeout(AssertionError):
    """A condition did not hold before its deadline."""


def _timed_out(what: str, timeout: float, last: object) -> WaitTimeout:
    return WaitTimeout(f"timed out after {timeout:.1f} s waiting for {what} (last: {last!r})")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, *, poll_s: float = POLL_S,
               retry_on: tuple[type[BaseException], ...] = (), alive: Callable[[], bool] | None = None) -> T:
    """Calls `predicate` until it returns something truthy, and returns that.

    `alive`: checked between tries; once it returns False the wait fails at once (the
    process that should make the condition true has exited)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except retry_on as exc:
            value, last = None, exc
        else:
            if value:
                return value
            last = value
        if alive is not None and not alive():
            raise WaitTimeout(f"gave up waiting for {what}: the process that should bring it about is gone "
                              f"(last: {last!r})")
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(poll_s)


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], timeout: float, what: str, *,
                           poll_s: float = POLL_S, retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """`wait_until` inside an event loop; `predicate` may be a plain or an async function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except retry_on as exc:
            value, last = None, exc
        else:
            if value:
                return value
            last = value
        if loop.time() >= deadline:
            raise _timed_out(what, timeout, last)
        await asyncio.sleep(poll_s)


def _actor_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    return (ActorUnavailableError, RayActorError, GetTimeoutError)


def call_actor(method: Any, *args: Any, timeout: float = 60.0, what: str | None = None, **kwargs: Any) -> Any:
    """`ray.get(method.remote(*args, **kwargs))` on an actor that Ray may be restarting:
    retried while the actor is unavailable or dead-and-restarting, until `timeout`."""
    import ray

    name = what or f"{getattr(method, '_method_name', 'the actor call')} to answer"

    def attempt() -> tuple[Any]:
        return (ray.get(method.remote(*args, **kwargs), timeout=max(1.0, timeout / 4)),)

    return wait_until(attempt, timeout, name, poll_s=0.2, retry_on=_actor_errors())[0]


async def call_actor_async(method: Any, *args: Any, timeout: float = 60.0, what: str | None = None,
                           **kwargs: Any) -> Any:
    """`call_actor` for async tests."""
    name = what or f"{getattr(method, '_method_name', 'the actor call')} to answer"

    async def attempt() -> tuple[Any]:
        return (await asyncio.wait_for(method.remote(*args, **kwargs), timeout=max(1.0, timeout / 4)),)

    return (await wait_until_async(attempt, timeout, name, poll_s=0.2,
                                   retry_on=(*_actor_errors(), asyncio.TimeoutError)))[0]
