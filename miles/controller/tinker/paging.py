"""Paging idle Tinker models out of their slots and back in on their next command.

A model is idle when none of its commands is in flight (logged and not taken, or running)
and the last one was logged or finished long enough ago; the driver pages such models out
(through the controller actor) so that more models than slots can stay open.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from miles.controller.backend import MultiLoRABackend
from miles.controller.registry import NoSlotToPageInError
from miles.controller.tinker.command_log import CommandLog
from miles.controller.tinker.errors import GatewayBusyError
from miles.utils.types import AdapterState
from miles.utils.types.lifecycle_ops import PageIn, PageOut

logger = logging.getLogger(__name__)


class ModelPaging:
    """When each model was last active, and the page-outs and page-ins of the idle ones."""

    def __init__(self, backend: MultiLoRABackend, log: CommandLog, clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.log = log
        self.clock = clock
        self._last_active: dict[str, float] = {}
        """Registry name -> when a command of the model was last logged or finished (its
        creation, or this gateway's start, before that): how long it has been idle."""

    def touch(self, name: str) -> None:
        """A command of the model was logged or finished now."""
        self._last_active[name] = self.clock()

    def idle_models(self, idle_s: float) -> list[str]:
        """The ACTIVE client-driven models with no command in flight (none logged and not
        taken, none running) whose last command was logged or finished `idle_s` or more ago."""
        now = self.clock()
        return sorted(name for name, run in self.backend.snapshot().clients.items()
                      if run.state is AdapterState.ACTIVE and not self.log.busy(name)
                      and now - self._last_active.setdefault(name, now) >= idle_s)

    def page_out(self, name: str, directory: str) -> bool:
        """The trainer wrote the model's whole state to `directory` and emptied its slot: PAGED,
        its slot free. False (nothing changes; the trainer loads it back) if a command of it came
        in meanwhile, or it is not ACTIVE any more."""
        if self.log.busy(name):
            return False
        return self.backend.apply_now(PageOut(name, directory)) >= 0

    def page_in(self, name: str) -> None:
        """A paged model's command came: back into a free slot (PENDING), or 429 with none free."""
        try:
            slot = self.backend.apply_now(PageIn(name))
        except NoSlotToPageInError as exc:
            raise GatewayBusyError(str(exc)) from None
        logger.info("Tinker model '%s' was paged out while idle; its command pages it back in (slot %d)", name, slot)

    def paged_count(self) -> int:
        return self.backend.registry.paged_count
