"""The registry's status list: adapters' statuses, paged, and each one's JSON text cached until
it changes, so a page of `GET /adapter_runs` costs the same however many adapters are kept.

    listing = StatusListing()
    listing.statuses(entries, offset=0, limit=50)   # AdapterStatus objects of that page
    listing.texts(entries, 0, 50, held=n, known=lambda: names)   # the same, as JSON texts
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.controller.registry_records import Queued, Record
from miles.utils.types import AdapterKind, AdapterState, AdapterStatus


def record_status(record: Record, slot_versions: Sequence[int]) -> AdapterStatus:
    """The status of a live or finished adapter (its slot's version while it holds the slot)."""
    paged = record.state is AdapterState.PAGED
    return AdapterStatus(
        name=record.name, state=record.state, slot=None if paged else record.slot,
        version=None if record.state.terminal or paged else slot_versions[record.slot],
        step=record.step, accumulated_groups=record.accumulated_groups,
        registration_id=record.registration_id, kind=record.kind, last_error=record.failure,
        priority=record.priority, **record.config.to_dict(),
    )


def queued_status(index: int, entry: Queued) -> AdapterStatus:
    """The status of the QUEUED registration at `index` of the queue (0: its head)."""
    return AdapterStatus(
        name=entry.name, state=AdapterState.QUEUED, slot=None, version=None, step=0, accumulated_groups=0,
        registration_id=entry.registration_id, kind=AdapterKind.SERVER, queue_position=index + 1,
        priority=entry.priority, **entry.config.to_dict(),
    )


@dataclass(frozen=True)
class Listed:
    """One adapter of the list: its name, what its status depends on, and its status, built
    only when called."""

    name: str
    key: tuple[Any, ...]
    status: Callable[[], AdapterStatus]


def listed(live: Iterable[Record], queue: Sequence[Queued], finished: Iterable[Record],
           slot_versions: Sequence[int]) -> Iterable[Listed]:
    """The list `statuses` pages through: live adapters by slot, then QUEUED ones (head first),
    then finished ones in the order given. A record's status depends on its revision and its
    slot's version; a queued one's on its place."""
    for record in sorted(live, key=lambda r: r.slot):
        yield _listed_record(record, slot_versions)
    for index, entry in enumerate(queue):
        yield Listed(entry.name, (entry.registration_id, index), functools.partial(queued_status, index, entry))
    for record in finished:
        yield _listed_record(record, slot_versions)


def _listed_record(record: Record, slot_versions: Sequence[int]) -> Listed:
    slotless = record.state.terminal or record.state is AdapterState.PAGED
    version = None if slotless else slot_versions[record.slot]
    return Listed(record.name, (record.registration_id, record.revision, version),
                  functools.partial(record_status, record, slot_versions))


class StatusListing:
    """Pages of the status list, and each adapter's status as JSON text while it is unchanged."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[tuple[Any, ...], str]] = {}

    @staticmethod
    def page(entries: Iterable[Listed], offset: int, limit: int | None) -> Iterable[Listed]:
        return itertools.islice(entries, offset, None if limit is None else offset + limit)

    def statuses(self, entries: Iterable[Listed], offset: int = 0, limit: int | None = None) -> list[AdapterStatus]:
        """The page's statuses (only its own are built)."""
        return [entry.status() for entry in self.page(entries, offset, limit)]

    def texts(self, entries: Iterable[Listed], offset: int, limit: int | None, held: int,
              known: Callable[[], Collection[str]]) -> list[str]:
        """The page's statuses as JSON texts (each `AdapterStatus.model_dump(mode="json")`), each
        built once per change of its key. `held` (how many adapters are listed) bounds the cache;
        past twice that, only the names `known()` gives are kept."""
        texts = []
        for entry in self.page(entries, offset, limit):
            cached = self._texts.get(entry.name)
            if cached is None or cached[0] != entry.key:
                cached = (entry.key, json.dumps(entry.status().model_dump(mode="json"), ensure_ascii=False,
                                                allow_nan=False, separators=(",", ":")))
                self._texts[entry.name] = cached
            texts.append(cached[1])
        if len(self._texts) > 2 * held:  # forget those of adapters no longer held
            names = known()
            self._texts = {n: v for n, v in self._texts.items() if n in names}
        return texts
