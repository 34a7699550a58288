"""The builtin inference engine behind `builtin_server`: model, LoRA slots, requests.

It loads a Hugging Face causal LM, wraps its linear layers in the slot page table
(`miles.backends.lora`), and turns SGLang-shaped requests into scheduler jobs:

    engine = BuiltinEngine(EngineOptions(model_path="/tmp/tiny", max_loras_per_batch=4, ...))
    engine.start()
    responses = await engine.generate(GenerateRequest(text="1+1=", lora_path="a"))

Every method runs on the server's event loop; model work happens on the scheduler's
thread, LoRA weight writes between two decode steps. Bad input raises
`EngineRequestError` (or a subclass) with a message that says what to fix.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.backends import lora
from miles.rollout.engines.lora_table import LoraRequestError, LoraSlotTable
from miles.rollout.engines.sampling import RowSampling, validate_sampling_params
from miles.rollout.engines.scheduler import DecodeScheduler, Job, SchedulerConfig
from miles.utils.types import (
    AbortRequest,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    LoadLoraRequest,
    SamplingParams,
)

ENGINE_VERSION = "miles-builtin-0.1"


class EngineRequestError(ValueError):
    """A request the engine cannot serve as given (HTTP 400)."""


@dataclass(frozen=True)
class EngineOptions:
    model_path: str
    tokenizer_path: str | None = None
    max_loras_per_batch: int = 8
    """Slots of the LoRA page table (0: no LoRA)."""
    max_lora_rank: int = 16
    lora_target_modules: str = "all-linear"
    lora_paths: tuple[tuple[str, str], ...] = ()
    """(name, PEFT directory) pairs loaded at start."""
    dtype: str = "float32"
    device: str = "cpu"
    max_running_requests: int = 64
    context_length: int | None = None
    random_seed: int = 0


@dataclass
class _Prompt:
    """One prompt of a (possibly batched) /generate request."""

    ids: list[int]
    params: SamplingParams
    lora_name: str | None
    rid: str


class BuiltinEngine:
    def __init__(self, options: EngineOptions):
        self.options = options
        self.device = options.device
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[options.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(options.tokenizer_path or options.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype).to(options.device).eval()
        self.lora_enabled = options.max_loras_per_batch > 0
        if self.lora_enabled:
            lora.inject_multi_lora(self.model, n_slots=options.max_loras_per_batch,
                                   max_rank=options.max_lora_rank, target_modules=options.lora_target_modules)
        self.table = LoraSlotTable(options.max_loras_per_batch)
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context = options.context_length or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.scheduler = DecodeScheduler(
            self.model,
            SchedulerConfig(max_running_requests=options.max_running_requests, max_context=self.max_context,
                            eos_token_ids=self._eos_ids(), device=options.device, seed=options.random_seed),
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            slot_context=(lambda slots: lora.use_slots(self.model, slots)) if self.lora_enabled else None,
        )

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return frozenset(ids)

    async def start(self) -> None:
        self.scheduler.start()
        for name, path in self.options.lora_paths:
            await self.load_lora(LoadLoraRequest(lora_name=name, lora_path=path))

    def stop(self) -> None:
        self.scheduler.stop()

    # ---- generation ----

    async def generate(self, request: GenerateRequest) -> GenerateResponse | list[GenerateResponse]:
        prompts, batched = self._expand(request)
        loop = asyncio.get_running_loop()
        futures, jobs = [], []
        for prompt in prompts:
            future = loop.create_future()
            jobs.append(self._job(prompt, future, loop))
            futures.append(future)
        self.scheduler.submit(*jobs)
        try:
            await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for job in jobs:
                self.scheduler.abort(rid=job.rid, message="client went away")
            raise
        responses = [self._response(job, request.return_logprob) for job in jobs]
        return responses if batched else responses[0]

    def _job(self, prompt: _Prompt, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> Job:
        generator = None
        if prompt.params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(prompt.params.seed)

        def on_done(job: Job) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(job))

        return Job(rid=prompt.rid, prompt_ids=prompt.ids, params=prompt.params,
                   slot=self.table.slot_of(prompt.lora_name), lora_name=prompt.lora_name,
                   sampling=RowSampling.from_params(prompt.params, generator), on_done=on_done)

    def _response(self, job: Job, return_logprob: bool) -> GenerateResponse:
        logprobs = None
        if return_logprob:
            logprobs = [(lp, tok, None) for lp, tok in zip(job.logprobs, job.output_ids)]
        meta = GenerateMetaInfo(id=job.rid, finish_reason=job.finish, prompt_tokens=len(job.prompt_ids),
                                completion_tokens=len(job.output_ids), output_token_logprobs=logprobs)
        return GenerateResponse(text=job.text, output_ids=job.output_ids, meta_info=meta)

    def _expand(self, request: GenerateRequest) -> tuple[list[_Prompt], bool]:
        """Split a single or batched request into validated prompts; raise on bad input."""
        if (request.text is None) == (request.input_ids is None):
            raise EngineRequestError("give exactly one of 'text' or 'input_ids'")
        if request.text is not None:
            batched = isinstance(request.text, list)
            texts = request.text if batched else [request.text]
            all_ids = [self.tokenizer.encode(t) for t in texts]
        else:
            batched = bool(request.input_ids) and isinstance(request.input_ids[0], list)
            all_ids = request.input_ids if batched else [request.input_ids]
        n = len(all_ids)
        if n == 0:
            raise EngineRequestError("the batch is empty: give at least one prompt")
        params = _per_prompt(request.sampling_params, n, "sampling_params")
        loras = _per_prompt(request.lora_path, n, "lora_path")
        rids = self._rids(request.rid, n, batched)
        prompts = []
        for ids, p, name, rid in zip(all_ids, params, loras, rids):
            self._check_prompt(ids, p)
            if name is not None and not self.lora_enabled:
                raise EngineRequestError("this server has no LoRA slots (--max-loras-per-batch 0); send lora_path null")
            self.table.slot_of(name)
            prompts.append(_Prompt(list(ids), p, name, rid))
        return prompts, batched

    def _rids(self, rid: str | list[str] | None, n: int, batched: bool) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(n)]
        if isinstance(rid, str):
            if batched:
                raise EngineRequestError("a batched request needs 'rid' as a list with one id per prompt")
            rids = [rid]
        else:
            rids = list(rid)
        if len(rids) != n:
            raise EngineRequestError(f"'rid' has {len(rids)} ids for {n} prompts: give one per prompt")
        busy = self.scheduler.in_flight_rids()
        clashes = sorted({r for r in rids if r in busy} | {r for r in rids if rids.count(r) > 1})
        if clashes:
            raise EngineRequestError(f"request ids must be unique among in-flight requests: {clashes[:5]} already used")
        return rids

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise EngineRequestError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineRequestError(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_context:
            raise EngineRequestError(f"the prompt has {len(ids)} tokens; the context length is {self.max_context}")
        try:
            validate_sampling_params(params)
        except ValueError as exc:
            raise EngineRequestError(str(exc)) from None

    # ---- abort, pause ----

    def abort(self, request: AbortRequest) -> int:
        if not request.abort_all and not request.rid:
            raise EngineRequestError("give 'rid' (with prefix=true to match a rid prefix) or abort_all=true")
        return self.scheduler.abort(rid=request.rid, prefix=request.prefix, abort_all=request.abort_all)

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise EngineRequestError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        self.scheduler.pause()
        if mode == "abort":
            self.scheduler.abort(abort_all=True, message="generation paused")

    def resume(self) -> None:
        self.scheduler.resume()

    # ---- LoRA ----

    async def load_lora(self, request: LoadLoraRequest) -> dict[str, Any]:
        if not self.lora_enabled:
            raise EngineRequestError("this server has no LoRA slots: start it with --max-loras-per-batch > 0")
        path = Path(request.lora_path)
        if not path.is_dir():
            raise LoraRequestError(f"lora_path {request.lora_path!r} is not a directory on the engine's node")
        slot, fresh = self.table.reserve(request.lora_name, upsert=request.upsert)
        try:
            await asyncio.to_thread(self._write_slot, slot, path)
        except (OSError, ValueError) as exc:
            if fresh:
                await asyncio.to_thread(self._clear_slot, slot)
            self.table.cancel(request.lora_name, fresh=fresh)
            raise LoraRequestError(f"could not load LoRA adapter {request.lora_name!r} from {path}: {exc}") from None
        self.table.commit(request.lora_name, str(path))
        return {"success": True, "error_message": "", "loaded_adapters": self.table.loaded()}

    async def unload_lora(self, name: str) -> dict[str, Any]:
        slot = self.table.remove(name)
        self.scheduler.abort(lora_name=name, message=f"LoRA adapter {name!r} was unloaded")
        await asyncio.to_thread(self._clear_slot, slot)
        self.table.release(slot)
        return {"success": True, "error_message": "", "loaded_adapters": self.table.loaded()}

    def _write_slot(self, slot: int, path: Path) -> None:
        with self.scheduler.exclusive():
            lora.load_peft_adapter(self.model, slot, path)

    def _clear_slot(self, slot: int) -> None:
        with self.scheduler.exclusive():
            lora.clear_slot(self.model, slot)

    # ---- info ----

    def model_info(self) -> dict[str, Any]:
        config = self.model.config
        return {
            "model_path": self.options.model_path,
            "tokenizer_path": self.options.tokenizer_path or self.options.model_path,
            "is_generation": True,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "weight_version": "default",
        }

    def server_info(self) -> dict[str, Any]:
        running, waiting = self.scheduler.counts()
        info = asdict(self.options)
        info.update(version=ENGINE_VERSION, engine="builtin", enable_lora=self.lora_enabled,
                    context_length=self.max_context, loaded_loras=self.table.loaded(),
                    running_requests=running, waiting_requests=waiting, paused=self.scheduler.paused,
                    decode_steps=self.scheduler.steps, max_batch_seen=self.scheduler.max_batch_seen,
                    finished_requests=self.scheduler.finished)
        return info


def _per_prompt(value: Any, n: int, field: str) -> list[Any]:
    """A per-request field as one value per prompt (a list must match the batch)."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise EngineRequestError(f"'{field}' has {len(value)} entries for {n} prompts: give one per prompt or a single value")
    return value
