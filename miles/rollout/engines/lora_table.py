"""Which LoRA name lives in which page-table slot of the builtin engine.

The engine has `--max-loras-per-batch` slots. A name is *reserved* while its weights
are being written, *loaded* once they are (only loaded names are served), and its slot
is *freed* only after the slot has been cleared, so a concurrent load can never land in
a slot that an unload is still wiping. Plain Python; the engine calls it from its event
loop only.
"""

from __future__ import annotations


class LoraRequestError(ValueError):
    """A LoRA request that cannot be served as given (HTTP 400); the message says why."""


class UnknownLoraError(LoraRequestError):
    pass


class LoraSlotTable:
    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self._free = list(range(n_slots))
        self._reserved: dict[str, int] = {}
        self._loaded: dict[str, int] = {}
        self._paths: dict[str, str] = {}

    def slot_of(self, name: str | None) -> int:
        """Slot serving `name`; None is the base model (-1)."""
        if name is None:
            return -1
        if name not in self._loaded:
            known = sorted(self._loaded) or "none"
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded (loaded: {known}); "
                                   "load it with /load_lora_adapter or send lora_path null for the base model")
        return self._loaded[name]

    def reserve(self, name: str, *, upsert: bool) -> tuple[int, bool]:
        """(slot to write, whether it is a fresh slot) for loading `name`."""
        if not name:
            raise LoraRequestError("lora_name must be a non-empty string")
        if name in self._reserved:
            raise LoraRequestError(f"LoRA adapter {name!r} is being loaded right now; retry when that finishes")
        if name in self._loaded:
            if not upsert:
                raise LoraRequestError(f"LoRA adapter {name!r} is already loaded; pass upsert=true to replace "
                                       "its weights in place, or unload it first")
            self._reserved[name] = self._loaded[name]
            return self._loaded[name], False
        if not self._free:
            raise LoraRequestError(f"all {self.n_slots} LoRA slots are in use ({sorted(self._loaded)}); "
                                   "unload one first or start the server with a larger --max-loras-per-batch")
        slot = self._free.pop(0)
        self._reserved[name] = slot
        return slot, True

    def commit(self, name: str, path: str) -> None:
        self._loaded[name] = self._reserved.pop(name)
        self._paths[name] = path

    def cancel(self, name: str, *, fresh: bool) -> None:
        """Undo `reserve` after a failed load (a fresh slot goes back to the free list)."""
        slot = self._reserved.pop(name)
        if fresh:
            self._free_slot(slot)

    def remove(self, name: str) -> int:
        """Stop serving `name`; its slot stays taken until `release(slot)`."""
        if name in self._reserved:
            raise LoraRequestError(f"LoRA adapter {name!r} is being loaded right now; unload it after that finishes")
        slot = self.slot_of(name)
        del self._loaded[name]
        del self._paths[name]
        return slot

    def release(self, slot: int) -> None:
        self._free_slot(slot)

    def loaded(self) -> dict[str, str]:
        """Loaded names and the directory each was read from."""
        return dict(self._paths)

    def _free_slot(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort()
