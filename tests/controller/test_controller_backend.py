"""The backend: resolve → validate → registry, and prefix aborts on the router's workers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from pathlib import Path

import httpx
import pytest

from miles.controller.backend import ControllerHooks, MultiLoRABackend
from miles.controller.registry import AdapterValidationError
from miles.rollout.engines.process import ServerProcess, free_port, on_probed_ports
from miles.rollout.engines.router import build_router_command
from miles.utils.adapter_config import AdapterDefaults, AdapterRunConfig
from miles.utils.arguments import DEFAULT_QUEUE_SIZE
from miles.utils.router_workers import abort_on_workers, discover_workers
from miles.utils.types import AdapterState
from miles.utils.types.lifecycle_ops import FreeSlots, RecordWeightUpdate, RetireAdapters
from tests.helpers.controller_fakes import ROLLOUT_HOOKS, LoopbackRouter, write_dataset
from tests.helpers.waiting import wait_until_async


def make_backend(defaults: AdapterDefaults, router_url: str | None = None, n_slots: int = 2,
                 queue_size: int = DEFAULT_QUEUE_SIZE) -> MultiLoRABackend:
    return MultiLoRABackend(n_slots, defaults, router_url, ROLLOUT_HOOKS, queue_size=queue_size)


async def test_register_resolves_and_validates(data_root: Path, defaults: AdapterDefaults) -> None:
    backend = make_backend(defaults)
    data = str(data_root / "data" / "train.jsonl")
    assert await backend.register("a", config={"data": data, "rank": 2}) == 0
    run = backend.snapshot().pending["a"]
    # --rm-type is not copied into the adapter: it stays the last resort after the sample's metadata.
    assert (run.config.rank, run.config.rollout_batch_size, run.config.rm_type) == (2, 4, None)
    assert run.config.num_step == 1  # 4 rows, 4 groups per step, one epoch
    assert run.config.save == (data_root / "save" / "adapters" / "a").resolve()
    assert backend.registrations_total == 1


class WatchedEvent(asyncio.Event):
    """An event that tells when something waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = asyncio.Event()

    async def wait(self) -> bool:
        self.waited.set()
        return await super().wait()


async def test_wait_for_registration_wakes_at_a_registration(data_root: Path, defaults: AdapterDefaults) -> None:
    backend = make_backend(defaults)
    data = str(data_root / "data" / "train.jsonl")
    assert await backend.wait_for_registration(-1, 60.0) == 0  # already past: answers at once
    backend._registered = registered = WatchedEvent()
    waiting = asyncio.create_task(backend.wait_for_registration(0, 60.0))
    await wait_until_async(registered.waited.is_set, 5, "the long poll to wait for a registration")
    await backend.register("a", config={"data": data})
    async with asyncio.timeout(5):  # woken by the registration, long before its 60 s
        assert await waiting == 1
    assert await backend.wait_for_registration(1, 0.01) == 1  # nothing new: answers after its timeout


async def test_register_from_yaml(data_root: Path, defaults: AdapterDefaults) -> None:
    yaml_path = data_root / "b.yaml"
    yaml_path.write_text(f"data: {data_root / 'data' / 'train.jsonl'}\nnum_step: 3\n")
    backend = make_backend(defaults)
    assert await backend.register("b", yaml_path=str(yaml_path)) == 0
    assert backend.snapshot().pending["b"].config.num_step == 3


@pytest.mark.parametrize("config, words", [
    ({"rm_type": "no_such_reward"}, ["Adapter 'x': reward:", "unknown rm_type 'no_such_reward'"]),
    ({"custom_rm_path": "no_such_module.fn", "rm_type": None}, ["Adapter 'x': reward:", "cannot be imported"]),
    ({"input_key": "prompt"}, ["Adapter 'x': dataset:", "prompt"]),
    ({"rank": 99}, ["Adapter 'x': rank 99 exceeds"]),
])
async def test_validation_failures_leave_the_registry_empty(config: dict, words: list[str], data_root: Path,
                                                      defaults: AdapterDefaults) -> None:
    backend = make_backend(defaults)
    with pytest.raises(AdapterValidationError) as err:
        await backend.register("x", config={"data": str(data_root / "data" / "train.jsonl"), **config})
    for word in words:
        assert word in str(err.value)
    assert backend.registry.free_slots == [0, 1] and backend.registrations_total == 0


