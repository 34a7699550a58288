"""Continuous-batching decode loop of the builtin engine.

One thread owns the model. Requests wait in a queue; at every step boundary the loop
drops aborted rows, admits queued requests (prompts of equal length are prefilled together, then
their KV cache joins the running batch), and runs ONE batched forward for every running
sequence, whatever adapter slot each row uses. The running batch keeps one HF
`DynamicCache` with left padding; rows carry their own attention mask and position ids,
so a row's numbers do not depend on what else shares the batch.

    scheduler = DecodeScheduler(model, SchedulerConfig(...), decode=tokenizer.decode)
    scheduler.start()
    scheduler.submit(job)          # job.on_done(job) fires when it finishes
    scheduler.abort(prefix="adapter::")

LoRA weight changes take `scheduler.exclusive()` so they land between two steps.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from miles.rollout.engines.sampling import RowSampling, choose_tokens
from miles.utils.types import FinishReason, SamplingParams

logger = logging.getLogger(__name__)

SlotContext = Callable[[list[int]], contextlib.AbstractContextManager]


@dataclass
class Job:
    """One generation request inside the engine."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    slot: int
    """Page-table row of the request's adapter; -1 is the base model."""
    lora_name: str | None
    sampling: RowSampling
    on_done: Callable[[Job], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    abort_message: str | None = None
    """Set by an abort; the loop finishes the job at the next step boundary."""
    error: str | None = None
    """Set when the engine itself failed the job (a decode step raised): its caller gets an
    error, not an abort, since regenerating would only fail the same way."""
    prompt_logprobs_from: int | None = None
    """First prompt position to score at prefill; None: no prompt logprobs."""
    top_logprobs_num: int = 0
    """Most likely tokens to report at each scored prompt position and each output position."""
    prompt_logprobs: list[float | None] = field(default_factory=list)
    """Raw-logit logprob of each prompt token from `prompt_logprobs_from` on (None at position 0)."""
    prompt_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)

    @property
    def stop_strings(self) -> list[str]:
        stop = self.params.stop
        return [stop] if isinstance(stop, str) else list(stop or [])


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_context: int
    """Prompt plus output tokens a sequence may reach (the model's position limit)."""
    eos_token_ids: frozenset[int]
    device: str = "cpu"
    seed: int = 0


@dataclass
class _RunningBatch:
    jobs: list[Job]
    cache: DynamicCache
    mask_BL: torch.Tensor
    """1 where the cache holds a real token of that row, 0 for left padding."""
    next_pos_B: torch.Tensor
    """Position id of each row's next input token (= its real tokens so far)."""


