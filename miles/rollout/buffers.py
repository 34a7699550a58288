"""Per-adapter buffers of completed prompt groups, between the producer and collection.

The producer puts whole, rewarded groups; collection pops them in order. Each buffer is
bounded (`MAX_BUFFERED_GROUPS`): when training stalls the oldest group is dropped and
counted, so memory stays flat. Producer and collection share one event loop (the
rollout manager's), so no lock is needed.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from miles.utils.types import PromptGroup

MAX_BUFFERED_GROUPS = 1000


class GroupBuffer:
    """One adapter's FIFO of completed prompt groups; the oldest is dropped when full."""

    def __init__(self, capacity: int = MAX_BUFFERED_GROUPS) -> None:
        self._groups: deque[PromptGroup] = deque()
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: PromptGroup) -> bool:
        """Append; True when the oldest group had to be dropped to make room."""
        self._groups.append(group)
        if len(self._groups) > self._capacity:
            self._groups.popleft()
            return True
        return False

    def pop(self, n_groups: int) -> list[PromptGroup]:
        """Remove and return the `n_groups` oldest groups."""
        if n_groups > len(self._groups):
            raise ValueError(f"cannot pop {n_groups} groups from a buffer of {len(self._groups)}")
        return [self._groups.popleft() for _ in range(n_groups)]

    def drop_where(self, predicate: Callable[[PromptGroup], bool]) -> list[PromptGroup]:
        """Remove every group matching `predicate`; returns them (oldest first)."""
        dropped = [g for g in self._groups if predicate(g)]
        if dropped:
            self._groups = deque(g for g in self._groups if not predicate(g))
        return dropped


class AdapterBuffers:
    """The buffers of every adapter, keyed by adapter name, with overflow counts."""

    def __init__(self, capacity: int = MAX_BUFFERED_GROUPS) -> None:
        self._capacity = capacity
        self._buffers: dict[str, GroupBuffer] = {}
        self.overflow_drops: Counter[str] = Counter()
        """Groups dropped because an adapter's buffer was full, per adapter (cumulative)."""

    def get(self, name: str) -> GroupBuffer:
        if name not in self._buffers:
            self._buffers[name] = GroupBuffer(self._capacity)
        return self._buffers[name]

    def put(self, group: PromptGroup) -> None:
        if self.get(group.adapter).put(group):
            self.overflow_drops[group.adapter] += 1

    def discard(self, name: str) -> int:
        """Forget an adapter's buffer; returns how many groups it held."""
        buffer = self._buffers.pop(name, None)
        return 0 if buffer is None else len(buffer)

    def names(self) -> list[str]:
        return list(self._buffers)

    def queue_lengths(self) -> dict[str, int]:
        return {name: len(buffer) for name, buffer in self._buffers.items()}
