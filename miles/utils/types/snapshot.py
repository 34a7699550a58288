"""The read-only views of the registry the driver loop acts on: one live adapter
(`AdapterRun`) and the point-in-time snapshot of all of them (`MultiLoRASnapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.utils.adapter_config import AdapterRunConfig
from miles.utils.types.client_commands import ClientAdapterRun


@dataclass(frozen=True)
class AdapterRun:
    """Read-only view of one live adapter, as carried by a snapshot."""

    name: str
    config: AdapterRunConfig
    """The resolved config: every default filled in from the process config."""
    slot: int
    """Row of the LoRA page table this adapter owns."""
    version: int
    """Slot version of the weights the engines serve (bumped per push, never reset)."""
    step: int
    """Optimizer steps taken (including steps restored from a checkpoint)."""
    accumulated_groups: int
    """Prompt groups trained since the last optimizer step."""
    registration_id: str
    """uuid4 hex issued at registration; a re-registration gets a new one."""
    start_step: int = 0
    """Step this registration started at (its resumed step); `num_step` counts from here."""
    pushed: bool = False
    """Its weights were pushed at least once: `start_step` is fixed from then on (a trainer
    that restarts over the registry resumes it without moving its end)."""
    pushing_version: int | None = None
    """The version of a push under way (the trainer has exported these weights; the engines
    still serve `version`); None when no push is under way."""

    @property
    def trainer_version(self) -> int:
        """The version of the weights the trainer has sent last: what staleness counts against."""
        return self.version if self.pushing_version is None else self.pushing_version

    @property
    def final_step(self) -> int | None:
        """The step at which it retires by itself (None: only a DELETE retires it)."""
        num_step = self.config.num_step
        return None if num_step is None else self.start_step + num_step


@dataclass(frozen=True)
class MultiLoRASnapshot:
    """Point-in-time copy of the registry that the driver loop acts on.

    `pending`, `active` and `retiring` hold the server-driven adapters (the RL loop's);
    client-driven ones (Tinker models) are in `clients` whatever their live state, so
    nothing generates for them or reads a dataset for them. `cleanup`, `completed` and
    `failed` name adapters of both kinds."""

    pending: dict[str, AdapterRun] = field(default_factory=dict)
    active: dict[str, AdapterRun] = field(default_factory=dict)
    retiring: dict[str, AdapterRun] = field(default_factory=dict)
    cleanup: frozenset[str] = frozenset()
    completed: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
    """FAILED adapters (of either kind) still kept for status queries."""
    clients: dict[str, ClientAdapterRun] = field(default_factory=dict)
    """Live client-driven adapters (PENDING, ACTIVE or RETIRING), by name."""
    queued: tuple[str, ...] = ()
    """QUEUED adapters in the order they will take slots (head first). The loop never acts on
    them: a slot that frees goes to the head inside the registry, which shows it as PENDING."""

    @property
    def sampleable(self) -> dict[str, AdapterRun]:
        """ACTIVE and RETIRING adapters: the ones the producer generates for."""
        return {**self.active, **self.retiring}

    @property
    def live(self) -> dict[str, AdapterRun]:
        """Adapters that own a slot and have a view (PENDING, ACTIVE, RETIRING)."""
        return {**self.pending, **self.active, **self.retiring}

    @property
    def all_adapters_cleaned_up(self) -> bool:
        """True when no adapter of either kind holds a slot, and none waits for one."""
        return not (self.pending or self.active or self.retiring or self.cleanup or self.clients or self.queued)
