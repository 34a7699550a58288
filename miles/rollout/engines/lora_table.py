"""Which LoRA name lives in which page-table slot of the builtin engine.

The engine has `--max-loras-per-batch` slots. A name is *reserved* while its weights
are being written, *loaded* once they are (only loaded names are served), and its slot
is *freed* only after the slot has been cleared, so a concurrent load can never land in
a slot that an unload is still wiping. Loaded names are kept in least-recently-used
order (a lookup counts as a use), which is what SGLang evicts by under
`--max-loaded-loras`. An adapter *evicted* to make room keeps its directory here, so
a later request naming it can bring it back (`evicted_path`); an explicit unload
forgets it. Plain Python; the engine calls it from its event loop only.
"""

from __future__ import annotations

from collections import OrderedDict


class LoraRequestError(ValueError):
    """A LoRA request that cannot be served as given (HTTP 400); the message says why."""


class UnknownLoraError(LoraRequestError):
    pass


class LoraAlreadyLoadedError(LoraRequestError):
    pass


class LoraSlotTable:
    def __init__(self, n_slots: int, *, upsert_allowed: bool = True):
        """`upsert_allowed`: False answers a load of a loaded name as SGLang does, whatever `upsert` says."""
        self.n_slots = n_slots
        self.upsert_allowed = upsert_allowed
        self._free = list(range(n_slots))
        self._reserved: dict[str, int] = {}
        self._loaded: OrderedDict[str, int] = OrderedDict()
        self._paths: dict[str, str] = {}
        self._pinned: set[str] = set()
        self._evicted: dict[str, str] = {}
        """Evicted names -> the directory each is reloaded from on its next request."""

    def slot_of(self, name: str | None) -> int:
        """Slot serving `name` (a use, for LRU order); None is the base model (-1)."""
        if name is None:
            return -1
        if name not in self._loaded:
            raise UnknownLoraError(f"The following requested LoRA adapters are not loaded: {name}\n"
                                   f"Loaded adapters: {list(self._loaded)}. Load it with /load_lora_adapter "
                                   "or send lora_path null for the base model")
        self._loaded.move_to_end(name)
        return self._loaded[name]

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def is_known(self, name: str) -> bool:
        """Loaded, or evicted with a directory to reload it from."""
        return name in self._loaded or name in self._evicted

    def evicted_path(self, name: str) -> str | None:
        """The directory an evicted `name` is reloaded from; None when it is not evicted."""
        return self._evicted.get(name)

    def reserve(self, name: str, *, upsert: bool, pinned: bool = False) -> tuple[int, bool]:
        """(slot to write, whether it is a fresh slot) for loading `name`."""
        if not name:
            raise LoraRequestError("lora_name must be a non-empty string")
        if name in self._reserved:
            raise LoraRequestError(f"LoRA adapter {name!r} is being loaded right now; retry when that finishes")
        if name in self._loaded:
            if not (upsert and self.upsert_allowed):
                hint = ("; pass upsert=true to replace its weights in place, or unload it first"
                        if self.upsert_allowed else "")
                raise LoraAlreadyLoadedError(f"Failed to load LoRA adapter {name} because it is already loaded{hint}")
            self._reserved[name] = self._loaded[name]
            return self._loaded[name], False
        if not self._free:
            raise LoraRequestError(f"all {self.n_slots} LoRA slots are in use ({sorted(self._loaded)}); "
                                   "unload one first or start the server with a larger --max-loras-per-batch")
        slot = self._free.pop(0)
        self._reserved[name] = slot
        if pinned:
            self._pinned.add(name)
        return slot, True

    def commit(self, name: str, path: str) -> None:
        self._loaded[name] = self._reserved.pop(name)
        self._loaded.move_to_end(name)
        self._paths[name] = path
        self._evicted.pop(name, None)

    def cancel(self, name: str, *, fresh: bool) -> None:
        """Undo `reserve` after a failed load (a fresh slot goes back to the free list)."""
        slot = self._reserved.pop(name)
        if fresh:
            self._pinned.discard(name)
            self._free_slot(slot)

    def remove(self, name: str) -> int | None:
        """Stop serving `name`; its slot stays taken until `release(slot)`. An evicted
        name is forgotten (no slot to release: None)."""
        if name in self._reserved:
            raise LoraRequestError(f"LoRA adapter {name!r} is being loaded right now; unload it after that finishes")
        if name in self._evicted and name not in self._loaded:
            del self._evicted[name]
            return None
        if name not in self._loaded:
            raise UnknownLoraError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self._loaded)}")
        slot = self._loaded.pop(name)
        del self._paths[name]
        self._pinned.discard(name)
        return slot

    def evict(self, name: str) -> int:
        """Stop serving `name` but remember its directory for a reload; its slot stays
        taken until `release(slot)`."""
        path = self._paths[name]
        slot = self.remove(name)
        assert slot is not None
        self._evicted[name] = path
        return slot

    def eviction_order(self) -> list[str]:
        """Loaded, unpinned names, least recently used first (SGLang's eviction order)."""
        return [name for name in self._loaded if name not in self._pinned]

    def __len__(self) -> int:
        """Names loaded or being loaded."""
        return len(self._loaded) + len([n for n in self._reserved if n not in self._loaded])

    def release(self, slot: int) -> None:
        self._free_slot(slot)

    def loaded(self) -> dict[str, str]:
        """Loaded names and the directory each was read from."""
        return dict(self._paths)

    def evicted(self) -> dict[str, str]:
        """Evicted names and the directory each is reloaded from."""
        return dict(self._evicted)

    def _free_slot(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort()
