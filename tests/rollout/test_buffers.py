"""Bounded per-adapter buffers: the oldest group goes first when full, and is counted."""

from __future__ import annotations

import pytest

from miles.rollout.buffers import MAX_BUFFERED_GROUPS, AdapterBuffers
from tests.helpers.rollout_fakes import make_group, make_run


def test_full_buffer_drops_the_oldest_and_counts_it():
    a, b = make_run("a", 0), make_run("b", 1)
    buffers = AdapterBuffers(capacity=3)
    for i in range(5):
        buffers.put(make_group(a, i))
    buffers.put(make_group(b, 0))
    assert [g.samples[0].group_index for g in buffers.get("a").pop(3)] == [2, 3, 4]
    assert buffers.overflow_drops == {"a": 2}
    assert buffers.queue_lengths() == {"a": 0, "b": 1}
    with pytest.raises(ValueError, match="cannot pop 2 groups from a buffer of 1"):
        buffers.get("b").pop(2)
    assert buffers.discard("b") == 1 and buffers.names() == ["a"]


def test_default_bound_is_a_thousand_groups():
    a = make_run("a", 0)
    buffers = AdapterBuffers()
    for i in range(MAX_BUFFERED_GROUPS + 7):
        buffers.put(make_group(a, i))
    assert MAX_BUFFERED_GROUPS == 1000
    assert len(buffers.get("a")) == 1000 and buffers.overflow_drops["a"] == 7
