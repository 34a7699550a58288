"""The multi-LoRA backend: the registry plus everything around it that has side effects.

`register` resolves an adapter's config against the process defaults, runs the
`validate_adapter` hook (reward spec and dataset by default) and hands the result to the
`AdapterRegistry`; `retire_adapters` and `free_slot` also abort the adapter's in-flight
requests on every inference worker behind the router (prefix abort on `"{name}::"`).

Subclass it to add checks or side effects and select the subclass with
`--multi-lora-backend-path my_pkg.my_module.MyBackend`:

    class QuotaBackend(MultiLoRABackend):
        def validate_adapter(self, name, config):
            super().validate_adapter(name, config)
            if config.rank > 8:
                raise AdapterValidationError(f"Adapter '{name}': rank > 8 needs a quota")
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.controller.registry import AdapterRegistry, AdapterValidationError
from miles.utils.router_workers import abort_on_workers
from miles.utils.adapter_config import (
    AdapterConfigError,
    AdapterDefaults,
    AdapterRunConfig,
    check_within_roots,
    parse_adapter_run_yaml,
    resolve_adapter_config,
    validate_adapter_name,
)
from miles.utils.types import AdapterState, AdapterStatus, MultiLoRASnapshot, adapter_rid_prefix

if TYPE_CHECKING:
    from miles.utils.arguments import MilesConfig

logger = logging.getLogger(__name__)


class MultiLoRABackend:
    def __init__(self, n_slots: int, defaults: AdapterDefaults, router_url: str | None = None) -> None:
        self.registry = AdapterRegistry(n_slots)
        self.defaults = defaults
        self.router_url = router_url
        self.registrations_total = 0
        self.deregistrations_total = 0

    @classmethod
    def from_config(cls, cfg: MilesConfig, router_url: str | None = None) -> MultiLoRABackend:
        return cls(cfg.multi_lora_n_adapters, AdapterDefaults.from_config(cfg), router_url)

    # ---- registration ------------------------------------------------------------

    def register(
        self,
        name: str,
        config: dict[str, Any] | AdapterRunConfig | None = None,
        yaml_path: str | None = None,
        allowed_roots: list[Path] | None = None,
    ) -> int:
        """Resolve → `validate_adapter` → registry; returns the slot.

        With `allowed_roots` (requests from the network), `yaml_path`, `data` and `save`
        must resolve inside one of them.
        """
        if (config is None) == (yaml_path is None):
            raise AdapterValidationError(f"Adapter '{name}': give exactly one of 'config' or 'yaml_path'")
        try:
            validate_adapter_name(name)
            resolved = self._resolve(name, config, yaml_path, allowed_roots)
        except AdapterConfigError as exc:
            raise AdapterValidationError(str(exc)) from None
        self.validate_adapter(name, resolved)
        slot = self.registry.register(name, resolved)
        self.registrations_total += 1
        return slot

    def _resolve(
        self, name: str, config: dict[str, Any] | AdapterRunConfig | None, yaml_path: str | None,
        allowed_roots: list[Path] | None,
    ) -> AdapterRunConfig:
        if yaml_path is not None:
            if allowed_roots is not None:
                check_within_roots(name, "yaml_path", yaml_path, allowed_roots)
            raw: dict[str, Any] | AdapterRunConfig = parse_adapter_run_yaml(yaml_path, name=name)
        else:
            assert config is not None
            raw = config
        resolved = resolve_adapter_config(name, raw, self.defaults)
        if allowed_roots is not None:
            check_within_roots(name, "data", resolved.data, allowed_roots)
            assert resolved.save is not None
            check_within_roots(name, "save", resolved.save, allowed_roots)
        return resolved

    def validate_adapter(self, name: str, config: AdapterRunConfig) -> None:
        """Checks beyond the config's own rules; raise `AdapterValidationError` to reject.

        By default: the reward spec can be loaded and the dataset can be read and has
        the configured keys.
        """
        from miles.rollout.data_source import validate_dataset
        from miles.rollout.rewards import validate_reward_spec

        try:
            validate_reward_spec(config.rm_type, config.custom_rm_path)
        except ValueError as exc:
            raise AdapterValidationError(f"Adapter '{name}': reward: {exc}") from None
        try:
            validate_dataset(config.data, config.input_key, config.label_key)
        except ValueError as exc:
            raise AdapterValidationError(f"Adapter '{name}': dataset: {exc}") from None

    def deregister(self, name: str) -> AdapterState:
        """PENDING/ACTIVE → RETIRING (no abort here: it keeps generating until retired)."""
        before = self.registry.state(name)
        after = self.registry.deregister(name)
        if before is not after:
            self.deregistrations_total += 1
        return after

    # ---- retirement (with aborts) --------------------------------------------------

    async def retire_adapters(self) -> list[str]:
        """RETIRING → CLEANUP, then abort each one's in-flight requests."""
        names = self.registry.retire_adapters()
        await asyncio.gather(*(self.abort_adapter_requests(n) for n in names))
        return names

    async def free_slot(self, name: str) -> int:
        """CLEANUP → COMPLETED after one more abort round; the slot, or -1 if not in CLEANUP."""
        if self.registry.state(name) is not AdapterState.CLEANUP:
            return -1
        await self.abort_adapter_requests(name)
        return self.registry.free_slot(name)

    async def abort_adapter_requests(self, name: str) -> list[str]:
        """Prefix-abort `"{name}::"` on every worker; returns the worker URLs reached."""
        if self.router_url is None:
            logger.info("No router known yet; no requests of adapter '%s' to abort", name)
            return []
        return await abort_on_workers(self.router_url, adapter_rid_prefix(name))

    # ---- delegation to the registry ---------------------------------------------------

    def record_weight_update(self, names: list[str]) -> dict[str, int]:
        return self.registry.record_weight_update(names)

    def record_batch_adapters(self, rollout_id: int, groups: dict[str, int], step_names: list[str]) -> None:
        self.registry.record_batch_adapters(rollout_id, groups, step_names)

    def mark_batch_trained(self, rollout_id: int) -> list[str]:
        return self.registry.mark_batch_trained(rollout_id)

    def resolve_num_step(self, name: str, dataset_rows: int) -> int:
        return self.registry.resolve_num_step(name, dataset_rows)

    def set_adapter_step(self, name: str, step: int) -> None:
        self.registry.set_step(name, step)

    def adapter_step(self, name: str) -> int:
        return self.registry.step(name)

    def adapter_status(self, name: str) -> AdapterStatus:
        return self.registry.status(name)

    def statuses(self) -> list[AdapterStatus]:
        return self.registry.statuses()

    def states(self, names: list[str]) -> dict[str, AdapterState | None]:
        return {name: self.registry.state(name) for name in names}

    def snapshot(self) -> MultiLoRASnapshot:
        return self.registry.snapshot()
