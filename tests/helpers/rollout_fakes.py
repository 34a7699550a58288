"""Hand-written fakes for rollout tests: a controller with the actor's async surface,
a clock that tests advance, a producer whose death tests decide, and group builders."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles.utils.adapter_config import AdapterRunConfig
from miles.utils.types import AdapterFailure, AdapterRun, MultiLoRASnapshot, PromptGroup, Sample
from miles.utils.types.lifecycle_ops import FailAdapter, RecordBatch, Transition
from tests.helpers.waiting import wait_until_async


class FakeMethod:
    """`handle.method.remote(...)` returning an awaitable, like a Ray actor method."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class FakeController:
    def __init__(self, snapshot: MultiLoRASnapshot | None = None) -> None:
        self.current = snapshot or MultiLoRASnapshot()
        self.records: list[tuple[int, dict[str, int], list[str]]] = []
        self.snapshot_reads = 0
        """How many times the code under test read the snapshot (a producer reads it once per round)."""
        self.failures: list[tuple[str, str, AdapterFailure]] = []
        """(name, registration id, failure) of every `FailAdapter` applied."""
        self.snapshot = FakeMethod(self._snapshot)
        self.apply = FakeMethod(self._apply)

    async def _snapshot(self) -> MultiLoRASnapshot:
        self.snapshot_reads += 1
        return self.current

    async def _apply(self, op: Transition[Any]) -> MultiLoRASnapshot:
        if isinstance(op, RecordBatch):
            self.records.append((op.rollout_id, dict(op.groups), list(op.step_names)))
        elif isinstance(op, FailAdapter):
            self._fail(op.name, op.registration_id, op.failure)
        else:
            raise AssertionError(f"the rollout side does not apply {op!r}")
        return self.current

    def _fail(self, name: str, registration_id: str, failure: AdapterFailure) -> None:
        """As the registry does: a sampleable registration moves to CLEANUP."""
        self.failures.append((name, registration_id, failure))
        run = self.current.sampleable.get(name)
        if run is None or run.registration_id != registration_id:
            return
        self.current = dataclasses.replace(
            self.current, active={n: r for n, r in self.current.active.items() if n != name},
            retiring={n: r for n, r in self.current.retiring.items() if n != name},
            cleanup=self.current.cleanup | {name})


class FakeClock:
    """Time moves only when the code under test sleeps; events fire when it passes them."""

    def __init__(self) -> None:
        self.t = 0.0
        self._events: list[tuple[float, Callable[[], None]]] = []

    def now(self) -> float:
        return self.t

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._events.append((when, action))
        self._events.sort(key=lambda event: event[0])

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        while self._events and self._events[0][0] <= self.t + 1e-9:
            _, action = self._events.pop(0)
            action()


class FakeProducer:
    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self.given_up: set[str] = set()
        """Registration ids the test says the producer gave up on."""

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RuntimeError("rollout producer died") from self.failure

    def gave_up(self, registration_id: str) -> bool:
        return registration_id in self.given_up


def make_run(name: str, slot: int, *, rollout_batch_size: int = 8, n_samples: int = 1, version: int = 1,
             accumulated: int = 0, registration_id: str | None = None, **config: Any) -> AdapterRun:
    config.setdefault("data", "unused.jsonl")
    cfg = AdapterRunConfig(rollout_batch_size=rollout_batch_size, n_samples_per_prompt=n_samples, **config)
    return AdapterRun(name=name, config=cfg, slot=slot, version=version, step=0,
                      accumulated_groups=accumulated, registration_id=registration_id or f"reg-{name}")


def make_group(run: AdapterRun, group_index: int, *, version: int | None = None,
               registration_id: str | None = None, rewards: list[float] | None = None) -> PromptGroup:
    n = run.config.n_samples_per_prompt
    rewards = rewards or [0.0] * n
    samples = [
        Sample(adapter=run.name, slot=run.slot, group_index=group_index, index=i, prompt=f"p{group_index}",
               label=None, metadata={}, prompt_ids=[1], response_ids=[7] * (i + 1), reward=rewards[i])
        for i in range(n)
    ]
    return PromptGroup(adapter=run.name, slot=run.slot, version=run.version if version is None else version,
                       registration_id=registration_id or run.registration_id, samples=samples)


def active(*runs: AdapterRun, retiring: tuple[AdapterRun, ...] = ()) -> MultiLoRASnapshot:
    return MultiLoRASnapshot(active={r.name: r for r in runs}, retiring={r.name: r for r in retiring})


class FakeEngineServer:
    """A tiny SGLang-shaped HTTP server on 127.0.0.1 for producer tests.

    Every `/generate` answers `response_text` with two logprobs, after `gate` opens;
    a request whose rid starts with an aborted prefix finishes with "abort".
    `status_code` other than 200 makes every `/generate` fail.
    """

    def __init__(self, response_text: str = "12") -> None:
        self.response_text = response_text
        self.requests: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.aborted_prefixes: list[str] = []
        self.status_code = 200
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            self.requests.append(body)
            if self.status_code != 200:
                return JSONResponse({"detail": "engine failure"}, status_code=self.status_code)
            gate = asyncio.ensure_future(self.gate.wait())
            while not gate.done() and not self._is_aborted(body["rid"]):
                await asyncio.wait([gate], timeout=0.01)
            gate.cancel()
            reason = "abort" if self._is_aborted(body["rid"]) else "stop"
            ids = [5, 6]
            return {"text": self.response_text if reason == "stop" else "",
                    "output_ids": ids if reason == "stop" else [],
                    "meta_info": {"id": body["rid"], "finish_reason": {"type": reason},
                                  "prompt_tokens": len(body["input_ids"]), "completion_tokens": 2,
                                  "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}}

        @app.post("/abort_request")
        async def abort(request: Request):
            body = await request.json()
            self.aborted_prefixes.append(body["rid"])
            return {}

        self.app = app
        self.url = ""

    def _is_aborted(self, rid: str) -> bool:
        return any(rid.startswith(prefix) for prefix in self.aborted_prefixes)

    async def __aenter__(self) -> FakeEngineServer:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                     lifespan="off"))
        self._task = asyncio.create_task(self._server.serve())
        self.url = await served_url(self._server, self._task)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.gate.set()
        self._server.should_exit = True
        await self._task


async def served_url(server: Any, task: asyncio.Task) -> str:
    """The URL of a uvicorn `server` started on port 0 by `task`, once it listens (the port
    is the one the OS gave it, read back from its socket)."""

    def listening() -> bool:
        if task.done():  # it failed to start: raise its error instead of waiting out the deadline
            task.result()
            raise AssertionError("the fake server stopped before it listened")
        return server.started

    await wait_until_async(listening, 10, "the fake server to listen")
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
