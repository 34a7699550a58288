"""The multi-LoRA backend: the registry plus what has side effects around it.

`register` resolves and validates an adapter (config, `validate_adapter` hook, the dataset
read once off the event loop) before the registry takes it; `apply(op)` runs any other
lifecycle transition (`miles/utils/types/lifecycle_ops.py`, run by `lifecycle.py`),
aborting the requests it names on every worker behind the router, and writes the rows it
changed through to the store.
Subclass it (`--multi-lora-backend-path`) to add checks: override `validate_adapter`,
`async def` or plain, raising `ValueError` to refuse a registration with a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from miles.controller import lifecycle
from miles.controller.registry import (
    AdapterRegistry,
    AdapterRegistryError,
    AdapterValidationError,
)
from miles.controller.store import RegistryStore
from miles.utils.adapter_config import (
    AdapterConfigError,
    AdapterDefaults,
    AdapterRunConfig,
    check_plugin_modules,
    check_within_roots,
    config_from_mapping,
    parse_adapter_run_yaml,
    resolve_adapter_config,
    resolve_num_step,
    resolved_field,
    validate_adapter_name,
)
from miles.utils.arguments import DEFAULT_QUEUE_SIZE
from miles.utils.router_workers import abort_on_workers
from miles.utils.types import (
    AdapterGauges,
    AdapterState,
    AdapterStatus,
    ClientModelConfig,
    MultiLoRASnapshot,
    adapter_rid_prefix,
)
from miles.utils.types.lifecycle_ops import AbortingTransition, Transition

if TYPE_CHECKING:
    from miles.utils.arguments import MilesConfig

logger = logging.getLogger(__name__)

R = TypeVar("R")

DatasetValidator = Callable[[str, str, "str | None"], int]
"""`(path, input_key, label_key) -> row count`; ValueError saying what is wrong with the file."""
RewardValidator = Callable[["str | None", "str | None"], None]
"""`(rm_type, custom_rm_path)`; ValueError if no reward function can be found from them."""
PluginValidator = Callable[["str | None", "str | None"], None]
"""`(custom_generate_function_path, dynamic_sampling_filter_path)`; ValueError unless each is
callable as the rollout calls it."""
PrefixAbort = Callable[[str, str], Awaitable[list[str]]]
"""`(router_url, rid_prefix) -> worker URLs reached`; best effort, never raises."""


@dataclass(frozen=True)
class ControllerHooks:
    """What the controller is handed at launch instead of importing rollout or engine code.

    Plain module-level functions, so the hooks travel to the controller's Ray actor."""

    validate_dataset: DatasetValidator | None = None
    """Runs in a worker thread at registration; None: the dataset is not read."""
    validate_reward: RewardValidator | None = None
    """None: only "some reward is set (adapter or CLI)" is checked."""
    validate_plugins: PluginValidator | None = None
    """None: the generate function and filter are only checked to exist."""
    abort_prefix: PrefixAbort = abort_on_workers


class _Checked:
    """What the base `validate_adapter` returns: its check has already run, and awaiting it
    (as an `async` override does with `await super().validate_adapter(...)`) gives None."""

    def __await__(self) -> Generator[None, None, None]:
        yield from ()  # ends at once


_CHECKED = _Checked()

MAX_DATASET_BYTES = 2 * 1024**3
DATASET_TIMEOUT_S = 120.0
MAX_CONCURRENT_DATASET_CHECKS = 4


class ControlPlaneBusyError(AdapterRegistryError):
    """Every dataset-check worker is busy; retry shortly (HTTP 429)."""


@dataclass(frozen=True)
class DatasetLimits:
    """Bounds on reading a dataset at registration; each refusal is a 400 that says which."""

    max_bytes: int = MAX_DATASET_BYTES
    timeout_s: float = DATASET_TIMEOUT_S
    max_concurrent: int = MAX_CONCURRENT_DATASET_CHECKS
    """Registrations reading a dataset at once; one more is refused with 429."""


@dataclass(frozen=True)
class BackendArgs:
    """The `args` of Miles' form, `(args, router_url)` (`MultiLoRABackend.from_miles_args`): the
    trainer's flags under Miles' names (`args.lora_rank`, `args.save`, ...) and what the
    controller hands every backend."""

    flags: MilesConfig
    hooks: ControllerHooks = field(default_factory=lambda: ControllerHooks())
    store: RegistryStore | None = None
    dataset_limits: DatasetLimits = field(default_factory=lambda: DatasetLimits())

    def backend_kwargs(self, router_url: str | None) -> BackendKwargs:
        """Our constructor's arguments, from these."""
        return BackendKwargs(
            n_slots=self.flags.multi_lora_n_adapters, defaults=AdapterDefaults.from_config(self.flags),
            router_url=router_url, hooks=self.hooks, store=self.store, dataset_limits=self.dataset_limits,
            queue_size=self.flags.multi_lora_queue_size)

    def __getattr__(self, name: str) -> Any:  # only for names the dataclass does not have
        if name.startswith("__") or name == "flags":
            raise AttributeError(name)
        return getattr(self.flags, name)


