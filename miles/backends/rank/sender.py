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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from miles.lora.weight_sync import (
    UpdateGroupSpec,
    broadcast_tensors,
    join_update_group,
    leave_update_group,
    listening_store,
)
from miles.utils.network import cluster_host

WEIGHT_PUSH = "weight_push"
"""The Ray concurrency group of the weights-update group's methods."""


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
        failed = {}
        for name in group_names:
            if name not in self._groups:
                failed[name] = "not joined"
                continue
            group, backend = self._groups[name]
            try:
                broadcast_tensors(group, tensors, device=self.device if backend == "nccl" else None, bucketed=bucketed)
            except RuntimeError as exc:  # gloo/nccl: the peer is gone
                failed[name] = str(exc)
        return failed
