"""Turning buffered prompt groups into one train batch with exact per-adapter accounting.

`BatchCollector.collect(rollout_id, snapshot)` is the body of
`RolloutManager.generate` (DESIGN §8). It acts on one snapshot, the driver's (or the
controller's, read once when none is given; adapter state only changes between
generate calls), then:

1. discards the buffers of adapters no longer sampleable;
2. pops round robin across adapters (the cursor persists across batches), one
   multiple of `min_groups_per_dp_split` per turn, never beyond an adapter's remaining
   groups for its current step. `_drop_unusable` is the one place a live adapter's
   groups are dropped, and every drop is counted per adapter and `DropReason`: stale
   groups and foreign ones (stamped with another registration of the name, e.g.
   stragglers of a re-registered adapter). It runs for every adapter when collection
   starts and again before each look at a buffer, for groups that arrive meanwhile;
3. stops at `global_batch_size` samples, or when a non-empty batch made no progress for
   `max_coalesce_wait_s`, or when no adapter can contribute any more; with nothing
   after `max_empty_wait_s` it raises `EmptyBatchTimeoutError`. An adapter the producer
   gave up on (its groups fail, `ProducerHealth.gave_up`) is never waited for, even
   within this collection's snapshot: with only such adapters left it raises at once;
4. orders samples by (slot, group, index) and calls
   `controller.apply(RecordBatch(rollout_id, groups, step_names))`.

Plain Python: the controller is anything whose methods have an awaitable `.remote()`
(a Ray actor handle, or a test fake) and the clock is injectable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Protocol

from miles.rollout.buffers import AdapterBuffers
from miles.utils.adapter_config import min_groups_per_dp_split, resolved_field
from miles.utils.arguments import MilesConfig
from miles.utils.types import (
    AdapterRolloutStats,
    AdapterRun,
    DropReason,
    MultiLoRASnapshot,
    PromptGroup,
    RolloutBatch,
    RolloutStats,
    SampleStatus,
)
from miles.utils.types.lifecycle_ops import RecordBatch

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.01


class EmptyBatchTimeoutError(RuntimeError):
    """No group could be collected within `--multi-lora-max-empty-wait-s`."""


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class ProducerHealth(Protocol):
    def raise_if_failed(self) -> None:
        """Raise (chained from the cause) if the producer has died."""

    def gave_up(self, registration_id: str) -> bool:
        """The producer generates nothing more for this registration (it is being failed)."""


@dataclass(frozen=True)
class CollectionConfig:
    global_batch_size: int
    """Target samples per train batch."""
    dp_size: int
    """Trainer data-parallel size (what `min_groups_per_dp_split` divides by)."""
    max_weight_staleness: int | None
    max_coalesce_wait_s: float
    max_empty_wait_s: float

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> CollectionConfig:
        assert cfg.global_batch_size is not None and cfg.actor_num_workers is not None, "MilesConfig resolves both"
        return cls(
            global_batch_size=cfg.global_batch_size,
            dp_size=cfg.actor_num_workers,
            max_weight_staleness=cfg.max_weight_staleness,
            max_coalesce_wait_s=cfg.multi_lora_max_coalesce_wait_s,
            max_empty_wait_s=cfg.multi_lora_max_empty_wait_s,
        )


def _samples_per_group(run: AdapterRun) -> int:
    return resolved_field(run.config.n_samples_per_prompt, "n_samples_per_prompt")


def remaining_groups(run: AdapterRun) -> int:
    """Groups still needed to complete the adapter's current step."""
    return resolved_field(run.config.rollout_batch_size, "rollout_batch_size") - run.accumulated_groups


@dataclass
class _Batch:
    """Groups taken so far for the batch being collected."""

    groups: list[PromptGroup]
    per_adapter: Counter[str]
    n_samples: int = 0

    def add(self, taken: list[PromptGroup]) -> None:
        for group in taken:
            self.groups.append(group)
            self.per_adapter[group.adapter] += 1
            self.n_samples += len(group.samples)


