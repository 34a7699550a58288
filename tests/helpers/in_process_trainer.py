"""One trainer process's components in-process, with no Ray: the fake backend and rollout
manager of `lifecycle_fakes` around the real controller, the real stages and loop.

    t = Trainer(tmp_path)
    await t.register("a")
    await t.run_until_idle()
"""

from __future__ import annotations

import asyncio
import json

from miles.main import train_multi_lora_async
from miles.main.launch import Components
from miles.main.progress import RunProgress
from miles.main.stages import Stages
from miles.utils.arguments import MilesConfig
from miles.utils.tracking import MetricsLogger
from tests.helpers.lifecycle_fakes import (
    FakeBackend,
    FakeRollout,
    InProcessController,
    InProcessHandle,
    RecordingPusher,
)


class Trainer:
    """The components of one trainer process (the disk outlives it)."""

    def __init__(self, tmp_path, disk=None, n_slots=2, overlap_push=False, rollout_cls=FakeRollout):
        data = tmp_path / "data.jsonl"
        data.write_text(json.dumps({"text": "1+1=", "label": "2"}) + "\n")
        self.data = str(data)
        self.controller = InProcessController(n_slots, rollout_batch_size=2, n_samples_per_prompt=2,
                                              rm_type="math", save=str(tmp_path / "save"))
        handle = InProcessHandle(self.controller)
        self.rollout = rollout_cls(handle)
        self.receiver = RecordingPusher()
        self.backend = FakeBackend(disk={} if disk is None else disk)
        self.stages = Stages.build(self.backend, handle, InProcessHandle(self.rollout), save_interval=1,
                                   pusher=self.receiver, overlap_push=overlap_push)
        self.components = Components(handle, InProcessHandle(self.rollout), self.backend, self.stages)
        self.metrics = MetricsLogger(tmp_path / "run")
        self.progress = RunProgress(self.metrics)

    async def register(self, name, **config):
        await self.controller.register_adapter(name, config={"data": self.data, **config})

    async def run_until_idle(self):
        cfg = MilesConfig(multi_lora_n_adapters=2, multi_lora_disable_service_mode=True)
        await train_multi_lora_async.run_loop(cfg, self.components, asyncio.Event(), self.progress)

    def pushes(self, slot):
        return [(version, weights) for pushed_slot, version, weights in self.receiver.pushes if pushed_slot == slot]

    def status(self, name):
        return self.controller.backend.adapter_status(name)

    def snapshot(self):
        """The registry's snapshot now."""
        return self.controller.backend.snapshot()
