"""One long-lived HTTP client per event loop.

Building an `httpx.AsyncClient` builds an SSL context (~16 ms of CPU), so components that
call a server again and again (engine pushes, health rounds) keep one; a client is bound
to the event loop it first ran on, so another loop gets its own.

    http = LoopClient(timeout=120.0)
    response = await http.get().post(url, json=body)
    await http.aclose()
"""

from __future__ import annotations

import asyncio

import httpx


class LoopClient:
    def __init__(self, *, timeout: float) -> None:
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> httpx.AsyncClient:
        """The client of the running event loop (made on first use)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client, self._loop = httpx.AsyncClient(timeout=self.timeout, trust_env=False), loop
        return self._client

    async def aclose(self) -> None:
        """Close the client if it belongs to the running loop; forget it either way."""
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._loop = None
