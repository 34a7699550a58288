"""Find the inference workers behind an sglang-router and abort requests on each one.

The router does not forward `/abort_request`, so aborting one adapter's in-flight
requests (a prefix abort on `"{adapter}::"`) means asking the router for its workers and
posting to each worker directly:

    async with httpx.AsyncClient() as client:
        urls = await discover_workers("http://127.0.0.1:30000", client)
    reached = await abort_on_workers("http://127.0.0.1:30000", "math::")

Failures are logged, never raised: an abort is best effort and must not stop training.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from miles.utils.types import AbortRequest

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


def _with_scheme(url: str) -> str:
    url = url.rstrip("/")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


async def discover_workers(router_url: str, client: httpx.AsyncClient) -> list[str]:
    """Worker URLs from `GET /list_workers` (`{"urls"}`), else `GET /workers`
    (`{"workers": [{"url"}]}`); an empty list when neither answers usefully."""
    base = _with_scheme(router_url)
    try:
        response = await client.get(f"{base}/list_workers")
        if response.status_code == 200:
            urls = response.json().get("urls")
            if isinstance(urls, list):
                return [_with_scheme(str(u)) for u in urls]
        response = await client.get(f"{base}/workers")
        if response.status_code == 200:
            workers = response.json().get("workers")
            if isinstance(workers, list):
                return [_with_scheme(str(w["url"])) for w in workers if isinstance(w, dict) and "url" in w]
        logger.warning("Router %s listed no workers (last answer: HTTP %d)", base, response.status_code)
    except (httpx.HTTPError, ValueError) as exc:
        logger.warning("Cannot list the workers of router %s: %s", base, exc)
    return []


async def _abort_one(client: httpx.AsyncClient, worker: str, prefix: str) -> bool:
    try:
        response = await client.post(f"{worker}/abort_request",
                                     json=AbortRequest(rid=prefix, prefix=True).model_dump(exclude_unset=True))
    except httpx.HTTPError as exc:
        logger.warning("Abort of %r on worker %s failed: %s", prefix, worker, exc)
        return False
    if response.status_code >= 400:
        logger.warning("Abort of %r on worker %s answered HTTP %d", prefix, worker, response.status_code)
        return False
    return True


async def abort_on_workers(router_url: str, prefix: str, timeout_s: float = ABORT_TIMEOUT_S) -> list[str]:
    """Post `{"rid": prefix, "prefix": true}` to every worker; returns the URLs reached."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        workers = await discover_workers(router_url, client)
        if not workers:
            logger.warning("No workers found at router %s; nothing to abort for %r", router_url, prefix)
            return []
        results = await asyncio.gather(*(_abort_one(client, w, prefix) for w in workers))
    return [w for w, ok in zip(workers, results) if ok]
