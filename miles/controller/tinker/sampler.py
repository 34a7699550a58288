"""Sampling for Tinker clients: a sampler snapshot (or the base model) through the router.

    sampler = Sampler("http://127.0.0.1:30000")      # the router (or one engine)
    result = await sampler.sample(snapshot, prompt_tokens, SamplingRequestParams(num_samples=4, max_tokens=32))
    logprobs = await sampler.compute_logprobs(snapshot, prompt_tokens)   # [None, lp1, lp2, ...]
    await sampler.aclose()

The gateway calls this module; it imports no torch and no backend code, only HTTP. Each
of a request's `num_samples` is one `POST /generate` (so the router spreads them over
the engines), with SGLang's fields: `lora_path` = the snapshot's engine-side name,
`sampling_params`, `return_logprob`, and for prompt logprobs `logprob_start_len` = 0
and `top_logprobs_num` (sent with the first sample only: the prompt is the same).

Snapshots are loaded by path. The builtin engine, and SGLang since sgl-project/sglang#11526,
evict the least recently used adapter past `--max-loaded-loras` and reload an evicted
one on its next request by themselves; an engine that never had the snapshot (one that
restarted, or an older SGLang, whose limit is a hard one) answers 400 "... not loaded".
On that answer the sampler loads the snapshot on every worker the router lists
(`/load_lora_adapter {lora_name, lora_path}`; the router does not forward loads) and
retries those samples once. An older SGLang at its limit refuses the load ("Maximum
number of loaded LoRA adapters ..."): the sampler then unloads from that worker the
snapshots it sampled least recently, one at a time, until the load fits, which is
client-side LRU eviction for engines without their own. It only ever unloads snapshots
(names it loaded), never the slots of server-driven RL. When nothing it may unload is
left, the request fails with `SnapshotUnavailableError`, whose message says so.

Errors by type: `SnapshotUnavailableError` (the snapshot cannot be loaded),
`SamplingAbortedError` (the engine aborted the request: paused for a weight update, shut
down; retryable), `SamplingError` (any other engine answer the request cannot be served with).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx

from miles.utils.router_workers import discover_workers
from miles.utils.types import (
    GenerateRequest,
    GenerateResponse,
    SampledSequence,
    SampleResult,
    SamplerSnapshot,
    SamplingParams,
    SamplingRequestParams,
    StopReason,
    TopLogprobs,
    adapter_rid,
)

logger = logging.getLogger(__name__)

SAMPLE_TIMEOUT_S = 600.0
BASE_MODEL_RID = "tinker-base"
"""Rid prefix of base-model samples (a snapshot's own are its LoRA name)."""
SEED_MODULUS = 2**63
RECENT_SNAPSHOTS_KEPT = 1024
"""Snapshots a sampler remembers in use order (far more than any engine holds at once)."""

T = TypeVar("T")


class SamplingError(RuntimeError):
    """An engine answered a sample request with an error; `status` is its HTTP status."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class SnapshotUnavailableError(SamplingError):
    """The snapshot could not be loaded into the engines (its directory, or the engine's limit)."""


class SamplingAbortedError(SamplingError):
    """The engine aborted the request (generation paused for a weight update, or shutting down)."""


def is_adapter_not_loaded(status: int, body: str) -> bool:
    """Whether an engine's `/generate` answer means "this LoRA adapter is not loaded here".

    SGLang answers that as a 400 whose only marker is its text ("The following requested
    LoRA adapters are not loaded: ..."), which the builtin engine repeats; over HTTP there
    is no type to go by, so this one function reads the text."""
    return status == 400 and "not loaded" in body


def _already_loaded(status: int, body: str) -> bool:
    return status == 400 and "already loaded" in body


def _at_load_limit(status: int, body: str) -> bool:
    """SGLang before #11526 refusing a load past its hard `--max-loaded-loras`."""
    return status >= 400 and "Maximum number of loaded LoRA adapters" in body


def seed_of_sample(seed: int | None, index: int) -> int | None:
    """Seed of sample `index` of a seeded request: different per sample, the same per request.

    >>> [seed_of_sample(7, i) for i in range(3)], seed_of_sample(None, 1)
    ([7, 8, 9], None)
    """
    return None if seed is None else (seed + index) % SEED_MODULUS


def engine_sampling_params(params: SamplingRequestParams, index: int) -> SamplingParams:
    """SGLang's `sampling_params` for sample `index` of a Tinker request."""
    fields: dict[str, Any] = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:  # SGLang's name (it honours it under --enable-deterministic-inference)
        fields["sampling_seed"] = seed_of_sample(params.seed, index)
    if params.max_tokens is not None:
        fields["max_new_tokens"] = params.max_tokens
    stop = params.stop
    if isinstance(stop, str):
        fields["stop"] = [stop]
    elif isinstance(stop, list) and not stop:
        fields["ignore_eos"] = True  # Tinker's `[]`: no stop at all, EOS included
    elif isinstance(stop, list) and isinstance(stop[0], str):
        fields["stop"] = list(stop)
    elif isinstance(stop, list):
        fields["stop_token_ids"] = [int(t) for t in stop]
    return SamplingParams(**fields)


def build_generate_request(snapshot: SamplerSnapshot | None, prompt_tokens: Sequence[int],
                           params: SamplingRequestParams, index: int) -> GenerateRequest:
    """The `/generate` body of sample `index` (the first also asks for the prompt's logprobs)."""
    wants_prompt = index == 0 and (params.prompt_logprobs or params.topk_prompt_logprobs > 0)
    top = max(params.topk_sample_logprobs, params.topk_prompt_logprobs if wants_prompt else 0)
    owner = snapshot.lora_name if snapshot is not None else BASE_MODEL_RID
    extra: dict[str, Any] = {}
    if wants_prompt:
        last_n = params.prompt_logprobs_last_n
        extra["logprob_start_len"] = 0 if last_n is None else max(0, len(prompt_tokens) - last_n)
    if top > 0:
        extra["top_logprobs_num"] = top
    return GenerateRequest(input_ids=list(prompt_tokens), sampling_params=engine_sampling_params(params, index),
                           lora_path=snapshot.lora_name if snapshot is not None else None,
                           rid=adapter_rid(owner, uuid.uuid4().hex), return_logprob=True, **extra)


def _stop_reason(response: GenerateResponse) -> StopReason:
    finish = response.meta_info.finish_reason
    if finish.type == "abort":
        raise SamplingAbortedError(f"the engine aborted sample {response.meta_info.id}: "
                                   f"{finish.message or 'no reason given'}; retry the request")
    return StopReason.STOP if finish.type == "stop" else StopReason.LENGTH


def _top_pairs(entries: Sequence[Any] | None, k: int) -> TopLogprobs | None:
    """SGLang's [(logprob, token_id, text), ...] of one position as Tinker's [(token_id, logprob), ...]."""
    if entries is None:
        return None
    return [(int(tok), float(lp)) for lp, tok, *_ in entries[:k]]


def sequence_from_response(response: GenerateResponse, topk: int) -> SampledSequence:
    meta = response.meta_info
    logprobs = [float(lp) for lp, _, _ in (meta.output_token_logprobs or [])]
    if len(logprobs) != len(response.output_ids):
        raise SamplingError(f"the engine returned {len(logprobs)} logprobs for {len(response.output_ids)} tokens "
                            f"(sample {meta.id}); it must honour return_logprob")
    topk_logprobs = None
    if topk > 0:
        tops = meta.output_top_logprobs or []
        topk_logprobs = [_top_pairs(tops[i] if i < len(tops) else None, topk) for i in range(len(logprobs))]
    return SampledSequence(tokens=list(response.output_ids), logprobs=logprobs, stop_reason=_stop_reason(response),
                           topk_logprobs=topk_logprobs)


def prompt_logprobs_from_response(response: GenerateResponse, n_prompt: int) -> list[float | None]:
    """One logprob per prompt token (None for the first) from SGLang's `input_token_logprobs`."""
    entries = response.meta_info.input_token_logprobs
    if entries is None:
        raise SamplingError("the engine returned no input_token_logprobs: it does not serve prompt logprobs "
                            "(SGLang's logprob_start_len)")
    values: list[float | None] = [None if lp is None else float(lp) for lp, _, _ in entries][-n_prompt:]
    return _align_to_prompt(values, n_prompt)


def topk_prompt_logprobs_from_response(response: GenerateResponse, n_prompt: int, k: int) -> list[TopLogprobs | None]:
    entries = response.meta_info.input_top_logprobs
    if entries is None:
        raise SamplingError("the engine returned no input_top_logprobs: it does not serve top-k prompt logprobs "
                            "(SGLang's top_logprobs_num)")
    return _align_to_prompt([_top_pairs(entry, k) for entry in entries][-n_prompt:], n_prompt)


def _align_to_prompt(values: list[T | None], n_prompt: int) -> list[T | None]:
    """One entry per prompt token: None before the positions the engine scored, and at position 0."""
    aligned: list[T | None] = [None] * (n_prompt - len(values))
    aligned += values
    aligned[0] = None
    return aligned


class Sampler:
    """Samples through one router (or one engine URL); owns an HTTP client unless given one."""

    def __init__(self, router_url: str, *, timeout_s: float = SAMPLE_TIMEOUT_S,
                 client: httpx.AsyncClient | None = None) -> None:
        self.router_url = router_url.rstrip("/")
        self._client = client
        self._owns_client = client is None
        self._timeout_s = timeout_s
        self._recent: OrderedDict[str, SamplerSnapshot] = OrderedDict()
        """Snapshots sampled through this sampler, least recently used first (what it may
        unload from an engine whose limit is a hard one)."""

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout_s, trust_env=False)
        return self._client

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.aclose()
        self._client = None

    async def sample(self, snapshot: SamplerSnapshot | None, prompt_tokens: Sequence[int],
                     params: SamplingRequestParams) -> SampleResult:
        """`params.num_samples` sequences continuing `prompt_tokens` (None: the base model)."""
        if not prompt_tokens:
            raise ValueError("the prompt is empty: give at least one token")
        last_n = params.prompt_logprobs_last_n
        if last_n is not None and last_n > len(prompt_tokens) - 1:
            raise ValueError(f"prompt_logprobs_last_n {last_n} is more than the prompt's {len(prompt_tokens) - 1} "
                             "scorable tokens (the first has no context)")
        loads = 0
        if snapshot is not None:
            if snapshot.lora_name not in self._recent:
                # Loaded before its first samples: a burst of "not loaded" answers would count as
                # failures in the router's circuit breaker (10 open it for a minute).
                await self.load_snapshot(snapshot)
                loads = 1
            self._recent[snapshot.lora_name] = snapshot
            self._recent.move_to_end(snapshot.lora_name)
            while len(self._recent) > RECENT_SNAPSHOTS_KEPT:
                self._recent.popitem(last=False)
        requests = [build_generate_request(snapshot, prompt_tokens, params, i) for i in range(params.num_samples)]
        responses, reloads = await self._generate_all(snapshot, requests)
        loads += reloads
        sequences = [sequence_from_response(r, params.topk_sample_logprobs) for r in responses]
        first, n = responses[0], len(prompt_tokens)
        return SampleResult(
            sequences=sequences,
            prompt_logprobs=prompt_logprobs_from_response(first, n) if params.prompt_logprobs else None,
            topk_prompt_logprobs=(topk_prompt_logprobs_from_response(first, n, params.topk_prompt_logprobs)
                                  if params.topk_prompt_logprobs > 0 else None),
            lora_loads=loads)

    async def compute_logprobs(self, snapshot: SamplerSnapshot | None,
                               prompt_tokens: Sequence[int]) -> list[float | None]:
        """The logprob of every prompt token given the ones before it (None for the first)."""
        # One generated token: SGLang and the builtin engine both serve it, and prefill
        # scores the whole prompt either way.
        params = SamplingRequestParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
        result = await self.sample(snapshot, prompt_tokens, params)
        assert result.prompt_logprobs is not None
        return result.prompt_logprobs

    async def load_snapshot(self, snapshot: SamplerSnapshot) -> list[str]:
        """Load `snapshot` by path on every worker behind the router; returns the worker URLs.

        A worker that has it loaded already counts as loaded."""
        workers = await discover_workers(self.router_url, self._http()) or [self.router_url]
        await asyncio.gather(*(self._load_on(worker, snapshot) for worker in workers))
        return workers

    async def _load_on(self, worker: str, snapshot: SamplerSnapshot) -> None:
        client = self._http()
        body = {"lora_name": snapshot.lora_name, "lora_path": snapshot.directory}
        # Least recently sampled first; the snapshot being loaded is never a candidate.
        candidates = [name for name in self._recent if name != snapshot.lora_name]
        while True:
            answer = await client.post(f"{worker}/load_lora_adapter", json=body)
            if answer.status_code == 200 or _already_loaded(answer.status_code, answer.text):
                return
            hint = ""
            if _at_load_limit(answer.status_code, answer.text):
                if await self._unload_one(worker, candidates):
                    continue
                hint = (" (its --max-loaded-loras is a hard limit, as SGLang's before #11526, and no snapshot "
                        "this sampler may unload is loaded there: raise the limit)")
            raise SnapshotUnavailableError(
                f"could not load sampler snapshot {snapshot.tinker_path} ({snapshot.lora_name} from "
                f"{snapshot.directory}) on {worker}: HTTP {answer.status_code}: {answer.text[:500]}{hint}",
                status=answer.status_code)

    async def _unload_one(self, worker: str, candidates: list[str]) -> bool:
        """Unload from `worker` the first of `candidates` it has loaded (popping those tried)."""
        while candidates:
            name = candidates.pop(0)
            answer = await self._http().post(f"{worker}/unload_lora_adapter", json={"lora_name": name})
            if answer.status_code == 200:
                logger.info("Unloaded sampler snapshot %s from %s to make room (engine at its LoRA limit)",
                            name, worker)
                return True
        return False

    async def _generate_all(self, snapshot: SamplerSnapshot | None,
                            requests: list[GenerateRequest]) -> tuple[list[GenerateResponse], int]:
        """Post every request; on "not loaded" load the snapshot once and retry those once."""
        answers = list(await asyncio.gather(*(self._post(r) for r in requests)))
        missing = [i for i, a in enumerate(answers) if is_adapter_not_loaded(a.status_code, a.text)]
        loads = 0
        if missing and snapshot is not None:
            logger.info("Sampler snapshot %s is not loaded on an engine; loading it from %s",
                        snapshot.lora_name, snapshot.directory)
            await self.load_snapshot(snapshot)
            loads = 1
            retried = await asyncio.gather(*(self._post(requests[i]) for i in missing))
            for i, answer in zip(missing, retried):
                answers[i] = answer
        responses = []
        for request, answer in zip(requests, answers):
            if is_adapter_not_loaded(answer.status_code, answer.text):
                raise SnapshotUnavailableError(
                    f"sampler snapshot {request.lora_path} is still not loaded after loading it on every worker "
                    f"(an engine evicted it again at once: raise --max-loaded-loras): {answer.text[:300]}",
                    status=answer.status_code)
            if answer.status_code != 200:
                raise SamplingError(f"the engine refused sample request {request.rid}: HTTP {answer.status_code}: "
                                    f"{answer.text[:500]}", status=answer.status_code)
            responses.append(GenerateResponse.model_validate_json(answer.content))
        return responses, loads

    async def _post(self, request: GenerateRequest) -> httpx.Response:
        payload = request.model_dump(mode="json", exclude_unset=True)
        return await self._http().post(f"{self.router_url}/generate", json=payload)


async def sample(router_url: str, snapshot: SamplerSnapshot | None, prompt_tokens: Sequence[int],
                 params: SamplingRequestParams, *, client: httpx.AsyncClient | None = None) -> SampleResult:
    """`Sampler(router_url).sample(...)` for one call (pass `client` to reuse connections)."""
    sampler = Sampler(router_url, client=client)
    try:
        return await sampler.sample(snapshot, prompt_tokens, params)
    finally:
        await sampler.aclose()


async def compute_logprobs(router_url: str, snapshot: SamplerSnapshot | None, prompt_tokens: Sequence[int], *,
                           client: httpx.AsyncClient | None = None) -> list[float | None]:
    sampler = Sampler(router_url, client=client)
    try:
        return await sampler.compute_logprobs(snapshot, prompt_tokens)
    finally:
        await sampler.aclose()
