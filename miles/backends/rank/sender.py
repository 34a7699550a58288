"""The sending side of the weights-update groups: a train rank broadcasts LoRA tensors to the engines.

The rank that exports (rank 0) hosts each group's rendezvous on its node, joins the group
as its rank 0 and broadcasts exports over it while the engines receive
(`miles.lora.weight_sync`). Its methods run on a Ray thread of their own, the
`WEIGHT_PUSH` concurrency group, so a push can run behind the next train call
(`--overlap-weight-push`):

    sender = UpdateGroupSender(device)
    host, port = sender.endpoint()                     # the rendezvous, held open
    sender.join(spec)                                  # with every engine of spec joining
    failed = sender.broadcast(tensors, [spec.group_name], bucketed=True)
    sender.leave()                                     # every group

An export the rank made is kept (`keep`, the newest of each adapter) and broadcast from
there (`broadcast_kept`): no read back from the object store, and, over gloo, laid out for
the wire once for all its pushes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from miles.lora.weight_sync import (
    UpdateGroupSpec,
    broadcast_wire,
    join_update_group,
    leave_update_group,
    listening_store,
    wire_tensors,
)
from miles.utils.network import cluster_host

WEIGHT_PUSH = "weight_push"
"""The Ray concurrency group of the weights-update group's methods."""


@dataclass
class _Kept:
    export_id: str
    tensors: dict[str, Tensor]
    wire: dict[bool, list[Tensor]] = field(default_factory=dict)
    """Its layouts for the wire (gloo), by `bucketed`, once sent."""


class UpdateGroupSender:
    """The weights-update groups one rank sends LoRA tensors over, and the rendezvous it hosts for them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        """Where tensors go before an NCCL broadcast."""
        # Both dicts are replaced, never changed in place: `leave` may run on the rank's
        # main thread (shutdown) while the push thread reads them.
        self._groups: dict[str, tuple[dist.ProcessGroup, str]] = {}
        """Joined groups: name -> (group, backend)."""
        self._rendezvous: dict[int, dist.TCPStore] = {}
        """Stores listening for a group not joined yet: port -> store."""
        self._kept: dict[str, _Kept] = {}
        """The newest export of each adapter this rank made, by adapter name."""
        self._kept_lock = threading.Lock()
        """Exports are kept from the rank's main thread, sent from its push thread."""

    def keep(self, adapter: str, export_id: str, tensors: dict[str, Tensor]) -> None:
        """Keep an export this rank made (in place of the adapter's older one), to broadcast
        it without reading it back."""
        with self._kept_lock:
            self._kept = {**self._kept, adapter: _Kept(export_id, tensors)}

    def forget(self, adapter: str) -> None:
        """Drop the adapter's kept export (it left its slot)."""
        with self._kept_lock:
            self._kept = {name: kept for name, kept in self._kept.items() if name != adapter}

    def endpoint(self) -> tuple[str, int]:
        """Host and port for a group's rendezvous on this node; the port is held from now
        until `join`."""
        host = cluster_host()
        store = listening_store(host)
        self._rendezvous = {**self._rendezvous, store.port: store}
        return host, store.port

    def join(self, spec: UpdateGroupSpec) -> None:
        """Join `spec` as its sender (rank 0); blocks until every engine rank of it joined."""
        self.leave(spec.group_name)
        store = self._rendezvous.get(spec.master_port)
        self._rendezvous = {port: s for port, s in self._rendezvous.items() if port != spec.master_port}
        group = join_update_group(spec, 0, store=store)
        self._groups = {**self._groups, spec.group_name: (group, spec.backend)}

    def leave(self, group_name: str | None = None) -> None:
        """Leave one group (every one when `group_name` is None)."""
        names = list(self._groups) if group_name is None else [group_name]
        for name in names:
            entry = self._groups.get(name)
            self._groups = {k: v for k, v in self._groups.items() if k != name}
            if entry is not None:
                leave_update_group(entry[0])

    def broadcast(self, tensors: dict[str, Tensor], group_names: Sequence[str],
                  bucketed: bool = False) -> dict[str, str]:
        """Send `tensors` over each named group in turn (`bucketed`: one flat tensor per dtype);
        returns the groups whose broadcast failed, with the error (one dead engine does not
        stop the others' pushes)."""
        return self._send(lambda backend: wire_tensors(tensors, device=self._device_for(backend), bucketed=bucketed),
                          group_names)

    def broadcast_kept(self, export_id: str, read: Callable[[], dict[str, Tensor]], group_names: Sequence[str],
                       bucketed: bool = False) -> dict[str, str]:
        """`broadcast` of the export `export_id`: from the tensors `keep` kept, laid out for the
        wire once; `read()` gives them when this rank did not keep them (made before a restart,
        or replaced by a newer export of its adapter)."""
        with self._kept_lock:
            kept = next((k for k in self._kept.values() if k.export_id == export_id), None)

        def wire(backend: str) -> list[Tensor]:
            device = self._device_for(backend)
            if kept is None:
                return wire_tensors(read(), device=device, bucketed=bucketed)
            if device is not None:  # a device copy per push: none kept in accelerator memory
                return wire_tensors(kept.tensors, device=device, bucketed=bucketed)
            if bucketed not in kept.wire:
                kept.wire[bucketed] = wire_tensors(kept.tensors, bucketed=bucketed)
            return kept.wire[bucketed]

        return self._send(wire, group_names)

    def _device_for(self, backend: str) -> torch.device | None:
        return self.device if backend == "nccl" else None

    def _send(self, wire: Callable[[str], list[Tensor]], group_names: Sequence[str]) -> dict[str, str]:
        failed = {}
        for name in group_names:
            if name not in self._groups:
                failed[name] = "not joined"
                continue
            group, backend = self._groups[name]
            try:
                broadcast_wire(group, wire(backend))
            except RuntimeError as exc:  # gloo/nccl: the peer is gone
                failed[name] = str(exc)
        return failed
