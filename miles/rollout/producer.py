"""The continuous producer: a background task that keeps prompt groups generating.

Owned by the rollout manager (one per process, shared by every adapter). It polls the
controller's snapshot, keeps up to `--rollout-batch-size` prompt groups in flight
across the sampleable adapters (round robin), and for each group:

1. stamps it at submission with the adapter's slot version and registration id;
2. generates its `n_samples_per_prompt` samples, each with the adapter's generate
   function (`miles.rollout.generate`: one turn by default, a custom multi-turn one by
   `--custom-generate-function-path` or the adapter's `custom_generate_function_path`),
   every request going to the router's `POST /generate` with
   `rid = "<adapter>::<uuid4 hex>"` and `lora_path` = the engine-side name of the
   stamped (slot, version) (`engine_lora_name`), on every turn of the group;
3. drops it whole if any sample was aborted (its adapter was retired meanwhile);
4. rewards every sample (`score_group`: with `--group-rm` an adapter's custom reward scores
   the whole group in one call; `--reward-key` picks the reward of a dict reward), applies
   the optional dynamic filter (drops counted per reason) and rollout sample filter
   (`miles.rollout.filters`), and puts it in the adapter's buffer (`AdapterBuffers`) for
   collection.

A failed group is counted against whoever is at fault:

- the engines, when the transport to them failed (a connection error, an HTTP error
  status, a timeout): after `max_consecutive_failures` such failures in a row the producer
  dies and `raise_if_failed()` re-raises, chained from the cause, at the next collection.
  While no engine serves (every one is restarting), failed groups are dropped without
  counting and no new group is submitted;
- the adapter, for anything else its groups raise (its reward, generate function, dynamic
  filter, prompt), and for groups its dynamic filter drops: past its limits
  (`AdapterHealth`, `--multi-lora-max-consecutive-failures` and `-filtered`) the producer
  gives up on that adapter alone, submits none of its groups any more, and asks the
  controller to fail it (`FailAdapter`: it leaves like a retired adapter and ends FAILED,
  its last error in its status). The other adapters generate on as before.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from miles.rollout.adapter_health import AdapterHealth, AdapterLimits
from miles.rollout.buffers import AdapterBuffers
from miles.rollout.data_source import MultiLoRADataSource, PromptItem
from miles.rollout.filters import (
    DynamicFilter,
    RolloutSampleFilter,
    apply_rollout_sample_filter,
    call_dynamic_filter,
    load_dynamic_filter,
    load_rollout_sample_filter,
)
from miles.rollout.generate import (
    AdapterEngine,
    GenerateFn,
    GenerateFnInput,
    call_generate_function,
    generate_single_turn,
    load_generate_function,
)
from miles.rollout.rewards.evaluate import score_group
from miles.utils.adapter_config import resolved_field
from miles.utils.arguments import MilesConfig
from miles.utils.types import AdapterFailure, AdapterRun, GenerationCounts, MultiLoRASnapshot, PromptGroup
from miles.utils.types.lifecycle_ops import FailAdapter

logger = logging.getLogger(__name__)


class GroupEvent(str, enum.Enum):
    """What happened to a prompt group the producer submitted (counted per adapter)."""

    SUBMITTED = "submitted"
    PRODUCED = "produced"
    """Rewarded and put in its adapter's buffer."""
    ABORTED = "aborted"
    """Dropped whole: a sample was aborted (its adapter was retired meanwhile)."""
    FILTERED = "filtered"
    """Rejected by the dynamic filter."""
    FAILED = "failed"
    """Raised (HTTP or reward error)."""


class ProducerDiedError(RuntimeError):
    """The producer stopped on an error; every adapter's generation has stopped."""


def is_engine_error(exc: BaseException) -> bool:
    """The transport to the engines failed (the engines' fault, not the adapter's): a
    connection or HTTP error from aiohttp, or a timeout."""
    return isinstance(exc, (aiohttp.ClientError, TimeoutError))


