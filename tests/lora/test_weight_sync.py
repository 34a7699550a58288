"""Rendezvous ports for the process groups a train rank hosts: held from the moment they are
chosen, so a busy node cannot take one before the group meets."""

from __future__ import annotations

import multiprocessing
import socket
from typing import Any

import pytest
import torch

from miles.lora import weight_sync


def _receive(spec: weight_sync.UpdateGroupSpec, out) -> None:
    group = weight_sync.join_update_group(spec, 1)
    out.put(weight_sync.receive_tensors(group, ["w"], ["float32"], [[2, 3]])["w"].tolist())
    weight_sync.leave_update_group(group)


def _send_to_a_receiver(spec: weight_sync.UpdateGroupSpec, store, target, args: tuple, send) -> Any:
    """Run `target(spec, *args, queue)` in a fresh process as rank 1, join as rank 0 through
    `store` and call `send(group)`; returns what the receiver put on the queue."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    receiver = context.Process(target=target, args=(spec, *args, out))
    receiver.start()
    try:
        group = weight_sync.join_update_group(spec, 0, store=store)
        send(group)
        received = out.get(timeout=60)
        weight_sync.leave_update_group(group)
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    assert receiver.exitcode == 0
    return received


def _receive_described(spec: weight_sync.UpdateGroupSpec, metadata, bucketed: bool, out) -> None:
    group = weight_sync.join_update_group(spec, 1)
    received = weight_sync.receive_tensors(group, *metadata, bucketed=bucketed)
    out.put({name: (str(t.dtype), list(t.shape), t.tolist()) for name, t in received.items()})
    weight_sync.leave_update_group(group)


@pytest.mark.parametrize("bucketed", [False, True])
def test_tensors_of_several_dtypes_arrive_by_name_one_by_one_or_in_flat_buckets(bucketed):
    """Bucketed: one flat tensor per dtype (interleaved dtypes, strided sources); the receiver
    gets every tensor back under its name, with its dtype, shape and values."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.lora_A": torch.randn(2, 3, generator=gen),
        "a.lora_B": torch.randn(4, 2, generator=gen).to(torch.bfloat16),
        "b.lora_A": torch.randn(3, 5, generator=gen).t(),  # strided
        "b.lora_B": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "steps": torch.tensor([7], dtype=torch.int64),
    }
    store = weight_sync.listening_store("127.0.0.1", timeout_s=60)
    spec = weight_sync.UpdateGroupSpec(master_address="127.0.0.1", master_port=store.port, world_size=2,
                                       group_name=f"dtypes_{int(bucketed)}", backend="gloo", timeout_s=60)

    def send(group) -> None:
        sent = weight_sync.broadcast_tensors(group, tensors, bucketed=bucketed)
        assert sent == sum(t.numel() * t.element_size() for t in tensors.values())

    received = _send_to_a_receiver(spec, store, _receive_described, (weight_sync.tensor_metadata(tensors), bucketed),
                                   send)
    assert list(received) == list(tensors)
    for name, t in tensors.items():
        assert received[name] == (str(t.dtype), list(t.shape), t.tolist())


def test_a_listening_store_holds_its_port_until_the_group_meets():
    store = weight_sync.listening_store("127.0.0.1", timeout_s=60)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))

    spec = weight_sync.UpdateGroupSpec(master_address="127.0.0.1", master_port=store.port, world_size=2,
                                       group_name="held_port_group", backend="gloo", timeout_s=60)
    sent = torch.arange(6, dtype=torch.float32).reshape(2, 3)

    def send(group) -> None:
        assert weight_sync.broadcast_tensors(group, {"w": sent}) == 24

    assert _send_to_a_receiver(spec, store, _receive, (), send) == sent.tolist()


def _receive_several(spec: weight_sync.UpdateGroupSpec, metadata, times: int, out) -> None:
    group = weight_sync.join_update_group(spec, 1)
    for _ in range(times):
        received = weight_sync.receive_tensors(group, *metadata, bucketed=True)
        out.put({name: t.tolist() for name, t in received.items()})
    weight_sync.leave_update_group(group)