class DecodeScheduler:
    def __init__(self, model: torch.nn.Module, config: SchedulerConfig, *,
                 decode: Callable[[list[int]], str], slot_context: SlotContext | None = None):
        self.model = model
        self.config = config
        self._decode = decode
        self._slot_context = slot_context or (lambda slots: contextlib.nullcontext())
        self._cond = threading.Condition()
        self._model_lock = threading.RLock()
        self._waiting: deque[Job] = deque()
        self._batch: _RunningBatch | None = None
        self._running: list[Job] = []
        self._admitting: list[Job] = []
        """Taken off the queue, being prefilled; aborts mark them like running jobs."""
        self._paused = False
        self._stopped = False
        self._generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.steps = 0
        """Batched decode forwards run so far (for metrics and tests)."""
        self.max_batch_seen = 0
        self.finished = 0
        """Requests finished so far, aborted ones included."""

    # ---- control (any thread) ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, *jobs: Job) -> None:
        """Queue jobs; the jobs of one call are admitted at the same step boundary."""
        with self._cond:
            self._waiting.extend(jobs)
            self._cond.notify_all()

    def in_flight_rids(self) -> set[str]:
        with self._cond:
            return {j.rid for j in [*self._waiting, *self._admitting, *self._running]}

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._cond:
            return len(self._running), len(self._waiting)

    def abort(self, *, rid: str = "", prefix: bool = False, abort_all: bool = False,
              lora_name: str | None = None, message: str = "aborted by request") -> int:
        """Abort matching requests; queued ones finish now, running ones at the next step."""

        def matches(job: Job) -> bool:
            if abort_all:
                return True
            if lora_name is not None:
                return job.lora_name == lora_name
            return job.rid.startswith(rid) if prefix else job.rid == rid

        with self._cond:
            queued = [j for j in self._waiting if matches(j)]
            for job in queued:
                self._waiting.remove(job)
                job.abort_message = message
                self._finish(job, FinishReason(type="abort", message=message))
            running = [j for j in [*self._admitting, *self._running] if matches(j) and j.finish is None]
            for job in running:
                job.abort_message = message
            self._cond.notify_all()
        return len(queued) + len(running)

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the model between two steps (for LoRA weight changes)."""
        with self._model_lock:
            yield

    # ---- the loop (model thread) ----

    def _has_work(self) -> bool:
        if any(j.abort_message is not None for j in self._running):
            return True
        return not self._paused and bool(self._waiting or self._running)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self._has_work():
                    self._cond.wait()
                if self._stopped:
                    break
            with self._model_lock, torch.no_grad():
                try:
                    self._step()
                except Exception as exc:  # the engine must outlive one bad step
                    logger.exception("decode step failed; failing the running batch")
                    self._fail_running(f"engine error: {type(exc).__name__}: {exc}", error=True)
        self._fail_running("engine shut down")
        with self._cond:
            for job in list(self._waiting):
                self._finish(job, FinishReason(type="abort", message="engine shut down"))
            self._waiting.clear()

    def _step(self) -> None:
        self._drop_aborted()
        if self._paused:
            return
        self._admit()
        if self._batch is not None:
            self._decode_step()

    def _drop_aborted(self) -> None:
        aborted = [j for j in self._running if j.abort_message is not None]
        for job in aborted:
            self._finish(job, FinishReason(type="abort", message=job.abort_message))
        if aborted:
            self._keep_rows([i for i, j in enumerate(self._running) if j.finish is None])

    def _admit(self) -> None:
        with self._cond:
            room = self.config.max_running_requests - len(self._running)
            new = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            self._admitting = list(new)
        if not new:
            return
        zero = [j for j in new if j.params.max_new_tokens == 0]
        for group in _by_prompt_length([j for j in zero if j.prompt_logprobs_from is not None]):
            self._prefill(group)  # for its prompt logprobs only
        for job in zero:
            self._finish(job, FinishReason(type="length"))
        new = [j for j in new if j.params.max_new_tokens > 0]
        if not new:
            self._set_running(self._running)
            return
        parts, logits = [], []
        for group in _by_prompt_length(new):
            cache, last_logits_BV = self._prefill(group)
            parts.append((group, cache))
            logits.append(last_logits_BV)
        self._join(parts)
        self._accept_tokens([job for group, _ in parts for job in group], torch.cat(logits))

    def _prefill(self, jobs: list[Job]) -> tuple[DynamicCache, torch.Tensor]:
        """One forward for prompts of equal length (no padding, so each row's numbers
        are those of its own prompt), whatever slot each row uses."""
        ids_BP = torch.tensor([job.prompt_ids for job in jobs], device=self.config.device)
        positions_BP = torch.arange(ids_BP.shape[1], device=ids_BP.device)[None].expand(len(jobs), -1)
        cache = DynamicCache()
        scored = any(job.prompt_logprobs_from is not None for job in jobs)
        with self._slot_context([job.slot for job in jobs]):
            out = self.model(input_ids=ids_BP, cache=cache, use_cache=True, logits_to_keep=0 if scored else 1,
                             position_ids=positions_BP)
        if scored:
            for job, logits_PV in zip(jobs, out.logits):
                if job.prompt_logprobs_from is not None:
                    _score_prompt(job, logits_PV)
        return out.cache, out.logits[:, -1]

    def _decode_step(self) -> None:
        batch = self._batch
        assert batch is not None, "a decode step runs the running batch"
        last_B1 = torch.tensor([[j.output_ids[-1]] for j in batch.jobs], device=self.config.device)
        ones_B1 = torch.ones_like(last_B1)
        mask_BL = torch.cat([batch.mask_BL, ones_B1], dim=1)
        with self._slot_context([j.slot for j in batch.jobs]):
            out = self.model(input_ids=last_B1, attention_mask=mask_BL, position_ids=batch.next_pos_B[:, None],
                             cache=batch.cache, use_cache=True)
        batch.cache = out.cache
        batch.mask_BL = mask_BL
        batch.next_pos_B = batch.next_pos_B + 1
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch.jobs))
        self._accept_tokens(list(batch.jobs), out.logits[:, -1])

    def _accept_tokens(self, jobs: list[Job], logits_BV: torch.Tensor) -> None:
        """Append one sampled token per job (rows of `logits_BV`), then retire finished rows."""
        tokens, logprobs = choose_tokens(logits_BV, [j.sampling for j in jobs], self._generator)
        for i, job in enumerate(jobs):
            if job.top_logprobs_num > 0:
                job.output_top.append(_top(torch.log_softmax(logits_BV[i].float(), dim=-1), job.top_logprobs_num))
        for job, token, logprob in zip(jobs, tokens, logprobs):
            job.output_ids.append(token)
            job.logprobs.append(logprob)
            reason = self._finish_reason(job, token)
            if reason is not None:
                self._finish(job, reason)
        if any(j.finish is not None for j in self._running):
            self._keep_rows([i for i, j in enumerate(self._running) if j.finish is None])

    def _finish_reason(self, job: Job, token: int) -> FinishReason | None:
        params = job.params
        if token in self.config.eos_token_ids and not params.ignore_eos:
            return FinishReason(type="stop", matched=token)
        if token in (params.stop_token_ids or []):
            return FinishReason(type="stop", matched=token)
        if job.stop_strings:
            text = self._decode(job.output_ids)
            hits = [(text.find(s), s) for s in job.stop_strings if s in text]
            if hits:
                index, stop = min(hits)
                job.text = text[:index]
                return FinishReason(type="stop", matched=stop)
        if len(job.output_ids) >= params.max_new_tokens:
            return FinishReason(type="length")
        if len(job.prompt_ids) + len(job.output_ids) >= self.config.max_context:
            return FinishReason(type="length", message="reached the model's context length")
        return None

    def _finish(self, job: Job, reason: FinishReason) -> None:
        if job.finish is not None:
            return
        if not (reason.type == "stop" and isinstance(reason.matched, str)):
            job.text = self._decode(job.output_ids)
        job.finish = reason
        self.finished += 1
        job.on_done(job)

    def _fail_running(self, message: str, *, error: bool = False) -> None:
        for job in [*self._admitting, *self._running]:
            if error:
                job.error = message
            self._finish(job, FinishReason(type="abort", message=message))
        self._keep_rows([])

    # ---- running-batch bookkeeping (model thread) ----

    def _set_running(self, jobs: list[Job]) -> None:
        with self._cond:
            self._running = jobs
            self._admitting = []

    def _keep_rows(self, rows: list[int]) -> None:
        batch = self._batch
        if not rows or batch is None:
            self._batch = None
            self._set_running([])
            return
        index = torch.tensor(rows, device=self.config.device)
        batch.cache.batch_select_indices(index)
        batch.jobs = [batch.jobs[i] for i in rows]
        batch.mask_BL = batch.mask_BL[index]
        batch.next_pos_B = batch.next_pos_B[index]
        _trim_left_padding(batch)
        self._set_running(list(batch.jobs))

    def _join(self, parts: list[tuple[list[Job], DynamicCache]]) -> None:
        """Add freshly prefilled sequences to the running batch (left-padded merge)."""
        device = self.config.device
        merged = [] if self._batch is None else [(self._batch.cache, self._batch.mask_BL)]
        for jobs, cache in parts:
            merged.append((cache, torch.ones(len(jobs), len(jobs[0].prompt_ids), dtype=torch.long, device=device)))
        width = max(mask.shape[1] for _, mask in merged)
        layers = []
        for layer in range(len(merged[0][0].layers)):
            attention = [_attention(c.layers[layer]) for c, _ in merged]
            keys = [_pad_left(k, width, dim=2) for _, k, _ in attention]
            values = [_pad_left(v, width, dim=2) for _, _, v in attention]
            layers.append((torch.cat(keys), torch.cat(values)))
        mask_BL = torch.cat([_pad_left(m, width, dim=1) for _, m in merged])
        new_jobs = [job for jobs, _ in parts for job in jobs]
        old_jobs = [] if self._batch is None else self._batch.jobs
        next_pos = [] if self._batch is None else self._batch.next_pos_B.tolist()
        next_pos += [len(job.prompt_ids) for job in new_jobs]
        self._batch = _RunningBatch(
            jobs=old_jobs + new_jobs, cache=DynamicCache(ddp_cache_data=layers), mask_BL=mask_BL,
            next_pos_B=torch.tensor(next_pos, device=device),
        )
        self._set_running(list(self._batch.jobs))


def _top(logprobs_V: torch.Tensor, n: int) -> list[tuple[float, int]]:
    """The `n` most likely tokens of one position as (logprob, token id), most likely first."""
    values, ids = torch.topk(logprobs_V, min(n, logprobs_V.shape[-1]))
    return list(zip(values.tolist(), ids.tolist()))


def _score_prompt(job: Job, logits_PV: torch.Tensor) -> None:
    """Fill the job's prompt logprobs from its prefill logits (raw logits, as sampled logprobs)."""
    start = job.prompt_logprobs_from
    assert start is not None
    logprobs_PV = torch.log_softmax(logits_PV[:-1].float(), dim=-1)
    # Row i of logprobs_PV is the distribution over prompt token i + 1.
    targets_P = torch.tensor(job.prompt_ids[1:], device=logits_PV.device)
    picked = logprobs_PV.gather(1, targets_P[:, None])[:, 0].tolist()
    first = max(start, 1)
    job.prompt_logprobs = [None] * (first - start) + picked[first - 1:]
    if job.top_logprobs_num > 0:
        job.prompt_top = [None] * (first - start) + [_top(logprobs_PV[i], job.top_logprobs_num)
                                                     for i in range(first - 1, len(picked))]


def _by_prompt_length(jobs: list[Job]) -> list[list[Job]]:
    """Jobs grouped by prompt length (first-come order within and across groups)."""
    groups: dict[int, list[Job]] = {}
    for job in jobs:
        groups.setdefault(len(job.prompt_ids), []).append(job)
    return list(groups.values())


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _trim_left_padding(batch: _RunningBatch) -> None:
    """Drop leading cache columns that are padding in every row (after rows leave)."""
    real_L = batch.mask_BL.any(dim=0)
    start = int(torch.argmax(real_L.int())) if bool(real_L.any()) else 0
    if start == 0:
        return
    batch.mask_BL = batch.mask_BL[:, start:]
    for cached in batch.cache.layers:
        layer, keys, values = _attention(cached)
        layer.keys = keys[:, :, start:]
        layer.values = values[:, :, start:]


def _attention(cached: object) -> tuple[CacheLayerMixin, torch.Tensor, torch.Tensor]:
    """A filled attention layer of the cache, with its keys and values [B, heads, L, head_dim]."""
    if not isinstance(cached, CacheLayerMixin) or cached.keys is None or cached.values is None:
        raise TypeError(f"the decode scheduler batches filled attention caches only, not {type(cached).__name__}")
    return cached, cached.keys, cached.values