@dataclass(frozen=True)
class _Outcome:
    """How a group that raised nothing ended."""

    event: GroupEvent
    """PRODUCED, ABORTED or FILTERED."""
    filter_reason: str | None = None


@dataclass(frozen=True)
class ProducerConfig:
    max_groups_in_flight: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...] = ()
    dynamic_filter_path: str | None = None
    """Default dynamic sampling filter (an adapter's `dynamic_sampling_filter_path` wins)."""
    custom_generate_path: str | None = None
    """Default generate function (an adapter's `custom_generate_function_path` wins)."""
    rollout_sample_filter_path: str | None = None
    snapshot_poll_s: float = 0.1
    """How often the controller's snapshot is re-read (submission stamps lag by at most this)."""
    max_consecutive_failures: int = 8
    """Groups in a row whose transport to the engines failed before the producer dies."""
    adapter_limits: AdapterLimits = AdapterLimits()
    """Bad groups in a row of one adapter before it is given up (default: no limit; the
    trainer passes `--multi-lora-max-consecutive-failures` and `-filtered`)."""
    buffer_steps: int | None = 1
    """Stop submitting for an adapter once its buffered plus in-flight groups cover this
    many of its optimizer steps (None: only `max_groups_in_flight` limits it)."""
    group_rm: bool = False
    """`--group-rm`: an adapter's custom reward scores the whole group in one call."""
    reward_key: str | None = None
    """`--reward-key`: the key of a dict reward (e.g. `dapo`'s "score") that is the reward."""

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> ProducerConfig:
        return cls(
            max_groups_in_flight=cfg.rollout_batch_size,
            max_new_tokens=cfg.rollout_max_response_len,
            temperature=cfg.rollout_temperature,
            top_p=cfg.rollout_top_p,
            top_k=cfg.rollout_top_k,
            stop=tuple(cfg.rollout_stop),
            dynamic_filter_path=cfg.dynamic_sampling_filter_path,
            custom_generate_path=cfg.custom_generate_function_path,
            rollout_sample_filter_path=cfg.rollout_sample_filter_path,
            buffer_steps=cfg.rollout_buffer_steps,
            group_rm=cfg.group_rm,
            reward_key=cfg.reward_key,
            adapter_limits=AdapterLimits(max_failures=cfg.multi_lora_max_consecutive_failures,
                                         max_filtered=cfg.multi_lora_max_consecutive_filtered),
        )

    def sampling_params(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": list(self.stop) or None,
        }


def make_http_client() -> aiohttp.ClientSession:
    # aiohttp, not httpx: at hundreds of concurrent short requests per second httpx's
    # pool costs ~10x more CPU per request, which made the producer the bottleneck.
    # Generation can take minutes on CPU, so only connecting is bounded; loopback
    # traffic must not go through a proxy from the environment.
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
        trust_env=False,
    )


