"""`remote_rm`: a reward computed by an HTTP reward server (`--rm-url`), as in Miles.

Each sample is posted as JSON `{"prompt", "response", "label"}` to the URL; the server
answers with a JSON number, or an object from which `--reward-key` selects the reward.
A request that fails to connect, times out or gets a 5xx / 429 answer is retried with
exponential backoff, a bounded number of times; a 4xx answer is not retried. Then
`RemoteRewardError` says which server failed and why, so a dead reward server stops the
group with a clear error instead of hanging the rollout.

    reward = await post_reward("http://127.0.0.1:8000/reward", {"prompt": ..., ...})
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt, wait_exponential

from miles.utils.types import Sample

REMOTE_RM_TIMEOUT_S = 60.0
"""Total time of one request (connect, send, answer)."""
REMOTE_RM_ATTEMPTS = 3
REMOTE_RM_BACKOFF_S = 0.5
"""First wait between attempts; doubles each time (at most 8 s)."""


class RemoteRewardError(RuntimeError):
    """The reward server could not score a sample; the message names the URL and the cause."""


class _RetryableStatus(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, (aiohttp.ClientConnectionError, asyncio.TimeoutError, _RetryableStatus))


async def _post_once(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> Any:
    async with session.post(url, json=payload) as resp:
        if resp.status >= 500 or resp.status == 429:
            raise _RetryableStatus(resp.status, await resp.text())
        if resp.status >= 400:
            raise RemoteRewardError(f"reward server {url} refused the sample: HTTP {resp.status}: "
                                    f"{(await resp.text())[:200]}")
        try:
            return await resp.json(content_type=None)
        except ValueError as exc:
            raise RemoteRewardError(f"reward server {url} answered with something that is not JSON") from exc


async def post_reward(
    url: str,
    payload: dict[str, Any],
    *,
    timeout_s: float = REMOTE_RM_TIMEOUT_S,
    attempts: int = REMOTE_RM_ATTEMPTS,
    backoff_s: float = REMOTE_RM_BACKOFF_S,
) -> Any:
    """POST `payload` to `url` and return the decoded JSON answer, retrying transient failures."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    retrying = AsyncRetrying(
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=backoff_s, max=8.0),
        retry=retry_if_exception(_retryable),
    )
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async for attempt in retrying:
                with attempt:
                    return await _post_once(session, url, payload)
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            reason = "timed out" if isinstance(cause, asyncio.TimeoutError) else str(cause) or type(cause).__name__
            raise RemoteRewardError(
                f"reward server {url} failed {attempts} times (timeout {timeout_s:g} s each): {reason}"
            ) from cause
    raise AssertionError("unreachable: tenacity either returns or raises")


async def remote_rm(args: Any, sample: Sample) -> Any:
    """Miles' `remote_rm`: post the sample to `args.rm_url`; a number or a dict (see `--reward-key`)."""
    url = args.rm_url if args is not None else None
    if not url:
        raise RemoteRewardError("rm_type remote_rm needs --rm-url, the URL of the reward server")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await post_reward(url, payload)