async def test_exactly_one_of_config_or_yaml(data_root: Path, defaults: AdapterDefaults) -> None:
    backend = make_backend(defaults)
    for kwargs in [{}, {"config": {"data": "x.jsonl"}, "yaml_path": "x.yaml"}]:
        with pytest.raises(AdapterValidationError, match="exactly one of 'config' or 'yaml_path'"):
            await backend.register("x", **kwargs)


async def test_allowed_roots_cover_yaml_data_and_save(tmp_path: Path, data_root: Path,
                                                      defaults: AdapterDefaults) -> None:
    backend = make_backend(defaults)
    roots = [data_root / "data", data_root / "save"]
    inside = str(data_root / "data" / "train.jsonl")
    outside = write_dataset(tmp_path.parent / f"{tmp_path.name}-outside" / "d.jsonl")
    outside_yaml = outside.parent / "x.yaml"
    outside_yaml.write_text(f"data: {inside}\n")
    cases = [
        ({"config": {"data": str(outside)}}, "data"),
        ({"config": {"data": inside, "save": str(tmp_path / "elsewhere")}}, "save"),
        ({"config": {"data": inside, "save": str(data_root / "save" / ".." / "escape")}}, "save"),
        ({"yaml_path": str(outside_yaml)}, "yaml_path"),
    ]
    for kwargs, what in cases:
        with pytest.raises(AdapterValidationError, match=f"Adapter 'x': {what} .* is outside the allowed roots"):
            await backend.register("x", allowed_roots=roots, **kwargs)
    assert backend.registry.free_slots == [0, 1]
    assert await backend.register("x", config={"data": inside}, allowed_roots=roots) == 0


async def test_subclass_hook_can_reject(data_root: Path, defaults: AdapterDefaults) -> None:
    class SmallRanksOnly(MultiLoRABackend):
        def validate_adapter(self, name: str, config: AdapterRunConfig) -> None:
            super().validate_adapter(name, config)
            if config.rank is not None and config.rank > 4:
                raise AdapterValidationError(f"Adapter '{name}': rank > 4 needs a quota")

    backend = SmallRanksOnly(2, defaults, None, ROLLOUT_HOOKS)
    data = str(data_root / "data" / "train.jsonl")
    with pytest.raises(AdapterValidationError, match="needs a quota"):
        await backend.register("big", config={"data": data, "rank": 8})
    assert await backend.register("small", config={"data": data, "rank": 4}) == 0


class MilesStyleQuota(MultiLoRABackend):
    """A hook as Miles declares it: `async`, awaiting the base class's, refusing with ValueError."""

    seen: list[str]

    async def validate_adapter(self, name, config):
        await super().validate_adapter(name, config)
        await asyncio.sleep(0)  # a real await: the registration waits for the hook's end
        self.seen = [*getattr(self, "seen", []), name]
        if config.rank > 4:
            raise ValueError(f"Adapter '{name}': rank {config.rank} > 4 needs a quota")


async def test_an_async_hook_is_awaited_and_its_value_error_refuses(data_root: Path, defaults: AdapterDefaults,
                                                                    recwarn: pytest.WarningsRecorder) -> None:
    backend = MilesStyleQuota(2, defaults, None, ROLLOUT_HOOKS)
    data = str(data_root / "data" / "train.jsonl")
    with pytest.raises(AdapterValidationError, match="rank 8 > 4 needs a quota"):
        await backend.register("big", config={"data": data, "rank": 8})
    assert backend.seen == ["big"] and backend.registry.free_slots == [0, 1]  # nothing registered
    # The base class's check still runs under the override: an unknown reward is refused.
    with pytest.raises(AdapterValidationError, match="reward"):
        await backend.register("bad-reward", config={"data": data, "rank": 2, "rm_type": "no_such_reward"})
    assert await backend.register("small", config={"data": data, "rank": 4}) == 0
    assert backend.seen == ["big", "small"]  # the base check refused "bad-reward" before the override's own
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