class RolloutProducer:
    """Background generation for every sampleable adapter (see the module docstring)."""

    def __init__(
        self,
        config: ProducerConfig,
        *,
        router_url: str,
        controller: Any,
        data_source: MultiLoRADataSource,
        buffers: AdapterBuffers,
        lora_name: Callable[[int, int], str],
        reward_args: Any,
        client: aiohttp.ClientSession | None = None,
        engines_serving: Callable[[], bool] | None = None,
    ) -> None:
        """`engines_serving`: whether any engine behind the router takes requests now (the
        fleet's `serving`); while none does, no group is submitted and failed groups do not
        count toward `max_consecutive_failures` (new groups take their place once one is back)."""
        self.config = config
        self.router_url = router_url.rstrip("/")
        self.controller = controller
        self.data_source = data_source
        self.buffers = buffers
        self.lora_name = lora_name
        self.reward_args = reward_args
        self._client = client
        self._owns_client = client is None
        self._engines_serving = engines_serving or (lambda: True)
        # Plug-ins are loaded (and checked) here, so a bad flag fails at start; an
        # adapter's own paths are loaded at its first group (checked at registration).
        self._generate_fns: dict[str | None, GenerateFn] = {None: generate_single_turn}
        self._filters: dict[str | None, DynamicFilter | None] = {None: None}
        self._generate_fn(None)
        self._dynamic_filter(None)
        self._sample_filter: RolloutSampleFilter | None = (
            load_rollout_sample_filter(config.rollout_sample_filter_path)
            if config.rollout_sample_filter_path else None)
        self._task: asyncio.Task[None] | None = None
        self._cursor = 0
        self._snapshot = MultiLoRASnapshot()
        self._snapshot_at = float("-inf")
        self._served: set[str] = set()
        """Registration ids seen ACTIVE (pushed to the engines) and still sampleable."""
        self._consecutive_failures = 0
        """Groups in a row whose transport to the engines failed."""
        self.health = AdapterHealth(config.adapter_limits)
        """Each adapter's run of failed or dropped groups; the adapters given up."""
        self.failure: BaseException | None = None
        self.counts: Counter[tuple[str, GroupEvent]] = Counter()
        """Cumulative (adapter, event) counts."""
        self.filter_drops: Counter[tuple[str, str]] = Counter()
        """Cumulative (adapter, reason) counts of groups the dynamic filter dropped."""
        self.in_flight: Counter[str] = Counter()
        """Groups submitted and not finished, per adapter."""
        self._stamps_in_flight: Counter[tuple[int, int]] = Counter()
        """Groups in flight per stamped (slot, version)."""

    # ---- lifecycle ----

    def start(self) -> None:
        if self._client is None:  # created here: a session belongs to the running loop
            self._client = make_http_client()
        if self._task is None:
            self._task = asyncio.create_task(self._run_until_failure(), name="rollout-producer")

    async def stop(self) -> None:
        """Cancel generation and wait for it; idempotent."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.data_source.close()
        if self._owns_client and self._client is not None and not self._client.closed:
            await self._client.close()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ProducerDiedError(
                f"the rollout producer died ({type(self.failure).__name__}: {self.failure}); "
                "no adapter is generating any more"
            ) from self.failure

    async def _run_until_failure(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # recorded and re-raised by raise_if_failed()
            self.failure = exc
            logger.exception("The rollout producer died; the next generate call will raise")

    # ---- the loop ----

    async def _run(self) -> None:
        in_flight: dict[asyncio.Task[_Outcome], AdapterRun] = {}
        try:
            while True:
                snapshot = await self._refresh_snapshot()
                self.data_source.sync(snapshot)
                if self._engines_serving():
                    self._submit(snapshot, in_flight)
                if not in_flight:
                    await asyncio.sleep(self.config.snapshot_poll_s)
                    continue
                done, _ = await asyncio.wait(in_flight, timeout=self.config.snapshot_poll_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    await self._settle(task, in_flight.pop(task))
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _refresh_snapshot(self) -> MultiLoRASnapshot:
        # The producer runs while the driver trains, so it reads the registry itself
        # instead of waiting for the driver's next snapshot: a retirement must stop new
        # submissions, and a push must stamp new groups with the new version, within one
        # poll interval.
        now = time.monotonic()
        if now - self._snapshot_at >= self.config.snapshot_poll_s:
            self._snapshot = await self.controller.snapshot.remote()
            self._snapshot_at = now
            # A RETIRING adapter is sampled only if it was seen ACTIVE: one deregistered while
            # PENDING was never pushed, so the engines hold no weights for its slot.
            retiring = {run.registration_id for run in self._snapshot.retiring.values()}
            self._served = {run.registration_id for run in self._snapshot.active.values()} | (self._served & retiring)
            self.health.forget_runs({run.registration_id for run in self._snapshot.sampleable.values()})
        return self._snapshot

    def _submit(self, snapshot: MultiLoRASnapshot, in_flight: dict[asyncio.Task[_Outcome], AdapterRun]) -> None:
        runs = [run for _, run in sorted(snapshot.sampleable.items())
                if run.registration_id in self._served and not self.health.gave_up(run.registration_id)
                and self.data_source.ready(run)]
        ahead = Counter(self.buffers.queue_lengths()) + self.in_flight
        while len(in_flight) < self.config.max_groups_in_flight:
            # Backpressure: an adapter whose next steps are already covered waits, so its
            # groups are generated by recent weights instead of piling up stale.
            runs = [run for run in runs if not self._covered(run, ahead[run.name])]
            if not runs:
                return
            run = runs[self._cursor % len(runs)]
            self._cursor += 1
            ahead[run.name] += 1
            in_flight[asyncio.create_task(self._produce_counted(run), name=f"group-{run.name}")] = run
            self.counts[run.name, GroupEvent.SUBMITTED] += 1

    def _covered(self, run: AdapterRun, groups_ahead: int) -> bool:
        steps = self.config.buffer_steps
        return steps is not None and groups_ahead >= steps * resolved_field(run.config.rollout_batch_size,
                                                                            "rollout_batch_size")

    async def _settle(self, task: asyncio.Task[_Outcome], run: AdapterRun) -> None:
        exc = task.exception()
        if exc is None:
            self._consecutive_failures = 0
            outcome = task.result()
            if outcome.event is GroupEvent.PRODUCED:
                self.health.kept(run)
            elif outcome.event is GroupEvent.FILTERED:
                await self._give_up(run, self.health.filtered(run, outcome.filter_reason or ""))
            return
        if not self._engines_serving():
            logger.info("Prompt group dropped while no engine serves (%s: %s)", type(exc).__name__, exc)
            return
        if not is_engine_error(exc):  # the adapter's own plug-ins or prompt: it alone pays
            await self._give_up(run, self.health.failed(run, exc))
            return
        self._consecutive_failures += 1
        logger.warning("Prompt group failed (%d in a row): %s: %s", self._consecutive_failures,
                       type(exc).__name__, exc)
        if self._consecutive_failures >= self.config.max_consecutive_failures:
            raise exc
        await asyncio.sleep(min(2.0, 0.05 * 2 ** self._consecutive_failures))

    async def _give_up(self, run: AdapterRun, failure: AdapterFailure | None) -> None:
        """The adapter reached its limit (`failure` set): the controller fails it, which also
        aborts its requests in flight. Nothing of it is submitted from now on either way."""
        if failure is not None:
            await self.controller.apply.remote(FailAdapter(run.name, run.registration_id, failure))

    def gave_up(self, registration_id: str) -> bool:
        """The producer generates nothing more for this registration (it is being failed)."""
        return self.health.gave_up(registration_id)

    def count(self, event: GroupEvent, adapter: str | None = None) -> int:
        """How many groups (of `adapter`, or of all) met `event` since start."""
        return sum(n for (name, e), n in self.counts.items() if e == event and adapter in (None, name))

    # ---- plug-ins ----

    def _generate_fn(self, run: AdapterRun | None) -> GenerateFn:
        path = (run.config.custom_generate_function_path if run else None) or self.config.custom_generate_path
        if path is not None and path not in self._generate_fns:  # None: the built-in single turn
            self._generate_fns[path] = load_generate_function(path)
        return self._generate_fns[path]

    def _dynamic_filter(self, run: AdapterRun | None) -> DynamicFilter | None:
        path = (run.config.dynamic_sampling_filter_path if run else None) or self.config.dynamic_filter_path
        if path is not None and path not in self._filters:  # None: no filter
            self._filters[path] = load_dynamic_filter(path)
        return self._filters[path]

    def _stamped_lora_name(self, run: AdapterRun) -> str | None:
        """The engine-side name of the version `run`'s group was stamped with (so its staleness is exact
        and every turn uses the weights of that version); None once the registration is no longer sampleable."""
        now = self._snapshot.sampleable.get(run.name)
        if now is None or now.registration_id != run.registration_id or self.health.gave_up(run.registration_id):
            return None
        return self.lora_name(run.slot, run.version)

    def versions_in_flight(self) -> dict[int, int]:
        """Slot -> the oldest version a group in flight was stamped with (its requests still use it)."""
        oldest: dict[int, int] = {}
        for (slot, version), n in self._stamps_in_flight.items():
            if n > 0:
                oldest[slot] = min(version, oldest.get(slot, version))
        return oldest

    # ---- one group ----

    async def _produce_counted(self, run: AdapterRun) -> _Outcome:
        self.in_flight[run.name] += 1
        stamp = (run.slot, run.version)
        self._stamps_in_flight[stamp] += 1
        try:
            # Drawn inside the task so a prompt that cannot be rendered fails this group only.
            return await self._produce(run, self.data_source.next_prompt(run))
        except Exception:
            self.counts[run.name, GroupEvent.FAILED] += 1
            raise
        finally:
            self.in_flight[run.name] -= 1
            self._stamps_in_flight[stamp] -= 1
            if not self._stamps_in_flight[stamp]:
                del self._stamps_in_flight[stamp]

    async def _produce(self, run: AdapterRun, item: PromptItem) -> _Outcome:
        # Stamped now, at submission: staleness counts pushes since the request left.
        group = PromptGroup(adapter=run.name, slot=run.slot, version=run.version,
                            registration_id=run.registration_id,
                            samples=item.new_samples(resolved_field(run.config.n_samples_per_prompt,
                                                                    "n_samples_per_prompt")))
        generate = self._generate_fn(run)
        if self._client is None:
            raise RuntimeError("the producer generates only between start() and stop()")
        engine = AdapterEngine(self._client, self.router_url, run.name, lambda: self._stamped_lora_name(run))
        results = await asyncio.gather(
            *(call_generate_function(generate, GenerateFnInput(args=self.reward_args, sample=s, engine=engine,
                                                               sampling_params=self.config.sampling_params(),
                                                               tokenizer=self.data_source.tokenizer))
              for s in group.samples),
            return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        group.samples = [r for r in results if not isinstance(r, BaseException)]
        if group.aborted:
            self.counts[run.name, GroupEvent.ABORTED] += 1
            return _Outcome(GroupEvent.ABORTED)
        rewards = await score_group(item.reward, self.reward_args, group.samples, group_rm=self.config.group_rm,
                                    reward_key=self.config.reward_key)
        for sample, reward in zip(group.samples, rewards):
            sample.reward = reward
        if (dynamic_filter := self._dynamic_filter(run)) is not None:
            verdict = await call_dynamic_filter(dynamic_filter, self.reward_args, group.samples)
            if not verdict.keep:
                assert verdict.reason is not None, "call_dynamic_filter names the reason of every drop"
                self.counts[run.name, GroupEvent.FILTERED] += 1
                self.filter_drops[run.name, verdict.reason] += 1
                return _Outcome(GroupEvent.FILTERED, verdict.reason)
        if self._sample_filter is not None:
            apply_rollout_sample_filter(self._sample_filter, self.reward_args, group.samples)
        self.buffers.put(group)
        self.counts[run.name, GroupEvent.PRODUCED] += 1
        return _Outcome(GroupEvent.PRODUCED)

    def _filter_drops_by_reason(self, adapter: str | None) -> dict[str, int]:
        by_reason: Counter[str] = Counter()
        for (name, reason), n in self.filter_drops.items():
            if adapter in (None, name):
                by_reason[reason] += n
        return dict(sorted(by_reason.items()))

    def generation_counts(self, adapter: str | None = None) -> GenerationCounts:
        """One adapter's counters (all adapters' together when `adapter` is None)."""
        def total(counter: Counter[str]) -> int:
            return sum(n for name, n in counter.items() if adapter in (None, name))

        return GenerationCounts(
            submitted=self.count(GroupEvent.SUBMITTED, adapter),
            produced=self.count(GroupEvent.PRODUCED, adapter),
            aborted=self.count(GroupEvent.ABORTED, adapter),
            filtered=self.count(GroupEvent.FILTERED, adapter),
            filtered_by_reason=self._filter_drops_by_reason(adapter),
            failed=self.count(GroupEvent.FAILED, adapter),
            in_flight=total(self.in_flight),
            overflow_dropped=total(self.buffers.overflow_drops),
        )

