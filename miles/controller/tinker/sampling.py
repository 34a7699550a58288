"""Sample futures of the Tinker gateway: `asample` starts one, `retrieve_future` reads it back.

A sample runs as an asyncio task on the controller's loop, through the router
(`Sampler`, async HTTP), so the control plane never blocks on an engine. Unlike the
command log, samples are not written to SQLite: they are short, never change a model, and
a client whose sample was lost with a restarted controller is told the future is unknown
and samples again. A retry of the same (sampling session, seq_id) is the same future:

    samples = SampleFutures(lambda: backend.router_url)
    future = samples.submit("s-1:sample:0", seq_id=3, num_samples=2, run=lambda sampler: sampler.sample(...))
    future = await samples.wait(future.future_id, timeout_s=20)   # done, or as it stands
    await samples.aclose()                                         # cancels what still runs

The newest `keep` finished samples are kept for `retrieve_future` (the SDK reads each once,
right away); older ones are forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from miles.controller.tinker.command_log import ErrorCategory
from miles.controller.tinker.sampler import Sampler, SamplingAbortedError, SamplingError
from miles.utils.types import SampleResult

logger = logging.getLogger(__name__)

KEEP_FINISHED_SAMPLES = 4096
SAMPLE_FUTURE_PREFIX = "sample-"
"""Sample future ids start with this (command futures are bare hex), so `retrieve_future`
knows where to look."""


class NoRouterError(RuntimeError):
    """Sampling was asked for before the trainer told the controller its router."""


@dataclass
class SampleFuture:
    future_id: str
    sampler_id: str
    sequence_ids: list[str]
    """One id per requested sample (the SDK stamps them on the returned sequences)."""
    task: asyncio.Task[SampleResult] = field(repr=False)

    @property
    def done(self) -> bool:
        return self.task.done()

    @property
    def retryable(self) -> bool:
        """It failed in a way a new request may not (the engine aborted it: paused for a weight
        update); `retrieve_future` answers 410, on which the SDK sends the sample again."""
        return self.task.done() and not self.task.cancelled() and isinstance(self.task.exception(),
                                                                             SamplingAbortedError)

    def outcome(self) -> SampleResult | tuple[str, ErrorCategory]:
        """The result, or (error, category) of a failed sample; only once `done`."""
        assert self.task.done()
        if self.task.cancelled():
            return "the sample was cancelled (the controller is stopping); sample again", ErrorCategory.SERVER
        exc = self.task.exception()
        if exc is None:
            return self.task.result()
        return _describe(exc)


def _describe(exc: BaseException) -> tuple[str, ErrorCategory]:
    """What a failed sample tells its client, and whose fault it is (by type, never by text)."""
    if isinstance(exc, SamplingAbortedError):
        return str(exc), ErrorCategory.SERVER
    if isinstance(exc, SamplingError):
        # The engine refused the request itself (a token outside the vocabulary, too long).
        user = exc.status is not None and 400 <= exc.status < 500
        return str(exc), ErrorCategory.USER if user else ErrorCategory.SERVER
    if isinstance(exc, ValueError):
        return str(exc), ErrorCategory.USER
    if isinstance(exc, httpx.HTTPError):
        return f"the inference router did not answer: {type(exc).__name__}: {exc}", ErrorCategory.SERVER
    return f"sampling failed: {type(exc).__name__}: {exc}", ErrorCategory.SERVER


class SampleFutures:
    def __init__(self, router_url: Callable[[], str | None], keep: int = KEEP_FINISHED_SAMPLES) -> None:
        self._router_url = router_url
        self.keep = keep
        self._sampler: Sampler | None = None
        self._retired: list[Sampler] = []
        """Samplers of a previous router URL (samples may still run on them): closed by `aclose`."""
        self._futures: OrderedDict[str, SampleFuture] = OrderedDict()
        self._by_key: dict[tuple[str, int], str] = {}

    def sampler(self) -> Sampler:
        """The sampler of the router the controller knows now (made again if it changed)."""
        url = self._router_url()
        if url is None:
            raise NoRouterError("sampling is not available: this trainer has no inference router yet "
                                "(its engines have not started, or it runs without rollout)")
        if self._sampler is None or self._sampler.router_url != url.rstrip("/"):
            if self._sampler is not None:
                self._retired.append(self._sampler)
            self._sampler = Sampler(url)
        return self._sampler

    def __contains__(self, future_id: str) -> bool:
        return future_id.startswith(SAMPLE_FUTURE_PREFIX)

    def submit(self, sampler_id: str, seq_id: int | None, num_samples: int,
               run: Callable[[Sampler], Awaitable[SampleResult]]) -> SampleFuture:
        """Start `run` on the router's sampler; the same (sampler_id, seq_id) again returns the
        future of the first call (a retried request runs once)."""
        key = None if seq_id is None else (sampler_id, seq_id)
        found = self._futures.get(self._by_key.get(key, "")) if key is not None else None
        if found is not None:
            return found
        sampler = self.sampler()
        future_id = f"{SAMPLE_FUTURE_PREFIX}{uuid.uuid4().hex}"
        task = asyncio.get_running_loop().create_task(_run(run, sampler), name=f"tinker-{future_id}")
        future = SampleFuture(future_id=future_id, sampler_id=sampler_id,
                              sequence_ids=[f"{future_id}-{i}" for i in range(num_samples)], task=task)
        self._futures[future_id] = future
        if key is not None:
            self._by_key[key] = future_id
        task.add_done_callback(self._finished)
        return future

    def _finished(self, task: asyncio.Task[SampleResult]) -> None:
        if not task.cancelled():
            task.exception()  # read here, so a sample forgotten before its client read it logs nothing
        self._forget_old()

    async def wait(self, future_id: str, timeout_s: float) -> SampleFuture | None:
        """The future once finished, or as it stands after `timeout_s`; None if unknown."""
        future = self._futures.get(future_id)
        if future is None or future.done:
            return future
        await asyncio.wait([future.task], timeout=timeout_s)
        return future

    def _forget_old(self) -> None:
        finished = [fid for fid, f in self._futures.items() if f.done]
        for future_id in finished[:max(0, len(finished) - self.keep)]:
            self._futures.pop(future_id)
        if len(self._by_key) > len(self._futures):
            self._by_key = {k: v for k, v in self._by_key.items() if v in self._futures}

    async def aclose(self) -> None:
        """Cancel and await the samples still running; close the sampler's connections."""
        running = [f.task for f in self._futures.values() if not f.done]
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sampler in [*self._retired, *([self._sampler] if self._sampler is not None else [])]:
            await sampler.aclose()
        self._sampler, self._retired = None, []


async def _run(run: Callable[[Sampler], Awaitable[SampleResult]], sampler: Sampler) -> SampleResult:
    try:
        return await run(sampler)
    except Exception as exc:
        logger.info("Tinker sample failed: %s", _describe(exc)[0])
        raise