async def test_a_full_registry_refuses_with_a_runtime_error_as_in_miles(data_root: Path,
                                                                       defaults: AdapterDefaults) -> None:
    from miles.controller.registry import NoFreeSlotError

    backend = make_backend(defaults, n_slots=1, queue_size=0)
    data = str(data_root / "data" / "train.jsonl")
    await backend.register("a", config={"data": data})
    try:
        await backend.register("b", config={"data": data})
    except RuntimeError as exc:  # how Miles' callers catch it
        assert isinstance(exc, NoFreeSlotError) and "slot" in str(exc)
    else:
        pytest.fail("a registration beyond the slots was accepted")


async def test_retire_and_free_abort_on_every_worker(data_root: Path, defaults: AdapterDefaults,
                                                     loopback_servers: list[LoopbackRouter]) -> None:
    workers = [LoopbackRouter(mode="none"), LoopbackRouter(mode="none")]
    router = LoopbackRouter(mode="list_workers", workers=[w.url for w in workers])
    loopback_servers.extend([*workers, router])
    backend = make_backend(defaults, router.url)
    data = str(data_root / "data" / "train.jsonl")
    await backend.register("a", config={"data": data})
    await backend.register("b", config={"data": data, "save": str(data_root / "save" / "b2")})
    backend.apply_now(RecordWeightUpdate(["a", "b"]))
    assert backend.deregister("a") is AdapterState.RETIRING
    assert all(w.aborts == [] for w in workers)  # DELETE sends no abort

    assert await backend.apply(RetireAdapters()) == ["a"]
    assert [w.aborts for w in workers] == [[{"rid": "a::", "prefix": True}]] * 2
    assert await backend.apply(FreeSlots(["b"])) == [-1]  # not in CLEANUP: no abort round
    assert await backend.apply(FreeSlots(["a"])) == [0]
    assert [w.aborts for w in workers] == [[{"rid": "a::", "prefix": True}] * 2] * 2
    assert router.aborts == []  # aborts go to the workers, not the router


async def test_worker_listing_falls_back_to_workers_route(loopback_servers: list[LoopbackRouter]) -> None:
    worker = LoopbackRouter(mode="none")
    router = LoopbackRouter(mode="workers", workers=[worker.url.removeprefix("http://")])
    loopback_servers.extend([worker, router])
    assert await abort_on_workers(router.url, "m::") == [worker.url]
    assert worker.aborts == [{"rid": "m::", "prefix": True}]