def test_a_kept_export_is_sent_without_reading_it_back_until_a_newer_one_replaces_it():
    """A train rank keeps the newest export of each adapter and broadcasts it from there: the
    object store is read only for an export it no longer keeps (replaced, or forgotten)."""
    from miles.backends.rank.sender import UpdateGroupSender

    gen = torch.Generator().manual_seed(1)
    old = {"a.lora_A": torch.randn(2, 3, generator=gen), "a.lora_B": torch.randn(3, 2, generator=gen).t()}
    new = {name: t * 2 for name, t in old.items()}
    reads: list[str] = []

    def read(export: dict[str, torch.Tensor], export_id: str):
        return lambda: reads.append(export_id) or export

    sender = UpdateGroupSender(torch.device("cpu"))
    host, port = sender.endpoint()
    spec = weight_sync.UpdateGroupSpec(master_address=host, master_port=port, world_size=2, group_name="kept",
                                       backend="gloo", timeout_s=60)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    receiver = context.Process(target=_receive_several, args=(spec, weight_sync.tensor_metadata(old), 5, out))
    receiver.start()
    try:
        sender.join(spec)
        sender.keep("a", "e1", old)
        assert sender.broadcast_kept("e1", read(old, "e1"), ["kept"], bucketed=True) == {}
        assert sender.broadcast_kept("e1", read(old, "e1"), ["kept"], bucketed=True) == {}  # laid out once
        sender.keep("a", "e2", new)  # the adapter's newer export replaces e1
        assert sender.broadcast_kept("e1", read(old, "e1"), ["kept"], bucketed=True) == {}
        assert sender.broadcast_kept("e2", read(new, "e2"), ["kept"], bucketed=True) == {}
        sender.forget("a")  # the adapter left its slot
        assert sender.broadcast_kept("e2", read(new, "e2"), ["kept"], bucketed=True) == {}
        received = [out.get(timeout=60) for _ in range(5)]
        assert sender.broadcast_kept("e2", read(new, "e2"), ["gone"], bucketed=True) == {"gone": "not joined"}
    finally:
        sender.leave()
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    assert receiver.exitcode == 0
    assert reads == ["e1", "e2"]
    expected = [old, old, old, new, new]
    assert received == [{name: t.tolist() for name, t in sent.items()} for sent in expected]


def _receive_into_given_buffers(spec: weight_sync.UpdateGroupSpec, metadata, out) -> None:
    group = weight_sync.join_update_group(spec, 1)
    given: list[torch.Tensor] = []

    def buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
        given.append(torch.full((numel,), -1.0).to(dtype))
        return given[-1]

    received = weight_sync.receive_tensors(group, *metadata, bucketed=True, buffer=buffer)
    pointers = {t.data_ptr() for t in given}
    out.put(({name: t.tolist() for name, t in received.items()},
             all(t.untyped_storage().data_ptr() in pointers for t in received.values()), len(given)))
    weight_sync.leave_update_group(group)


def test_a_receiver_can_give_the_flat_buckets_it_receives_into():
    """An engine keeps its receive buffers between pushes (a fresh one faults in its pages):
    `buffer(numel, dtype)` gives each bucket's tensor, and what arrives are views of it."""
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
               "c": torch.arange(4, dtype=torch.float32)}
    store = weight_sync.listening_store("127.0.0.1", timeout_s=60)
    spec = weight_sync.UpdateGroupSpec(master_address="127.0.0.1", master_port=store.port, world_size=2,
                                       group_name="given", backend="gloo", timeout_s=60)
    received, views, buckets = _send_to_a_receiver(
        spec, store, _receive_into_given_buffers, (weight_sync.tensor_metadata(tensors),),
        lambda group: weight_sync.broadcast_tensors(group, tensors, bucketed=True))
    assert received == {name: t.tolist() for name, t in tensors.items()}
    assert views and buckets == 2  # one per dtype
