"""`remote_rm` against a real reward server on loopback: answers, retries, clear failures."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import web

from miles.rollout.rewards import get_reward_fn
from miles.rollout.rewards.evaluate import score_sample
from miles.rollout.rewards.remote import RemoteRewardError, post_reward, remote_rm
from miles.utils.types import Sample


class RewardServer:
    """Answers POST /reward with the next scripted (status, body); records every request."""

    def __init__(self, script: list[tuple[int, object]] | None = None, *, hang: bool = False) -> None:
        self.script = list(script or [])
        self.hang = hang
        self.requests: list[dict] = []
        self.never = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        if self.hang:
            await self.never.wait()  # until the client gives up and the server shuts down
        status, body = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")

    async def __aenter__(self) -> RewardServer:
        app = web.Application()
        app.router.add_post("/reward", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/reward"
        return self

    async def __aexit__(self, *exc) -> None:
        self.never.set()
        await self.runner.cleanup()


def sample() -> Sample:
    return Sample(adapter="a", slot=0, group_index=0, index=0, prompt="2+2=", label="4", metadata={},
                  prompt_ids=[], response="4")


async def test_remote_rm_posts_the_sample_and_returns_the_answer():
    async with RewardServer([(200, 0.75)]) as server:
        assert get_reward_fn("remote_rm") is remote_rm
        reward = await score_sample(remote_rm, SimpleNamespace(rm_url=server.url), sample())
    assert reward == 0.75
    assert server.requests == [{"prompt": "2+2=", "response": "4", "label": "4"}]


async def test_a_dict_answer_is_read_with_the_reward_key():
    async with RewardServer([(200, {"score": 1.0, "acc": True})]) as server:
        args = SimpleNamespace(rm_url=server.url)
        assert await score_sample(remote_rm, args, sample(), reward_key="score") == 1.0
        with pytest.raises(ValueError, match="set --reward-key"):
            await score_sample(remote_rm, args, sample())


async def test_transient_failures_are_retried():
    async with RewardServer([(503, "busy"), (500, "oops"), (200, 0.5)]) as server:
        assert await post_reward(server.url, {"x": 1}, attempts=3, backoff_s=0.01) == 0.5
    assert len(server.requests) == 3


async def test_a_failing_server_gives_a_clear_error_after_bounded_attempts():
    async with RewardServer([(500, "model crashed")]) as server:
        with pytest.raises(RemoteRewardError, match=r"failed 3 times .*HTTP 500: \"model crashed\"") as info:
            await post_reward(server.url, {"x": 1}, attempts=3, backoff_s=0.01)
    assert server.url in str(info.value)
    assert len(server.requests) == 3


async def test_a_client_error_is_not_retried():
    async with RewardServer([(422, "bad payload")]) as server:
        with pytest.raises(RemoteRewardError, match="refused the sample: HTTP 422"):
            await post_reward(server.url, {"x": 1}, attempts=3, backoff_s=0.01)
    assert len(server.requests) == 1


async def test_a_hanging_server_times_out_instead_of_hanging():
    async with RewardServer([(200, 1.0)], hang=True) as server:
        with pytest.raises(RemoteRewardError, match="failed 2 times .*timed out"):
            await asyncio.wait_for(post_reward(server.url, {"x": 1}, timeout_s=0.3, attempts=2, backoff_s=0.01), 30)
    assert len(server.requests) == 2


async def test_no_server_and_no_url_are_clear_errors():
    async with RewardServer([(200, 1.0)]) as server:
        url = server.url
    with pytest.raises(RemoteRewardError, match=f"reward server {url} failed 2 times"):
        await post_reward(url, {"x": 1}, attempts=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="needs --rm-url"):
        await remote_rm(SimpleNamespace(rm_url=None), sample())