async def test_failing_workers_are_logged_not_raised(loopback_servers: list[LoopbackRouter],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    good, broken = LoopbackRouter(mode="none"), LoopbackRouter(mode="none", abort_status=500)
    dead = LoopbackRouter(mode="none")
    dead_url = dead.url
    dead.close()
    router = LoopbackRouter(mode="list_workers", workers=[good.url, broken.url, dead_url])
    loopback_servers.extend([good, broken, router])
    with caplog.at_level(logging.WARNING, logger="miles.utils.router_workers"):
        reached = await abort_on_workers(router.url, "a::", timeout_s=2.0)
    assert reached == [good.url]
    assert len(good.aborts) == len(broken.aborts) == 1
    assert "answered HTTP 500" in caplog.text and f"on worker {dead_url} failed" in caplog.text


async def test_empty_or_missing_worker_list_is_logged(loopback_servers: list[LoopbackRouter],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    empty, no_route = LoopbackRouter(mode="list_workers", workers=[]), LoopbackRouter(mode="none")
    loopback_servers.extend([empty, no_route])
    with caplog.at_level(logging.WARNING, logger="miles.utils.router_workers"):
        assert await abort_on_workers(empty.url, "a::") == []
        assert await abort_on_workers(no_route.url, "a::") == []
        assert await abort_on_workers("http://127.0.0.1:1", "a::", timeout_s=1.0) == []
    assert caplog.text.count("nothing to abort for 'a::'") == 3
    assert "Cannot list the workers of router http://127.0.0.1:1" in caplog.text


async def test_without_router_nothing_is_sent(data_root: Path, defaults: AdapterDefaults) -> None:
    backend = make_backend(defaults, router_url=None)
    await backend.register("a", config={"data": str(data_root / "data" / "train.jsonl")})
    backend.deregister("a")
    assert await backend.apply(RetireAdapters()) == ["a"]
    assert await backend.abort_adapter_requests("a") == []
    assert await backend.apply(FreeSlots(["a"])) == [0]


async def test_status_is_json_ready(data_root: Path, defaults: AdapterDefaults) -> None:
    backend = make_backend(defaults)
    await backend.register("a", config={"data": str(data_root / "data" / "train.jsonl"), "metadata": {"k": 1}})
    dumped = json.loads(backend.adapter_status("a").model_dump_json())
    assert dumped["save"] == str((data_root / "save" / "adapters" / "a").resolve())
    assert (dumped["state"], dumped["version"], dumped["metadata"]) == ("PENDING", 0, {"k": 1})


@pytest.mark.slow
async def test_aborts_reach_workers_behind_the_real_sglang_router(data_root: Path, defaults: AdapterDefaults,
                                                                  loopback_servers: list[LoopbackRouter],
                                                                  tmp_path: Path) -> None:
    workers = [LoopbackRouter(mode="none"), LoopbackRouter(mode="none")]
    loopback_servers.extend(workers)
    urls = sorted(w.url for w in workers)

    async def start_router() -> tuple[ServerProcess, str]:
        # The router takes its ports on the command line (it refuses 0): probed ones, and others
        # if a process took one first (`on_probed_ports`). The fake workers have no /health.
        port = free_port()
        command = build_router_command(urls, "127.0.0.1", port, "round_robin", prometheus_port=free_port())
        process = ServerProcess.launch([*command, "--disable-health-check"], log_path=tmp_path / "router.log")
        url = f"http://127.0.0.1:{port}"

        async def lists_both() -> bool:
            if not process.alive():
                raise process.died_error("sglang-router")
            return sorted(await discover_workers(url, client)) == urls

        try:
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
                await wait_until_async(lists_both, 60, "the router to list both workers",
                                       retry_on=(httpx.TransportError,))
        except BaseException:
            process.terminate()
            raise
        return process, url

    router, router_url = await on_probed_ports(start_router, "sglang-router")
    try:
        backend = make_backend(defaults, router_url)
        await backend.register("a", config={"data": str(data_root / "data" / "train.jsonl")})
        backend.deregister("a")
        assert await backend.apply(RetireAdapters()) == ["a"]
        assert [w.aborts for w in workers] == [[{"rid": "a::", "prefix": True}]] * 2
    finally:
        router.terminate()


@pytest.mark.parametrize("extra, rows, expected", [
    ({}, 4, 1),
    ({"num_epoch": 3}, 4, 3),
    ({"num_epoch": 2}, 10, 5),
    ({}, 3, 1),                     # fewer rows than a batch: still one step
    ({"num_step": 7, "num_epoch": 3}, 20, 7),  # num_step wins
])
async def test_num_step_is_fixed_at_registration_from_the_row_count(extra: dict, rows: int, expected: int,
                                                                    data_root: Path, defaults: AdapterDefaults) -> None:
    data = write_dataset(data_root / "data" / f"rows{rows}.jsonl", rows=rows)
    backend = make_backend(defaults)
    await backend.register("a", config={"data": str(data), **extra})
    assert backend.snapshot().pending["a"].config.num_step == expected
    assert backend.adapter_status("a").num_step == expected


async def test_without_a_dataset_hook_num_step_stays_unset(data_root: Path, defaults: AdapterDefaults) -> None:
    backend = MultiLoRABackend(2, defaults, None, ControllerHooks())
    (data_root / "data" / "bad.jsonl").write_text("not json\n")
    assert await backend.register("a", config={"data": str(data_root / "data" / "bad.jsonl")}) == 0
    assert backend.snapshot().pending["a"].config.num_step is None


async def test_reward_hook_sees_the_cli_reward_when_the_adapter_names_none(data_root: Path,
                                                                          defaults: AdapterDefaults) -> None:
    seen: list[tuple] = []
    hooks = ControllerHooks(validate_reward=lambda rm_type, custom: seen.append((rm_type, custom)))
    backend = MultiLoRABackend(2, defaults, None, hooks)
    data = str(data_root / "data" / "train.jsonl")
    await backend.register("a", config={"data": data})
    await backend.register("b", config={"data": data, "rm_type": "f1"})
    assert seen == [("math", None), ("f1", None)]
    assert [r.config.rm_type for r in backend.snapshot().pending.values()] == [None, "f1"]
    no_cli_reward = MultiLoRABackend(2, dataclasses.replace(defaults, rm_type=None), None, ROLLOUT_HOOKS)
    with pytest.raises(AdapterValidationError, match="Adapter 'c': no reward"):
        await no_cli_reward.register("c", config={"data": data})


async def test_dataset_is_read_off_the_event_loop(data_root: Path, defaults: AdapterDefaults) -> None:
    started, release = threading.Event(), threading.Event()
    threads: list[str] = []

    def slow_validate(path: str, input_key: str, label_key: str | None) -> int:
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(timeout=30)
        return 8

    backend = MultiLoRABackend(2, defaults, None, ControllerHooks(validate_dataset=slow_validate))
    registration = asyncio.create_task(backend.register("a", config={"data": str(data_root / "data" / "train.jsonl")}))
    assert await asyncio.to_thread(started.wait, 30)
    # The loop is free while the file is read: other calls run, and nothing is registered yet.
    assert backend.snapshot().all_adapters_cleaned_up and backend.registry.free_slots == [0, 1]
    assert backend.states(["a"]) == {"a": None}
    release.set()
    assert await registration == 0
    assert backend.snapshot().pending["a"].config.num_step == 2
    assert threads and threads[0] != threading.main_thread().name


async def test_a_name_taken_while_the_dataset_was_read_is_refused(data_root: Path, defaults: AdapterDefaults) -> None:
    release = threading.Event()
    reading: list[str] = []

    def validate(path: str, input_key: str, label_key: str | None) -> int:
        reading.append(path)
        return 4 if release.wait(timeout=30) else 0

    backend = MultiLoRABackend(2, defaults, None, ControllerHooks(validate_dataset=validate))
    data = str(data_root / "data" / "train.jsonl")
    first = asyncio.create_task(backend.register("a", config={"data": data}))
    second = asyncio.create_task(backend.register("a", config={"data": data, "save": str(data_root / "s2")}))
    # Both are past their fast checks (the name was free for both), reading the dataset.
    await wait_until_async(lambda: len(reading) == 2, 10, "both registrations to read the dataset")
    release.set()
    results = await asyncio.gather(first, second, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert [r for r in results if r not in errors] == [0] and len(errors) == 1  # either may win the race
    assert isinstance(errors[0], AdapterValidationError) and "already registered" in str(errors[0])
    assert backend.registrations_total == 1 and backend.registry.free_slots == [1]


async def test_prefix_abort_is_a_hook(data_root: Path, defaults: AdapterDefaults) -> None:
    calls: list[tuple[str, str]] = []

    async def record(router_url: str, prefix: str) -> list[str]:
        calls.append((router_url, prefix))
        return ["http://worker"]

    backend = MultiLoRABackend(2, defaults, "http://router", ControllerHooks(abort_prefix=record))
    await backend.register("a", config={"data": str(data_root / "data" / "train.jsonl")})
    backend.deregister("a")
    await backend.apply(RetireAdapters())
    await backend.apply(FreeSlots(["a"]))
    assert calls == [("http://router", "a::")] * 2