class BatchCollector:
    """Pops train batches from the adapter buffers; owns the round-robin cursor."""

    def __init__(
        self,
        config: CollectionConfig,
        buffers: AdapterBuffers,
        controller: Any,
        producer: ProducerHealth,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.buffers = buffers
        self.controller = controller
        self.producer = producer
        self.clock = clock or MonotonicClock()
        self._rotation: deque[str] = deque()
        self.drops: Counter[tuple[str, DropReason]] = Counter()
        """Groups dropped per (adapter, reason) since the last batch was returned."""

    async def collect(self, rollout_id: int, snapshot: MultiLoRASnapshot | None = None) -> RolloutBatch:
        """One batch for `rollout_id`. `snapshot` is the driver's snapshot of this
        iteration, taken after its weight push (versions and accumulated groups only
        change through the driver, so it is exact); without one the controller is asked."""
        started = self.clock.now()
        self.producer.raise_if_failed()
        if snapshot is None:
            snapshot = await self.controller.snapshot.remote()
        adapters = snapshot.sampleable
        self._sync_adapters(adapters)
        for run in adapters.values():
            self._drop_unusable(run)
        batch = await self._fill(adapters, started)
        step_names = sorted(
            name for name, count in batch.per_adapter.items() if count == remaining_groups(adapters[name])
        )
        per_adapter, stats = self._stats(batch, adapters, step_names, self.clock.now() - started)
        await self.controller.apply.remote(RecordBatch(rollout_id, dict(batch.per_adapter), step_names))
        return self._assemble(rollout_id, batch, step_names, per_adapter, stats)

    def _sync_adapters(self, adapters: dict[str, AdapterRun]) -> None:
        """Forget the buffers of adapters no longer sampleable; keep the cursor's order."""
        for name in self.buffers.names():
            if name not in adapters:
                dropped = self.buffers.discard(name)
                logger.info("Adapter %r is no longer sampleable; dropped %d buffered groups", name, dropped)
        self._rotation = deque(name for name in self._rotation if name in adapters)
        self._rotation.extend(sorted(set(adapters) - set(self._rotation)))

    async def _fill(self, adapters: dict[str, AdapterRun], started: float) -> _Batch:
        batch = _Batch(groups=[], per_adapter=Counter())
        target = self.config.global_batch_size
        last_progress = started
        while batch.n_samples < target:
            self.producer.raise_if_failed()
            if not batch.groups and not self._generating(adapters):
                raise EmptyBatchTimeoutError(
                    f"No adapter to collect from: the producer gave up on every sampleable adapter "
                    f"({', '.join(sorted(adapters))}); they leave as FAILED, see their status"
                )
            taken = self._take_turn(adapters, batch)
            if taken:
                batch.add(taken)
                last_progress = self.clock.now()
                continue
            if batch.groups and self._exhausted(adapters, batch):
                break
            waited = self.clock.now() - last_progress
            if batch.groups and waited >= self.config.max_coalesce_wait_s:
                break
            if not batch.groups and waited >= self.config.max_empty_wait_s:
                raise EmptyBatchTimeoutError(
                    f"No poppable groups collected before empty timeout ({self.config.max_empty_wait_s}s): "
                    f"every sampleable adapter is below min_groups_per_dp_split or still generating. "
                    f"queue={self.buffers.queue_lengths()} sampleable={sorted(adapters)}"
                )
            await self.clock.sleep(POLL_INTERVAL_S)
        return batch

    def _generating(self, adapters: dict[str, AdapterRun]) -> dict[str, AdapterRun]:
        """The adapters whose groups may still come (those the producer gave up on never will)."""
        return {name: run for name, run in adapters.items() if not self.producer.gave_up(run.registration_id)}

    def _unit(self, run: AdapterRun) -> int:
        return min_groups_per_dp_split(_samples_per_group(run), self.config.dp_size)

    def _take_turn(self, adapters: dict[str, AdapterRun], batch: _Batch) -> list[PromptGroup]:
        """One round-robin turn: the first adapter (from the cursor) that can give a unit."""
        for _ in range(len(self._rotation)):
            name = self._rotation[0]
            self._rotation.rotate(-1)
            run = adapters[name]
            if self.producer.gave_up(run.registration_id):
                continue
            self._drop_unusable(run)
            unit = self._unit(run)
            buffer = self.buffers.get(name)
            if len(buffer) < unit or remaining_groups(run) - batch.per_adapter[name] < unit:
                continue
            unit_samples = unit * _samples_per_group(run)
            # A unit bigger than the whole target still ships alone, or it never could.
            if batch.groups and batch.n_samples + unit_samples > self.config.global_batch_size:
                continue
            return buffer.pop(unit)
        return []

    def _exhausted(self, adapters: dict[str, AdapterRun], batch: _Batch) -> bool:
        """True when no adapter could add a unit however long we waited."""
        room = self.config.global_batch_size - batch.n_samples
        for name, run in self._generating(adapters).items():
            unit = self._unit(run)
            if (remaining_groups(run) - batch.per_adapter[name] >= unit
                    and unit * _samples_per_group(run) <= room):
                return False
        return True

    def _drop_unusable(self, run: AdapterRun) -> None:
        """Drop and count the groups of `run`'s buffer that must never be trained on."""
        max_staleness = self.config.max_weight_staleness

        def reason(group: PromptGroup) -> DropReason | None:
            if group.registration_id != run.registration_id:
                return DropReason.FOREIGN
            if max_staleness is not None and run.trainer_version - group.version > max_staleness:
                return DropReason.STALE
            return None

        dropped = Counter(why for g in self.buffers.get(run.name).drop_where(lambda g: reason(g) is not None)
                          if (why := reason(g)) is not None)
        for why, count in dropped.items():
            self.drops[run.name, why] += count
        if dropped[DropReason.FOREIGN]:
            logger.warning("Adapter %r: dropped %d groups of a previous registration", run.name,
                           dropped[DropReason.FOREIGN])

    @staticmethod
    def _assemble(rollout_id: int, batch: _Batch, step_names: list[str],
                  per_adapter: dict[str, AdapterRolloutStats], stats: RolloutStats) -> RolloutBatch:
        groups = sorted(batch.groups, key=lambda g: (g.slot, g.samples[0].group_index))
        samples = [s for g in groups for s in sorted(g.samples, key=lambda s: s.index)]
        return RolloutBatch(
            rollout_id=rollout_id,
            samples=samples,
            prompt_group_sizes=[len(g.samples) for g in groups],
            groups_per_adapter=dict(batch.per_adapter),
            step_names=step_names,
            per_adapter=per_adapter,
            stats=stats,
            group_versions=[g.version for g in groups],
        )

    def _stats(self, batch: _Batch, adapters: dict[str, AdapterRun], step_names: list[str],
               wait_s: float) -> tuple[dict[str, AdapterRolloutStats], RolloutStats]:
        """This batch's numbers; the drop counts restart with the next batch."""
        queues = self.buffers.queue_lengths()
        per_adapter = {}
        for name, run in adapters.items():
            groups = [g for g in batch.groups if g.adapter == name]
            samples = [s for g in groups for s in g.samples]
            per_adapter[name] = AdapterRolloutStats(
                groups=len(groups),
                rewards=tuple(s.reward for s in samples),
                response_lengths=tuple(s.effective_response_length for s in samples),
                truncated=sum(1 for s in samples if s.status is SampleStatus.TRUNCATED),
                uniform_group_rewards=tuple(g.samples[0].reward for g in groups if _uniform_rewards(g)),
                log_prob_means=tuple(sum(s.rollout_log_probs) / len(s.rollout_log_probs)
                                     for s in samples if s.rollout_log_probs),
                staleness=tuple(run.trainer_version - g.version for g in groups),
                queue_length=queues.get(name, 0),
                dropped={why: self.drops[name, why] for why in DropReason},
            )
        totals: Counter[DropReason] = Counter()
        for (_, why), count in self.drops.items():
            totals[why] += count
        stats = RolloutStats(
            batch_wait_time=wait_s,
            batch_n_adapters=len(batch.per_adapter),
            batch_n_groups=len(batch.groups),
            batch_n_samples=batch.n_samples,
            batch_n_adapters_to_step=len(step_names),
            queue_length=sum(queues.values()),
            dropped={why: totals[why] for why in DropReason},
        )
        self.drops.clear()
        return per_adapter, stats


def _uniform_rewards(group: PromptGroup) -> bool:
    """Two or more samples, one reward (a zero-std group: no learning signal)."""
    rewards = [s.reward for s in group.samples]
    return len(rewards) > 1 and all(r == rewards[0] for r in rewards)
