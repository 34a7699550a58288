"""The rollout manager: engines, router, data source, producer and collection in one actor.

    manager = RolloutManager.options(name="miles_rollout_manager").remote(cfg)
    await manager.start.remote(controller)        # engines + router, then the producer
    batch = await manager.generate.remote(rollout_id, snapshot)   # a RolloutBatch
    positions = await manager.data_positions.remote()             # {adapter: DataPosition}
    await manager.dispose.remote()                 # producer, engines, router; idempotent

`RolloutManager` is the Ray actor (`num_cpus=0`: it only waits on I/O);
`LocalRolloutManager` is the same object in-process. Producer and collection run on
the actor's one event loop, so the per-adapter buffers need no lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import ray

from miles.rollout.buffers import AdapterBuffers
from miles.rollout.collection import BatchCollector, CollectionConfig
from miles.rollout.data_source import DataSourceConfig, MultiLoRADataSource
from miles.rollout.producer import ProducerConfig, RolloutProducer
from miles.utils.arguments import MilesConfig
from miles.utils.types import DataPosition, MultiLoRASnapshot, RolloutBatch, SlotPush, UpdateGroupLayout

logger = logging.getLogger(__name__)


class RolloutNotStartedError(RuntimeError):
    """`generate` or an address was asked for before `start()` (or after `dispose()`)."""


class LocalRolloutManager:
    """Owns the engine fleet and everything between the controller and a train batch."""

    def __init__(self, cfg: MilesConfig) -> None:
        if not cfg.hf_checkpoint:
            raise ValueError("the rollout manager needs --hf-checkpoint (the base model directory)")
        self.cfg = cfg
        self._fleet: Any = None
        self._producer: RolloutProducer | None = None
        self._collector: BatchCollector | None = None
        self._source: MultiLoRADataSource | None = None
        self._disposed = False

    async def start(self, controller: Any) -> str:
        """Launch engines and router, then the producer; returns the router URL.

        `controller` is the controller actor handle (anything whose `snapshot` and
        `apply` have an awaitable `.remote()`)."""
        from miles.rollout.engines.fleet import EngineFleet, EngineFleetConfig

        if self._disposed:
            raise RolloutNotStartedError("this rollout manager was disposed; create a new one")
        if self._fleet is not None:
            return self._fleet.router_url
        # The tokenizer loads (importing transformers) while the engines start; if either fails,
        # the other is stopped too.
        if self.cfg.hf_checkpoint is None:
            raise ValueError("the rollout needs the base model: set --hf-checkpoint")
        tokenizer_load = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, self.cfg.hf_checkpoint))
        fleet_start = asyncio.ensure_future(EngineFleet.start(EngineFleetConfig.from_config(
            self.cfg, lora_update=self.cfg.engine_lora_update)))
        try:
            tokenizer, self._fleet = await asyncio.gather(tokenizer_load, fleet_start)
        except BaseException:
            fleet_start.cancel()  # a fleet half started stops its engines
            await asyncio.gather(tokenizer_load, fleet_start, return_exceptions=True)
            if not fleet_start.cancelled() and fleet_start.exception() is None:
                await fleet_start.result().shutdown()
            raise
        buffers = AdapterBuffers()
        self._source = MultiLoRADataSource(DataSourceConfig.from_config(self.cfg), tokenizer)
        self._producer = RolloutProducer(
            ProducerConfig.from_config(self.cfg), router_url=self._fleet.router_url, controller=controller,
            data_source=self._source, buffers=buffers, lora_name=self._fleet.lora_name, reward_args=self.cfg,
            engines_serving=self._fleet.serving,
        )
        self._collector = BatchCollector(CollectionConfig.from_config(self.cfg), buffers, controller,
                                         self._producer)
        self._producer.start()
        logger.info("Rollout manager started: %d engine(s) behind %s", len(self._fleet.engines),
                    self._fleet.router_url)
        return self._fleet.router_url

    async def generate(self, rollout_id: int, snapshot: MultiLoRASnapshot | None = None) -> RolloutBatch:
        """One train batch (raises `EmptyBatchTimeoutError` when nothing arrives in time).

        `snapshot`: the driver's snapshot of this iteration, taken after its weight push;
        without it the controller's current one is read."""
        if self._collector is None or self._producer is None:
            raise RolloutNotStartedError("call start() before generate()")
        batch = await self._collector.collect(rollout_id, snapshot)
        counts = self._producer.generation_counts
        batch.per_adapter = {name: dataclasses.replace(stats, generation=counts(name))
                             for name, stats in batch.per_adapter.items()}
        batch.stats = dataclasses.replace(batch.stats, generation=counts())
        return batch

    def data_positions(self) -> dict[str, DataPosition]:
        """Adapter name -> where its prompt stream continues: the next prompt not yet
        handed to generation. Prompts handed out but not trained by the time of a save
        are not replayed on resume (see `MultiLoRADataSource`)."""
        if self._source is None:
            raise RolloutNotStartedError("call start() before asking for data positions")
        return self._source.positions()

    def restore_data_position(self, name: str, registration_id: str, position: DataPosition) -> None:
        """Continue registration `registration_id` of `name` from `position`: the next
        prompt it generates for is the one an uninterrupted run would have drawn next.
        Call it after registration and before the adapter becomes sampleable (PENDING)."""
        if self._source is None:
            raise RolloutNotStartedError("call start() before restoring a data position")
        self._source.restore(name, registration_id, position)

    def versions_in_flight(self) -> dict[int, int]:
        """Slot -> the oldest slot version a prompt group in flight was stamped with (its
        requests name that version): a versioned push keeps it loaded until then."""
        if self._producer is None:
            raise RolloutNotStartedError("call start() before asking for versions in flight")
        return self._producer.versions_in_flight()

    def update_group_layout(self) -> UpdateGroupLayout:
        """The layout of the engines' weights-update groups."""
        if self._fleet is None:
            raise RolloutNotStartedError("call start() before asking for the weights-update group layout")
        return self._fleet.update_group_layout()

    def record_push(self, *pushes: SlotPush) -> None:
        """The latest push of each slot, kept by the fleet for engines that Ray restarts; the
        pusher calls it (once per push stage) before sending the pushes to the engines."""
        if self._fleet is None:
            raise RolloutNotStartedError("call start() before recording a push")
        self._fleet.record_push(*pushes)

    def forget_slot(self, slot: int) -> None:
        """The slot's adapter left: a restarted engine no longer loads it."""
        if self._fleet is None:
            raise RolloutNotStartedError("call start() before forgetting a slot")
        self._fleet.forget_slot(slot)

    def get_router_address(self) -> str:
        if self._fleet is None:
            raise RolloutNotStartedError("call start() before asking for the router address")
        return self._fleet.router_url

    def engines(self) -> list[Any]:
        """The engine actor handles (weight pushes go to each of them)."""
        if self._fleet is None:
            raise RolloutNotStartedError("call start() before asking for the engines")
        return list(self._fleet.engines)

    async def dispose(self) -> None:
        """Stop the producer, then the engines and the router; safe to call twice."""
        if self._disposed:
            return
        self._disposed = True
        if self._producer is not None:
            await self._producer.stop()
        if self._fleet is not None:
            await self._fleet.shutdown()
        self._producer = self._collector = self._fleet = self._source = None
        logger.info("Rollout manager disposed")


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


RolloutManager = ray.remote(num_cpus=0)(LocalRolloutManager)
