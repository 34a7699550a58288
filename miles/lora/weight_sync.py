"""LoRA tensors over a weights-update process group: join it, broadcast, receive.

The sender (the train rank that exports LoRA tensors) is rank 0; every inference
server joins with `POST /init_weights_update_group` at its rank offset. Then each push
sends names, dtypes and shapes over HTTP (`/load_lora_adapter_from_distributed`) and
the tensors themselves by broadcast from rank 0: nothing is pickled.

    store = listening_store(node_ip)             # the rendezvous, on a port the OS gave it
    spec = UpdateGroupSpec(master_address=node_ip, master_port=store.port,
                           world_size=1 + n_engines, backend="gloo")      # "nccl" on GPU
    # at the same time: every engine posts spec.init_request(rank_offset=1 + i) ...
    group = join_update_group(spec, rank=0, store=store)   # ... and the sender joins; all block until all are in
    names, dtypes, shapes = tensor_metadata(tensors)   # -> the HTTP body of each engine's load
    broadcast_tensors(group, tensors)            # while those load requests are in flight

`join_update_group` builds the group exactly as SGLang's server does (a TCP rendezvous
at the sender, a store prefixed with the group name, a process group outside the
default one), so a sender made here meets a real SGLang server as well as the builtin
engine, which uses the same function to join. Plain torch.distributed; no Ray.

`bucketed=True` (the builtin engine, which says so with `flattened_bucket` in its load
request) sends one flat tensor per dtype instead of one per name: one collective per
adapter instead of one per LoRA matrix. Each collective costs both sides a release and
re-acquire of the GIL, which waits for busy threads (a train step, a decode loop): 56
rank-16 matrices of the tiny base took 10-57 ms per adapter one by one and 0.5-6 ms as
one bucket, two processes over gloo on this 2-core machine, with and without a busy
thread on each side. SGLang's servers take one tensor per name.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_GROUP_NAME = "miles_lora_update"
_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
}


@dataclass(frozen=True)
class UpdateGroupSpec:
    """Where and how a weights-update group meets (the sender hosts the rendezvous)."""

    master_address: str
    master_port: int
    world_size: int
    """1 (the sender) + the ranks of every engine (its tensor-parallel size each)."""
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"
    timeout_s: float = 600.0

    def init_request(self, rank_offset: int) -> dict[str, Any]:
        """The body of `POST /init_weights_update_group` for the engine whose first rank is `rank_offset`."""
        return {"master_address": self.master_address, "master_port": self.master_port, "rank_offset": rank_offset,
                "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend}


def listening_store(host: str, timeout_s: float = 600.0) -> dist.TCPStore:
    """A rendezvous store that already listens on `host`, on a port the OS chose (its `.port`).

    The port stays bound from the moment it is chosen, so nothing else on the node can take
    it before the group meets (a port probed free and closed again can be taken meanwhile).
    """
    return dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_update_group(spec: UpdateGroupSpec, rank: int, store: dist.Store | None = None) -> dist.ProcessGroup:
    """Join the group as `rank` (the sender is 0); blocks until all `world_size` ranks joined.

    `store`: the sender's `listening_store` on `spec.master_port`, when it made one.
    """
    # Private torch helpers, used exactly as SGLang's server uses them: the store keys and
    # the group must match on both sides, and the trainer's default group stays untouched.
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} is outside the weights-update group of size {spec.world_size}")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    world_size = spec.world_size
    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{spec.master_address}:{spec.master_port}", rank,
                                                  spec.world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(spec.backend),
                                         PrefixStore(spec.group_name, store), group_name=GroupName(spec.group_name),
                                         timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`, as SGLang's requests spell dtypes."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported tensor dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def tensor_metadata(tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of `tensors` in broadcast order (the mapping's order)."""
    return ([name for name in tensors], [dtype_name(t.dtype) for t in tensors.values()],
            [list(t.shape) for t in tensors.values()])


def broadcast_tensors(group: dist.ProcessGroup, tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor],
                      *, device: str | torch.device | None = None, bucketed: bool = False) -> int:
    """Broadcast from rank 0, in order; returns the bytes sent.

    `device`: where the tensors go before sending (`cuda` for NCCL); default where they are.
    `bucketed`: one flat tensor per dtype, dtypes in the order they first occur.
    """
    return broadcast_wire(group, wire_tensors(tensors, device=device, bucketed=bucketed))


def wire_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor], *,
                 device: str | torch.device | None = None, bucketed: bool = False) -> list[torch.Tensor]:
    """The tensors as `broadcast_tensors` sends them: contiguous (LoRA B slices are strided),
    on `device`, and with `bucketed` one flat tensor per dtype. Keep them to send them again."""
    values = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    ready = [(t if device is None else t.to(device)).contiguous() for t in values]
    if bucketed:
        ready = [torch.cat([ready[i].reshape(-1) for i in rows]) for rows in _buckets([t.dtype for t in ready])]
    return ready


def broadcast_wire(group: dist.ProcessGroup, ready: list[torch.Tensor]) -> int:
    """Broadcast `wire_tensors` from rank 0, in order; returns the bytes sent."""
    works = [_broadcast(group, t) for t in ready]
    for work in works:
        work.wait()
    return sum(t.numel() * t.element_size() for t in ready)


def receive_tensors(group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    *, device: str | torch.device = "cpu", bucketed: bool = False,
                    buffer: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Receive what `broadcast_tensors` sends, described by (names, dtypes, shapes) and
    whether it was `bucketed`. `buffer(numel, dtype)` gives each bucket's flat tensor (one
    kept from an earlier push: a fresh one costs its page faults, several times the copy);
    default a new one."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    torch_dtypes = [parse_dtype(dtype) for dtype in dtypes]
    if not bucketed:
        buffers = {name: torch.empty(shape, dtype=dtype, device=device)
                   for name, dtype, shape in zip(names, torch_dtypes, shapes)}
        works = [_broadcast(group, t) for t in buffers.values()]
        for work in works:
            work.wait()
        return buffers
    sizes = [math.prod(shape) for shape in shapes]
    received: dict[int, torch.Tensor] = {}
    for rows in _buckets(torch_dtypes):
        numel, dtype = sum(sizes[i] for i in rows), torch_dtypes[rows[0]]
        flat = torch.empty(numel, dtype=dtype, device=device) if buffer is None else buffer(numel, dtype)
        _broadcast(group, flat).wait()
        for i, piece in zip(rows, flat.split([sizes[i] for i in rows])):
            received[i] = piece.view(shapes[i])
    return {name: received[i] for i, name in enumerate(names)}


def _buckets(dtypes: list[torch.dtype]) -> list[list[int]]:
    """Indices of the tensors of each dtype, dtypes in the order they first occur."""
    rows: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        rows.setdefault(dtype, []).append(i)
    return list(rows.values())


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)
