"""`WarmNodes`: a client keeps a bounded set of remote nodes connected, closing the least recently used once idle,
never one used within the idle time (a call may be in flight on it), never a node in this process."""

from __future__ import annotations

import time

import pytest

from ems.backends.fanout import WarmNodes
from ems.transport.base import NodeLocation


class Node:
    """What `WarmNodes` uses of a `NodeClient`: where it lives, and `close`."""

    def __init__(self, address: str, location: NodeLocation = NodeLocation.REMOTE) -> None:
        self.address = address
        self.location = location
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_the_least_recently_used_idle_nodes_are_closed_beyond_the_limit():
    warm = WarmNodes(limit=3, idle_s=0.05)
    nodes = [Node(f"n{i}") for i in range(6)]
    for node in nodes[:4]:
        warm.used(node)
    assert [n.closed for n in nodes] == [0] * 6  # over the limit, but nothing idle yet: nothing closed
    time.sleep(0.08)
    warm.used(nodes[1])  # n1 used again: the most recent
    warm.used(nodes[4])
    assert [n.closed for n in nodes[:5]] == [1, 0, 1, 0, 0], "the two least recently used idle nodes (n0, n2) closed"
    assert len(warm) == 3
    warm.used(nodes[0])  # a closed node used again counts again (it reconnects by itself)
    assert len(warm) <= 4


def test_nodes_in_this_process_are_not_tracked():
    warm = WarmNodes(limit=1, idle_s=0)
    local = [Node(f"l{i}", NodeLocation.IN_PROCESS) for i in range(3)]
    for node in local:
        warm.used(node)
    assert len(warm) == 0 and all(n.closed == 0 for n in local)


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        WarmNodes(limit=0)
