"""Rendezvous ports for the process groups a train rank hosts: held from the moment they are
chosen, so a busy node cannot take one before the group meets."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from miles.backends import weight_sync


def _receive(spec: weight_sync.UpdateGroupSpec, out) -> None:
    group = weight_sync.join_update_group(spec, 1)
    out.put(weight_sync.receive_tensors(group, ["w"], ["float32"], [[2, 3]])["w"].tolist())
    weight_sync.leave_update_group(group)


def test_a_listening_store_holds_its_port_until_the_group_meets():
    store = weight_sync.listening_store("127.0.0.1", timeout_s=60)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))

    spec = weight_sync.UpdateGroupSpec(master_address="127.0.0.1", master_port=store.port, world_size=2,
                                       group_name="held_port_group", backend="gloo", timeout_s=60)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    receiver = context.Process(target=_receive, args=(spec, out))
    receiver.start()
    try:
        group = weight_sync.join_update_group(spec, 0, store=store)
        sent = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        assert weight_sync.broadcast_tensors(group, {"w": sent}) == 24
        assert out.get(timeout=60) == sent.tolist()
        weight_sync.leave_update_group(group)
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    assert receiver.exitcode == 0