class BackendKwargs(TypedDict):
    """`MultiLoRABackend`'s constructor arguments, by name."""

    n_slots: int
    defaults: AdapterDefaults
    router_url: str | None
    hooks: ControllerHooks | None
    store: RegistryStore | None
    dataset_limits: DatasetLimits | None
    queue_size: int


class MultiLoRABackend:
    """Registration, the lifecycle's transitions and the registry around them (see the module's
    docstring). Miles' form, `(args, router_url)`, is `from_miles_args`; a subclass written in
    that form derives from `miles.ray.multi_lora.backend.MultiLoRABackend`."""

    def __init__(self, n_slots: int, defaults: AdapterDefaults, router_url: str | None = None,
                 hooks: ControllerHooks | None = None, *, store: RegistryStore | None = None,
                 dataset_limits: DatasetLimits | None = None, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        if not isinstance(defaults, AdapterDefaults):
            raise TypeError(f"defaults must be AdapterDefaults, got {type(defaults).__name__}; Miles' form "
                            "(args, router_url) is MultiLoRABackend.from_miles_args(args, router_url)")
        self.args: BackendArgs | None = None
        """Miles' `args`, when built in Miles' form."""
        self.store = store
        state = store.load() if store is not None else None
        self.registry = (AdapterRegistry.from_state(state, n_slots, queue_size=queue_size) if state
                         else AdapterRegistry(n_slots, queue_size=queue_size))
        if state is not None:
            logger.info("Registry restored from %s: %d live, %d queued, %d finished adapters",
                        store.path, len(state.live), len(state.queued), len(state.finished))  # type: ignore[union-attr]
        self.defaults = defaults
        self.router_url = router_url
        self.hooks = hooks or ControllerHooks()
        self.dataset_limits = dataset_limits or DatasetLimits()
        self._dataset_checks = ThreadPoolExecutor(self.dataset_limits.max_concurrent,
                                                  thread_name_prefix="dataset-check")
        self._dataset_checks_running = 0
        self.registrations_total = 0
        self.deregistrations_total = 0
        self._registered = asyncio.Event()
        """Set (and replaced) at each registration: wakes `wait_for_registration`."""
        self.rollout_gauges: dict[str, AdapterGauges] = {}
        """What the driver last reported of each adapter's rollouts (served on `/metrics`)."""
        self._persist()

    @classmethod
    def from_miles_args(cls, args: BackendArgs, router_url: str | None) -> MultiLoRABackend:
        """Miles' form: built from the trainer's flags and what the controller hands every
        backend; `self.args` holds them, as in Miles."""
        backend = cls(**args.backend_kwargs(router_url))
        backend.args = args
        return backend

    async def init(self) -> None:
        """Called once before the control plane serves (Miles' hook: open clients here)."""

    async def close(self) -> None:
        """Called when the control plane stops (Miles' hook: close what `init` opened)."""

    def _persist(self) -> None:
        """Write the registry through to the store (one transaction, the rows that changed)."""
        if self.store is not None:
            self.store.write_through(self.registry)

    # ---- registration ------------------------------------------------------------

    async def register(
        self,
        name: str,
        config: dict[str, Any] | AdapterRunConfig | None = None,
        yaml_path: str | None = None,
        allowed_roots: list[Path] | None = None,
        plugin_modules: tuple[str, ...] | None = None,
        priority: int = 0,
    ) -> int | None:
        """Resolve → `validate_adapter` → read the dataset (off the loop) → registry; returns the
        slot, or None when every slot is held and the adapter was QUEUED (`priority` orders the
        queue: higher first, then arrival).

        With `allowed_roots` (requests from the network), `yaml_path`, `data` and `save`
        must resolve inside one of them; with `plugin_modules`, every plug-in path the config
        names must lie in one of those modules (checked before anything is imported).
        Nothing changes unless every check passes.
        """
        if (config is None) == (yaml_path is None):
            raise AdapterValidationError(f"Adapter '{name}': give exactly one of 'config' or 'yaml_path'")
        try:
            validate_adapter_name(name)
            resolved = self._resolve(name, config, yaml_path, allowed_roots, plugin_modules)
        except AdapterConfigError as exc:
            raise AdapterValidationError(str(exc)) from None
        self.registry.check_can_register(name, resolved)  # fail fast, before reading the dataset
        await self._run_validate_adapter(name, resolved)
        rows = await self.read_dataset(name, resolved)
        if rows is not None:
            resolved = resolve_num_step(resolved, rows)
        slot = self.registry.register(name, resolved, priority)  # checks again: the loop ran meanwhile
        self._persist()
        self.registrations_total += 1
        self._registered.set()
        self._registered = asyncio.Event()
        return slot

    def register_client(self, name: str, config: ClientModelConfig) -> int:
        """Register a client-driven adapter (a Tinker model: no dataset, no reward); returns the
        slot. Never queued: `NoFreeSlotError` when every slot is held."""
        slot = self.registry.register(name, config)
        assert slot is not None  # the registry never queues a client-driven adapter
        self._persist()
        self.registrations_total += 1
        self._registered.set()
        self._registered = asyncio.Event()
        return slot

    async def wait_for_registration(self, after: int, timeout_s: float) -> int:
        """`registrations_total` once it exceeds `after`, or after `timeout_s` (a long poll: the
        driver pushes a new adapter to the engines as soon as it is registered)."""
        if self.registrations_total <= after:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._registered.wait(), timeout_s)
        return self.registrations_total

    def _resolve(
        self, name: str, config: dict[str, Any] | AdapterRunConfig | None, yaml_path: str | None,
        allowed_roots: list[Path] | None, plugin_modules: tuple[str, ...] | None = None,
    ) -> AdapterRunConfig:
        if yaml_path is not None:
            _check_path_text(name, "yaml_path", yaml_path)
            if allowed_roots is not None:
                check_within_roots(name, "yaml_path", yaml_path, allowed_roots)
            raw = parse_adapter_run_yaml(yaml_path, name=name)
        else:
            assert config is not None
            raw = config if isinstance(config, AdapterRunConfig) else config_from_mapping(name, config)
        _check_path_text(name, "data", raw.data)
        _check_path_text(name, "save", str(raw.save) if raw.save is not None else "")
        if allowed_roots is not None:
            # Before the files are looked at, so nothing outside the roots is probed.
            check_within_roots(name, "data", raw.data, allowed_roots)
            if raw.save is not None:
                check_within_roots(name, "save", raw.save, allowed_roots)
        if plugin_modules is not None:
            check_plugin_modules(name, raw, plugin_modules)  # before resolving imports any of them
        resolved = resolve_adapter_config(name, raw, self.defaults)
        if allowed_roots is not None:
            assert resolved.save is not None
            check_within_roots(name, "save", resolved.save, allowed_roots)  # the default, {--save}/adapters/{name}
        return resolved

    def validate_adapter(self, name: str, config: AdapterRunConfig) -> Awaitable[None]:
        """Checks beyond the config's own rules; raise `ValueError` (or `AdapterValidationError`)
        to reject. By default: the reward can be found (the adapter's, else `--rm-type`, else
        the custom path).

        The check runs when called, and what it returns may be awaited: an override can be
        `async def ... await super().validate_adapter(...)` (Miles' form) or a plain `def`
        that calls `super().validate_adapter(...)`.
        """
        if self.hooks.validate_reward is not None:
            try:
                self.hooks.validate_reward(config.rm_type or self.defaults.rm_type, config.custom_rm_path)
            except ValueError as exc:
                raise AdapterValidationError(f"Adapter '{name}': reward: {exc}") from None
        if self.hooks.validate_plugins is not None:
            try:
                self.hooks.validate_plugins(config.custom_generate_function_path, config.dynamic_sampling_filter_path)
            except ValueError as exc:
                raise AdapterValidationError(f"Adapter '{name}': {exc}") from None
        return _CHECKED

    async def _run_validate_adapter(self, name: str, config: AdapterRunConfig) -> None:
        """The (possibly overridden) hook to its end; its `ValueError` becomes a 400."""
        try:
            checked = self.validate_adapter(name, config)
            if inspect.isawaitable(checked):
                await checked
        except AdapterRegistryError:
            raise
        except ValueError as exc:
            raise AdapterValidationError(str(exc) or f"Adapter '{name}' was refused by validate_adapter") from None

    async def read_dataset(self, name: str, config: AdapterRunConfig) -> int | None:
        """Row count of the adapter's dataset, checked in a worker thread (a large file
        never stalls the HTTP server or the actor's other calls); None without a hook.

        A file that is not a regular file or is over `dataset_limits.max_bytes` is refused
        before it is opened; a read that takes longer than `timeout_s` is refused (its
        thread finishes in the background and holds one of the `max_concurrent` workers).
        """
        limits = self.dataset_limits
        check_dataset_file(name, config.data, limits.max_bytes)
        validate = self.hooks.validate_dataset
        if validate is None:
            return None
        if self._dataset_checks_running >= limits.max_concurrent:
            raise ControlPlaneBusyError(
                f"Adapter '{name}': {limits.max_concurrent} dataset checks are already running; retry shortly"
            )
        self._dataset_checks_running += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._dataset_checks, validate, config.data,
                                      resolved_field(config.input_key, "input_key"), config.label_key)

        def release(_: object) -> None:
            self._dataset_checks_running -= 1

        future.add_done_callback(release)  # when the thread ends, also after a timeout
        try:
            return await asyncio.wait_for(asyncio.shield(future), limits.timeout_s)
        except TimeoutError:
            raise AdapterValidationError(
                f"Adapter '{name}': dataset {config.data} could not be read within {limits.timeout_s:g} s; "
                "use a smaller or faster file (--multi-lora-dataset-timeout-s)"
            ) from None
        except ValueError as exc:
            raise AdapterValidationError(f"Adapter '{name}': dataset: {exc}") from None

    def deregister(self, name: str) -> AdapterState | None:
        """PENDING/ACTIVE → RETIRING (no abort here: it keeps generating until retired); a QUEUED
        one is removed from the queue and forgotten (None)."""
        before = self.registry.state(name)
        after = self.registry.deregister(name)
        if before is not after:
            self._persist()
            self.deregistrations_total += 1
        return after

    # ---- the lifecycle's other transitions -----------------------------------------

    async def apply(self, op: Transition[R]) -> R:
        """Apply one lifecycle transition (`miles.utils.types.lifecycle_ops`): abort the requests
        it names first, run it on the registry, write the rows it changed through to the store,
        then abort the requests it names after. Answers what the transition answers."""
        if not isinstance(op, AbortingTransition):
            return self._run(op)
        await self._abort(lifecycle.aborts_before(self.registry, op))
        result = self._run(op)
        await self._abort(lifecycle.aborts_after(op, result))
        return result

    def apply_now(self, op: Transition[R]) -> R:
        """`apply` for a transition that aborts nothing, where nothing can be awaited."""
        if isinstance(op, AbortingTransition):
            raise TypeError(f"{type(op).__name__} aborts in-flight requests: use `await backend.apply(op)`")
        return self._run(op)

    def _run(self, op: Transition[R]) -> R:
        result: R = lifecycle.run(self.registry, op)
        if op.persisted:
            self._persist()
        return result

    async def _abort(self, names: Sequence[str]) -> None:
        await asyncio.gather(*(self.abort_adapter_requests(name) for name in names))

    async def abort_adapter_requests(self, name: str) -> list[str]:
        """Prefix-abort `"{name}::"` on every worker; returns the worker URLs reached."""
        if self.router_url is None:
            logger.info("No router known yet; no requests of adapter '%s' to abort", name)
            return []
        return await self.hooks.abort_prefix(self.router_url, adapter_rid_prefix(name))

    def adapter_step(self, name: str) -> int:
        return self.registry.step(name)

    def adapter_status(self, name: str) -> AdapterStatus:
        return self.registry.status(name)

    def statuses(self, offset: int = 0, limit: int | None = None) -> list[AdapterStatus]:
        """Every adapter the registry holds, or a page of that list (`AdapterRegistry.statuses`)."""
        return self.registry.statuses(offset, limit)

    def states(self, names: list[str]) -> dict[str, AdapterState | None]:
        return {name: self.registry.state(name) for name in names}

    def snapshot(self) -> MultiLoRASnapshot:
        return self.registry.snapshot()

    def observe_rollout(self, gauges: dict[str, AdapterGauges]) -> None:
        """Keep the driver's latest numbers of the adapters that hold a slot (bounded by the slots)."""
        self.rollout_gauges.update(gauges)
        live = {s.name: s.registration_id for s in self.registry.slot_statuses()}
        self.rollout_gauges = {name: g for name, g in self.rollout_gauges.items()
                               if live.get(name) == g.registration_id}


def _check_path_text(name: str, what: str, path: str) -> None:
    if "\x00" in path:
        raise AdapterConfigError(f"Adapter '{name}': {what} contains a NUL byte; give a plain path")


def check_dataset_file(name: str, path: str, max_bytes: int) -> None:
    """Refuse, without opening it, a dataset that is missing, not a regular file (a FIFO,
    a device, a directory, or a symlink to one) or larger than `max_bytes`."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise AdapterValidationError(f"Adapter '{name}': dataset {path} does not exist") from None
    except OSError as exc:
        raise AdapterValidationError(f"Adapter '{name}': dataset {path} cannot be read ({exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise AdapterValidationError(
            f"Adapter '{name}': dataset {path} is not a regular file ({file_kind(info.st_mode)}); "
            "point 'data' at a jsonl, json or parquet file"
        )
    if info.st_size > max_bytes:
        raise AdapterValidationError(
            f"Adapter '{name}': dataset {path} is {info.st_size} bytes, over the {max_bytes}-byte limit "
            "(--multi-lora-max-dataset-bytes); split it or raise the limit"
        )


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for error messages)."""
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"
