"""When the producer gives up on one adapter: its prompt groups fail, or are dropped, in a row.

The producer reports every settled prompt group here, per registration. A group that raised
(its reward, generate function, dynamic filter, or the rendering of its prompt: anything but
the transport to the engines, which is the engines' fault and counted by the producer) or that
its dynamic filter dropped lengthens the adapter's run of bad groups; a group put in its buffer
ends the run. At `max_failures` failed groups, or `max_filtered` dropped ones, since its last
kept group the adapter is given up: `AdapterFailure` says why, the producer submits none of
its groups any more, and the controller fails it (it leaves like a retired adapter and ends
FAILED). Aborted groups (the adapter is leaving anyway) count neither way.

    health = AdapterHealth(AdapterLimits(max_failures=32, max_filtered=256))
    failure = health.failed(run, exc)      # None until the limit is reached
    health.kept(run)                       # a group reached the buffer: the run ends

The log gets one line when a run of failures starts (with the traceback of its first
error) and one when it ends (the adapter recovered, or was given up); the groups in
between are counted, not logged.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from miles.utils.types import AdapterFailure, AdapterRun, FailureReason

logger = logging.getLogger(__name__)

TRACEBACK_FRAMES = 4
"""Innermost frames logged with the first failure of a run (the plug-in's own lines)."""
GIVEN_UP_RETENTION = 1024
"""Registrations given up that are remembered (the oldest are forgotten first): a
collection still acting on a snapshot from before the failure must not wait for one."""


@dataclass(frozen=True)
class AdapterLimits:
    """How many bad groups in a row the producer tolerates of one adapter (0: any number).

    The trainer's values are `--multi-lora-max-consecutive-failures` and
    `--multi-lora-max-consecutive-filtered`."""

    max_failures: int = 0
    max_filtered: int = 0

    def __post_init__(self) -> None:
        if self.max_failures < 0 or self.max_filtered < 0:
            raise ValueError(f"adapter failure limits must be >= 0 (0: no limit), got {self}")


@dataclass
class _BadRun:
    """One registration's groups since its last kept one."""

    name: str
    failed: int = 0
    filtered: int = 0
    filter_reasons: Counter[str] = field(default_factory=Counter)


class AdapterHealth:
    """Runs of failed or dropped groups per registration, and the registrations given up."""

    def __init__(self, limits: AdapterLimits) -> None:
        self.limits = limits
        self._runs: dict[str, _BadRun] = {}
        self._given_up: OrderedDict[str, AdapterFailure] = OrderedDict()
        """registration id -> why (registration ids are never reused)."""

    def gave_up(self, registration_id: str) -> bool:
        return registration_id in self._given_up

    def kept(self, run: AdapterRun) -> None:
        """A group of `run` reached its buffer: its run of bad groups ends."""
        bad = self._runs.pop(run.registration_id, None)
        if bad is not None and bad.failed:
            logger.info("Adapter '%s' produced a prompt group again after %d failed and %d dropped in a row",
                        run.name, bad.failed, bad.filtered)

    def failed(self, run: AdapterRun, exc: BaseException) -> AdapterFailure | None:
        """A group of `run` raised `exc`; the failure that gives it up, or None."""
        if self.gave_up(run.registration_id):
            return None  # its stragglers, after the line that said so
        bad = self._runs.setdefault(run.registration_id, _BadRun(run.name))
        bad.failed += 1
        failure = AdapterFailure.from_exception(exc, groups=bad.failed + bad.filtered)
        limit = self.limits.max_failures
        if bad.failed == 1:
            where = "".join(traceback.format_tb(exc.__traceback__)[-TRACEBACK_FRAMES:])
            logger.warning("Adapter '%s': a prompt group failed (%s: %s); %s. Where it was raised:\n%s", run.name,
                           failure.error_type, failure.message,
                           f"after {limit} in a row it is FAILED" if limit else "it keeps generating", where.rstrip())
        if limit and bad.failed >= limit:
            return self._give_up(run, failure)
        return None

    def filtered(self, run: AdapterRun, reason: str) -> AdapterFailure | None:
        """The dynamic filter dropped a group of `run`; the failure that gives it up, or None."""
        if self.gave_up(run.registration_id):
            return None
        bad = self._runs.setdefault(run.registration_id, _BadRun(run.name))
        bad.filtered += 1
        bad.filter_reasons[reason] += 1
        limit = self.limits.max_filtered
        if not (limit and bad.filtered >= limit):
            return None
        reasons = ", ".join(f"{why}: {n}" for why, n in bad.filter_reasons.most_common(5))
        return self._give_up(run, AdapterFailure(
            reason=FailureReason.FILTERED, error_type=None, groups=bad.failed + bad.filtered,
            message=(f"its dynamic sampling filter dropped {bad.filtered} prompt groups in a row (by reason: "
                     f"{reasons}); check dynamic_sampling_filter_path and the reward, or raise "
                     "--multi-lora-max-consecutive-filtered")))

    def _give_up(self, run: AdapterRun, failure: AdapterFailure) -> AdapterFailure:
        self._runs.pop(run.registration_id, None)
        self._given_up[run.registration_id] = failure
        while len(self._given_up) > GIVEN_UP_RETENTION:
            self._given_up.popitem(last=False)
        logger.error("Adapter '%s': giving up on it, no more prompt groups are generated for it: %s. It is "
                     "saved and leaves as FAILED (its slot freed); fix its config and register it again",
                     run.name, failure.summary())
        return failure

    def forget_runs(self, sampleable: set[str]) -> None:
        """Drop the runs of registrations no longer sampleable (retired, or re-registered)."""
        self._runs = {rid: bad for rid, bad in self._runs.items() if rid in sampleable}
