"""The builtin inference engine behind `builtin_server`: model, LoRA slots, requests.

It loads a Hugging Face causal LM, wraps its linear layers in the slot page table
(`miles.lora`), and turns SGLang-shaped requests into scheduler jobs:

    engine = BuiltinEngine(EngineOptions(model_path="/tmp/tiny", max_loras_per_batch=4, ...))
    engine.start()
    responses = await engine.generate(GenerateRequest(text="1+1=", lora_path="a"))

Every method runs on the server's event loop; model work happens on the scheduler's
thread, LoRA weight writes between two decode steps. Bad input raises
`EngineRequestError` (or a subclass) with a message that says what to fix.

LoRA semantics follow `lora_update`:
- `in_place`: `/load_lora_adapter` takes `upsert`, and `/load_lora_adapter_from_distributed`
  receives an adapter's tensors by broadcast over a group joined with
  `/init_weights_update_group` (gloo on CPU). An upsert swaps the slot's weights
  between two decode steps: a request in flight across a push decodes its remaining
  tokens with the new weights (over a KV cache the old ones wrote), so a group stamped
  with version v at submission holds tokens of v or later, never older.
- `versioned`: as SGLang 0.5 does: no upsert (loading a loaded name is HTTP 400
  "... already loaded") and no broadcast load.
Either way, as SGLang: unloading stops new requests for the name at once, waits for
the requests already using it to finish, then frees the slot; an unknown name is 400.

Eviction and reload (`max_loaded_loras`), as SGLang since sgl-project/sglang#11526
(October 2025): loading past the limit first evicts the least recently used adapter
that is not pinned, and a `/generate` naming an adapter that was evicted reloads it from
the directory it was loaded from before serving it (evicting another if need be). A
name never loaded, or unloaded explicitly, is not reloaded: 400 "... not loaded". This
is what keeps immutable sampler snapshots (Tinker's `save_weights_for_sampler`) servable
in a bounded number of slots. Two choices of ours on top: an adapter received by
broadcast (`in_place` slot pushes of server-driven RL) is never evicted, since there is
no directory to bring it back from; and among evictable adapters an idle one (no request
in flight) goes before a busy one, whose eviction would wait for its requests.
SGLang before #11526 refused a load past `--max-loaded-loras` ("Maximum number of loaded
LoRA adapters is N ...") and answered a request for an unloaded adapter with 400;
its `--lora-eviction-policy lru|fifo` only chooses which loaded adapter leaves the GPU
pool of `--max-loras-per-batch` buffers, which clients never see. The sampler
(`miles.controller.tinker.sampler`) works with both: on "not loaded" it loads by path and retries.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup
from transformers import AutoModelForCausalLM, AutoTokenizer
from typing_extensions import TypeIs

from miles import lora
from miles.lora import weight_sync
from miles.rollout.engines.lora_table import LoraRequestError, LoraSlotTable
from miles.rollout.engines.sampling import RowSampling, validate_sampling_params
from miles.rollout.engines.scheduler import DecodeScheduler, Job, SchedulerConfig
from miles.utils.types import (
    AbortRequest,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoraFromDistributedRequest,
    LoadLoraRequest,
    LoraUpdateMode,
    SamplingParams,
)

ENGINE_VERSION = "miles-builtin-0.1"


DISTRIBUTED_LORA_PATH = "__distributed__"
MAX_SPARE_BUFFERS = 8
"""Flat receive buffers kept between broadcast pushes (one per layout: dtype and size)."""
"""What `loaded_adapters` shows for an adapter received by broadcast."""


class EngineRequestError(ValueError):
    """A request the engine cannot serve as given (HTTP 400)."""


class EngineInternalError(RuntimeError):
    """The engine failed a request itself (a decode step raised); answered as HTTP 500."""


class WeightsUpdateGroupError(EngineRequestError):
    """Joining, using or leaving a weights-update group failed (HTTP 400, SGLang's `{success, message}`)."""


@dataclass(frozen=True)
class EngineOptions:
    model_path: str
    tokenizer_path: str | None = None
    max_loras_per_batch: int = 8
    """Slots of the LoRA page table (0: no LoRA)."""
    max_loaded_loras: int | None = None
    """As SGLang's `--max-loaded-loras`: past it, a load evicts the least recently used adapter.
    The page table has max(max_loras_per_batch, max_loaded_loras) slots."""
    lora_update: LoraUpdateMode = "in_place"
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
    logprob_start_len: int | None = None
    """First prompt position whose logprob is returned; None: no prompt logprobs."""
    top_logprobs_num: int = 0


class BuiltinEngine:
    def __init__(self, options: EngineOptions):
        self.options = options
        self.device = options.device
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[options.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(options.tokenizer_path or options.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype)
        module: torch.nn.Module = self.model  # `Module.to` and `eval` move and switch it in place
        module.to(options.device).eval()
        self.lora_enabled = options.max_loras_per_batch > 0
        n_slots = max(options.max_loras_per_batch, options.max_loaded_loras or 0) if self.lora_enabled else 0
        if self.lora_enabled:
            lora.inject_multi_lora(self.model, n_slots=n_slots,
                                   max_rank=options.max_lora_rank, target_modules=options.lora_target_modules)
        self.table = LoraSlotTable(n_slots, upsert_allowed=options.lora_update == "in_place")
        self._lora_lock: asyncio.Lock | None = None
        """Serializes loads and unloads (SGLang's `lora_update_lock`); made on the server's loop."""
        self._uses: Counter[str] = Counter()
        """LoRA name -> /generate prompts using it that have not finished."""
        self._uses_changed: asyncio.Condition | None = None
        self._groups: dict[str, ProcessGroup] = {}
        self._spare_buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        """Flat receive buffers of earlier broadcast pushes, free to take (a push of the same
        layout reuses one instead of faulting in fresh pages)."""
        """Weights-update groups joined, by name."""
        self.lora_loads: Counter[str] = Counter()
        """LoRA name -> times its weights were written into a slot (loads and reloads)."""
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context = options.context_length or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.scheduler = DecodeScheduler(
            self.model,
            SchedulerConfig(max_running_requests=options.max_running_requests, max_context=self.max_context,
                            eos_token_ids=self._eos_ids(), device=options.device, seed=options.random_seed),
            decode=self._decode,
            slot_context=(lambda slots: lora.use_slots(self.model, slots)) if self.lora_enabled else None,
        )

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not isinstance(text, str):
            raise TypeError(f"the tokenizer decoded one sequence into {type(text).__name__}, not text")
        return text

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return frozenset(ids)

    @property
    def _loras_locked(self) -> asyncio.Lock:
        """Held while a LoRA loads or unloads (made by `start`, on the server's loop)."""
        if self._lora_lock is None:
            raise RuntimeError("the engine serves only after start()")
        return self._lora_lock

    @property
    def _uses_condition(self) -> asyncio.Condition:
        """Notified when `_uses` drops (made by `start`, on the server's loop)."""
        if self._uses_changed is None:
            raise RuntimeError("the engine serves only after start()")
        return self._uses_changed

    async def start(self) -> None:
        self._lora_lock = asyncio.Lock()
        self._uses_changed = asyncio.Condition()
        self.scheduler.start()
        for name, path in self.options.lora_paths:
            await self.load_lora(LoadLoraRequest(lora_name=name, lora_path=path))

    def stop(self) -> None:
        self.scheduler.stop()
        for group in self._groups.values():
            weight_sync.leave_update_group(group)
        self._groups.clear()

    # ---- generation ----

    async def generate(self, request: GenerateRequest) -> GenerateResponse | list[GenerateResponse]:
        prompts, batched = self._expand(request)
        await self._ensure_loaded([p.lora_name for p in prompts if p.lora_name is not None])
        # No await from here to `_uses.update`: an eviction cannot slip in between.
        loop = asyncio.get_running_loop()
        futures, jobs = [], []
        for prompt in prompts:
            future = loop.create_future()
            jobs.append(self._job(prompt, future, loop))
            futures.append(future)
        names = [p.lora_name for p in prompts if p.lora_name is not None]
        self._uses.update(names)
        self.scheduler.submit(*jobs)
        try:
            await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for job in jobs:
                self.scheduler.abort(rid=job.rid, message="client went away")
            raise
        finally:
            self._uses.subtract(names)
            async with self._uses_condition:
                self._uses_condition.notify_all()
        failed = next((job.error for job in jobs if job.error is not None), None)
        if failed is not None:
            raise EngineInternalError(failed)
        responses = [self._response(job, request.return_logprob) for job in jobs]
        return responses if batched else responses[0]

    def _job(self, prompt: _Prompt, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> Job:
        generator = None
        if prompt.params.request_seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(prompt.params.request_seed)

        def on_done(job: Job) -> None:
            def settle() -> None:
                if not future.done():
                    future.set_result(job)

            loop.call_soon_threadsafe(settle)

        return Job(rid=prompt.rid, prompt_ids=prompt.ids, params=prompt.params,
                   slot=self.table.slot_of(prompt.lora_name), lora_name=prompt.lora_name,
                   sampling=RowSampling.from_params(prompt.params, generator), on_done=on_done,
                   prompt_logprobs_from=prompt.logprob_start_len, top_logprobs_num=prompt.top_logprobs_num)

    def _response(self, job: Job, return_logprob: bool) -> GenerateResponse:
        assert job.finish is not None, "a job is answered once it finished"
        meta = GenerateMetaInfo(id=job.rid, finish_reason=job.finish, prompt_tokens=len(job.prompt_ids),
                                completion_tokens=len(job.output_ids))
        if return_logprob:
            meta.output_token_logprobs = [(lp, tok, None) for lp, tok in zip(job.logprobs, job.output_ids)]
            start = job.prompt_logprobs_from
            if start is not None:
                meta.input_token_logprobs = [(lp, tok, None) for lp, tok in
                                             zip(job.prompt_logprobs, job.prompt_ids[start:])]
            if job.top_logprobs_num > 0:
                meta.output_top_logprobs = [_top_triples(top) for top in job.output_top]
                if start is not None:
                    meta.input_top_logprobs = [_top_triples(top) for top in job.prompt_top]
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
            assert request.input_ids is not None  # exactly one of the two (checked above)
            batched = _is_batch(request.input_ids)
            all_ids = request.input_ids if _is_batch(request.input_ids) else [request.input_ids]
        n = len(all_ids)
        if n == 0:
            raise EngineRequestError("the batch is empty: give at least one prompt")
        params = _per_prompt(request.sampling_params, n, "sampling_params")
        loras = _per_prompt(request.lora_path, n, "lora_path")
        starts = _per_prompt(request.logprob_start_len, n, "logprob_start_len")
        tops = _per_prompt(request.top_logprobs_num, n, "top_logprobs_num")
        rids = self._rids(request.rid, n, batched)
        prompts = []
        for ids, p, name, rid, start, top in zip(all_ids, params, loras, rids, starts, tops):
            self._check_prompt(ids, p)
            if name is not None and not self.lora_enabled:
                raise EngineRequestError("this server has no LoRA slots (--max-loras-per-batch 0); send lora_path null")
            if name is not None and not self.table.is_known(name):
                self.table.slot_of(name)  # raises SGLang's "... not loaded" error
            if start >= len(ids):
                raise EngineRequestError(f"logprob_start_len {start} is past the prompt's {len(ids)} tokens: "
                                         "give -1 (no prompt logprobs) or a prompt position")
            if top < 0:
                raise EngineRequestError(f"top_logprobs_num must be >= 0, got {top}")
            want_logprobs = request.return_logprob
            prompts.append(_Prompt(list(ids), p, name, rid,
                                   logprob_start_len=start if want_logprobs and start >= 0 else None,
                                   top_logprobs_num=top if want_logprobs else 0))
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
        self._require_lora()
        path = Path(request.lora_path)
        if not path.is_dir():
            raise LoraRequestError(f"lora_path {request.lora_path!r} is not a directory on the engine's node")
        try:
            tensors, config = await asyncio.to_thread(lora.read_peft_dir, path)
        except (OSError, ValueError) as exc:
            raise LoraRequestError(f"could not read LoRA adapter {request.lora_name!r} from {path}: {exc}") from None
        return await self._load(request.lora_name, tensors, config, source=str(path), upsert=request.upsert,
                                pinned=request.pinned)

    async def load_lora_from_distributed(self, request: LoadLoraFromDistributedRequest) -> dict[str, Any]:
        """Receive an adapter's tensors by broadcast, then load them like a PEFT directory."""
        self._require_lora()
        group = self._groups.get(request.group_name)
        if group is None:
            raise WeightsUpdateGroupError(f"no weights-update group {request.group_name!r} on this server "
                                          f"(joined: {sorted(self._groups)}); call /init_weights_update_group first")
        # Receive before any check that could refuse: a rank that skips a broadcast would
        # leave the sender and every other engine waiting on the group.
        taken: list[torch.Tensor] = []

        def buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
            spare = self._spare_buffers.pop((dtype, numel), None)
            taken.append(torch.empty(numel, dtype=dtype, device=self.device) if spare is None else spare)
            return taken[-1]

        try:
            try:
                tensors = await asyncio.to_thread(weight_sync.receive_tensors, group, request.names, request.dtypes,
                                                  request.shapes, device=self.device,
                                                  bucketed=request.flattened_bucket, buffer=buffer)
            except (RuntimeError, ValueError) as exc:
                raise WeightsUpdateGroupError(f"receiving LoRA {request.lora_name!r} over group "
                                              f"{request.group_name!r} failed: {exc}") from None
            if request.added_tokens_config:
                raise LoraRequestError(f"LoRA adapter {request.lora_name} adds tokens to the vocabulary, which the "
                                       "slot page table does not support")
            return await self._load(request.lora_name, tensors, request.config_dict, source=DISTRIBUTED_LORA_PATH,
                                    upsert=request.upsert, pinned=request.pinned)
        finally:  # the slot holds copies: the buffers are free for the next push
            for flat in taken:
                if len(self._spare_buffers) < MAX_SPARE_BUFFERS:
                    self._spare_buffers[(flat.dtype, flat.numel())] = flat

    async def _load(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], *, source: str,
                    upsert: bool, pinned: bool) -> dict[str, Any]:
        async with self._loras_locked:
            await self._load_locked(name, tensors, config, source=source, upsert=upsert, pinned=pinned)
            return self._lora_result()

    async def _load_locked(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], *,
                           source: str, upsert: bool, pinned: bool) -> None:
        limit = self.options.max_loaded_loras
        if limit is not None and not self.table.is_loaded(name):
            while len(self.table) >= limit:
                victim = self._eviction_victim()
                if victim is None:
                    raise LoraRequestError(
                        f"cannot load LoRA adapter {name}: all {limit} loaded adapters are pinned or were received "
                        "by broadcast (which cannot be reloaded); unload one or raise --max-loaded-loras")
                await self._unload_locked(victim, evict=True)
        slot, fresh = self.table.reserve(name, upsert=upsert, pinned=pinned)
        try:
            await asyncio.to_thread(self._write_slot, slot, tensors, config, source)
        except (OSError, ValueError) as exc:
            if fresh:
                await asyncio.to_thread(self._clear_slot, slot)
            self.table.cancel(name, fresh=fresh)
            raise LoraRequestError(f"could not load LoRA adapter {name!r} from {source}: {exc}") from None
        self.table.commit(name, source)
        self.lora_loads[name] += 1

    def _eviction_victim(self) -> str | None:
        """The adapter to evict for room: least recently used, reloadable, idle before busy."""
        loaded = self.table.loaded()
        candidates = [n for n in self.table.eviction_order() if loaded[n] != DISTRIBUTED_LORA_PATH]
        idle = [n for n in candidates if self._uses[n] <= 0]
        pool = idle or candidates
        return pool[0] if pool else None

    async def _ensure_loaded(self, names: list[str]) -> None:
        """Reload the evicted adapters among `names` (a request's), evicting others for room."""
        for _ in range(3):
            missing = [n for n in dict.fromkeys(names) if not self.table.is_loaded(n)]
            if not missing:
                return
            async with self._loras_locked:
                for name in missing:
                    if self.table.is_loaded(name):
                        continue
                    path = self.table.evicted_path(name)
                    if path is None:  # unloaded explicitly while this request waited
                        self.table.slot_of(name)  # raises SGLang's "... not loaded" error
                        continue
                    try:
                        tensors, config = await asyncio.to_thread(lora.read_peft_dir, path)
                    except (OSError, ValueError) as exc:
                        raise LoraRequestError(f"could not reload evicted LoRA adapter {name!r} from {path}: "
                                               f"{exc}") from None
                    await self._load_locked(name, tensors, config, source=path, upsert=False, pinned=False)
        raise LoraRequestError(f"the request names {len(set(names))} LoRA adapters, more than fit at once "
                               f"(--max-loaded-loras {self.options.max_loaded_loras}); send fewer per request")

    async def unload_lora(self, name: str) -> dict[str, Any]:
        self._require_lora()
        async with self._loras_locked:
            await self._unload_locked(name)
            return self._lora_result()

    async def _unload_locked(self, name: str, *, evict: bool = False) -> None:
        # New requests for `name` fail (or, evicted, reload it) from here on.
        slot = self.table.evict(name) if evict else self.table.remove(name)
        if slot is None:  # an evicted name, forgotten
            return
        async with self._uses_condition:
            await self._uses_condition.wait_for(lambda: self._uses[name] <= 0)
        del self._uses[name]
        await asyncio.to_thread(self._clear_slot, slot)
        self.table.release(slot)

    def _lora_result(self) -> dict[str, Any]:
        return {"success": True, "error_message": "", "loaded_adapters": self.table.loaded()}

    def _require_lora(self) -> None:
        if not self.lora_enabled:
            raise EngineRequestError("LoRA is not enabled: start the server with --max-loras-per-batch > 0")

    # ---- weights-update groups ----

    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> dict[str, Any]:
        expected = "nccl" if self.device == "cuda" else "gloo"
        if request.backend != expected:
            raise WeightsUpdateGroupError(f"backend {request.backend!r} cannot move tensors on {self.device}; "
                                          f"use {expected!r}")
        if request.group_name in self._groups:
            raise WeightsUpdateGroupError(f"weights-update group {request.group_name!r} is already joined; "
                                          "destroy it first")
        spec = weight_sync.UpdateGroupSpec(master_address=request.master_address, master_port=request.master_port,
                                           world_size=request.world_size, group_name=request.group_name,
                                           backend=request.backend)
        try:
            group = await asyncio.to_thread(weight_sync.join_update_group, spec, request.rank_offset)
        except (RuntimeError, ValueError) as exc:
            raise WeightsUpdateGroupError(f"could not join weights-update group {request.group_name!r} at "
                                          f"{request.master_address}:{request.master_port}: {exc}") from None
        self._groups[request.group_name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        group = self._groups.pop(group_name, None)
        if group is None:
            raise WeightsUpdateGroupError(f"no weights-update group {group_name!r} on this server")
        await asyncio.to_thread(weight_sync.leave_update_group, group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _write_slot(self, slot: int, tensors: dict[str, torch.Tensor], config: dict[str, Any], source: str) -> None:
        with self.scheduler.exclusive():
            lora.load_peft_tensors(self.model, slot, tensors, config, source=source)

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
                    evicted_loras=self.table.evicted(), lora_loads=dict(self.lora_loads),
                    weights_update_groups=sorted(self._groups),
                    running_requests=running, waiting_requests=waiting, paused=self.scheduler.paused,
                    decode_steps=self.scheduler.steps, max_batch_seen=self.scheduler.max_batch_seen,
                    finished_requests=self.scheduler.finished)
        return info


def _top_triples(top: list[tuple[float, int]] | None) -> list[tuple[float, int, str | None]] | None:
    """SGLang's shape of one position's top logprobs: (logprob, token_id, token_text or None)."""
    return None if top is None else [(lp, tok, None) for lp, tok in top]


def _is_batch(input_ids: list[int] | list[list[int]]) -> TypeIs[list[list[int]]]:
    """`input_ids` holds a batch of prompts (not one prompt's ids)."""
    return bool(input_ids) and isinstance(input_ids[0], list)


def _per_prompt(value: Any, n: int, field: str) -> list[Any]:
    """A per-request field as one value per prompt (a list must match the batch)."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise EngineRequestError(f"'{field}' has {len(value)} entries for {n} prompts: "
                                 "give one per prompt or a single value")
    return value
