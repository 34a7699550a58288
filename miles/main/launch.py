"""Start and stop everything a trainer needs: Ray, the controller, engines, train ranks.

Both drivers (`train_multi_lora_async`, `train_async`) enter `trainer_run(cfg)`, which
launches the components and, however the loop ends, saves every loaded adapter, stops
every process and flushes the metrics and the `--dump-details` writer; the drivers
themselves hold only their loops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from miles.backends.base import TrainingBackend
from miles.main.engine_push import EnginePusher
from miles.main.progress import RunProgress, make_view
from miles.main.registration_checks import controller_hooks
from miles.main.rollout_dump import RolloutDump
from miles.main.stages import Stages
from miles.utils.arguments import MilesConfig
from miles.utils.tracking import MetricsLogger

logger = logging.getLogger(__name__)

T = TypeVar("T")


def configure_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("MILES_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpcore", "uvicorn.access", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def init_ray(cfg: MilesConfig) -> None:
    """Join the cluster this job was submitted to (RAY_ADDRESS), else start a Ray instance
    of its own, even when another one runs on this machine (RAY_ADDRESS=auto joins a
    cluster started with `ray start`)."""
    if ray.is_initialized():
        return
    env = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace="miles", runtime_env={"env_vars": env})
        return
    # Logical CPUs: the actors are mostly idle waiting on each other, so a small
    # machine still fits one train rank per DP worker plus the engines.
    workers, engines = cfg.actor_num_workers, cfg.rollout_num_engines
    assert workers is not None and engines is not None, "MilesConfig resolves both"
    train_ranks = workers * (cfg.tensor_model_parallel_size if cfg.train_backend == "megatron" else 1)
    needed = train_ranks * cfg.actor_num_cpus_per_worker + engines + 2
    ray.init(
        address="local",
        namespace="miles",
        num_cpus=max(os.cpu_count() or 1, needed),
        include_dashboard=False,
        runtime_env={"env_vars": env},
    )


@dataclass
class Components:
    controller: Any
    """MultiLoRAController actor handle."""
    rollout_manager: Any
    """RolloutManager actor handle."""
    backend: TrainingBackend
    """The training backend (a `TrainGroup` over its rank actors)."""
    stages: Stages
    """The loop's stages over the three above."""


async def launch(cfg: MilesConfig) -> Components:
    """The controller (it owns the adapter registry) and the train ranks start while the
    rollout manager's process starts; once the controller serves, the engines and router."""
    from miles.controller.actor import create_multilora_controller
    from miles.rollout.manager import RolloutManager

    rollout_manager: Any = RolloutManager.options(name="miles_rollout_manager").remote(cfg)  # a Ray handle
    backend = build_backend(cfg)
    # Train ranks load the base model meanwhile, and later while the engines load it.
    backend_start = asyncio.ensure_future(backend.start())
    try:
        controller = await asyncio.to_thread(create_multilora_controller, cfg, router_url=None,
                                             hooks=controller_hooks(cfg))  # logs its URL
        # A registry restored from --save: nothing is sampled before this trainer pushed it.
        await controller.requeue_for_new_trainer.remote()
        await asyncio.gather(rollout_manager.start.remote(controller), backend_start)
    except BaseException:
        backend_start.cancel()
        await asyncio.gather(backend_start, return_exceptions=True)
        raise
    router_url = await rollout_manager.get_router_address.remote()
    await controller.set_router_url.remote(router_url)
    pusher = EnginePusher(backend, await rollout_manager.engines.remote(), rollout_manager,
                          mode=cfg.engine_lora_update)
    stages = Stages.build(backend, controller, rollout_manager, pusher=pusher, save_interval=cfg.save_interval,
                          overlap_push=cfg.overlap_weight_push, client_wait_s=cfg.multi_lora_idle_poll_s,
                          idle_evict_s=cfg.multi_lora_idle_evict_s)
    logger.info("Router at %s", router_url)
    return Components(controller, rollout_manager, backend, stages)


def build_backend(cfg: MilesConfig) -> TrainingBackend:
    """The training backend `--train-backend` names (ranks not started yet)."""
    if cfg.train_backend == "megatron":
        from miles.backends.megatron.train_group import MegatronGroupConfig, megatron_train_group

        return megatron_train_group(MegatronGroupConfig.from_config(cfg))
    from miles.backends.common.train_group import TrainGroupConfig
    from miles.backends.torch.train_group import torch_train_group

    return torch_train_group(TrainGroupConfig.from_config(cfg))


async def register_initial_adapters(cfg: MilesConfig, controller: Any) -> None:
    """Register the adapters named on the command line; a bad one stops the run."""
    for name, yaml_path in cfg.initial_adapters:
        slot = await controller.register_adapter.remote(name, yaml_path=yaml_path)
        where = f"in slot {slot}" if slot is not None else "QUEUED (every slot is held)"
        logger.info("Registered adapter %r from %s %s", name, yaml_path, where)


async def shutdown(components: Components) -> None:
    """Save every loaded adapter (with its data position), then stop rollout, ranks, controller."""
    logger.info("Shutting down: saving adapters, stopping rollout")
    try:
        await components.stages.slots.save_all()
    finally:
        try:
            await components.rollout_manager.dispose.remote()
        finally:
            await components.backend.shutdown()
            await components.controller.stop.remote()


def install_stop_handlers(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set `stop`; the loop finishes its stage and shuts down cleanly (a generate
    stage waiting for groups is cancelled at once: `unless_stopped`)."""
    loop = asyncio.get_running_loop()

    def request_stop(signum: int) -> None:
        if stop.is_set():
            logger.warning("Second %s: exiting without waiting", signal.Signals(signum).name)
            os._exit(130)
        logger.warning("%s received: finishing the current stage, then shutting down",
                       signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop, signum)


async def sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep, but wake at once when a stop is requested."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


async def unless_stopped(call: Awaitable[T], stop: asyncio.Event) -> T | None:
    """`call`'s answer, or None as soon as a stop is requested: then the call is cancelled
    and awaited (a Ray actor call with `ray.cancel`, which cancels an async actor's method
    where it waits, e.g. a collection waiting for groups)."""
    task = asyncio.ensure_future(call)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            return task.result()
    finally:
        stopped.cancel()
        if not task.done() or stop.is_set():  # stopped, or this wait itself was cancelled
            task.cancel()
            if isinstance(call, ray.ObjectRef):
                ray.cancel(call)
            await asyncio.gather(task, return_exceptions=True)
    return None


@dataclass
class TrainerRun:
    """What a driver loop works with."""

    components: Components
    stop: asyncio.Event
    """Set by SIGINT/SIGTERM: finish the current stage, then leave the loop."""
    progress: RunProgress


@asynccontextmanager
async def trainer_run(cfg: MilesConfig) -> AsyncIterator[TrainerRun]:
    """Launch everything; however the loop ends, save adapters and stop every process."""
    init_ray(cfg)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    components = await launch(cfg)
    metrics = MetricsLogger.from_config(cfg)
    dump = RolloutDump.from_config(cfg)
    progress = RunProgress(metrics, view=make_view(), controller=components.controller, dump=dump,
                           latest_checkpoint=components.backend.latest_checkpoint)
    try:
        yield TrainerRun(components, stop, progress)
    finally:
        progress.close()
        try:
            await shutdown(components)
        finally:
            metrics.close()
            if dump is not None:
                dump.close()
    progress.print_summary()
