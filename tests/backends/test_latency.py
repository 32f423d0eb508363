"""`NodeLatency`: a request stopped past the abort delay (`FanOut.abandon`) marks its node slow at once; one slow
answer averaged in does not, nor a new node's first answers (too few to judge)."""

from __future__ import annotations

from ems.backends.latency import NodeLatency

BLOCK = 64 << 10


def _learned() -> NodeLatency:
    latency = NodeLatency()
    for _ in range(5):
        for address in ("a", "b", "c"):
            latency.observe(address, BLOCK, 0.002)
    assert not latency.slow("a")
    return latency


def test_a_stopped_request_marks_its_node_slow_at_once():
    latency = _learned()
    latency.stopped("a", BLOCK, 0.05)  # stopped after 50 ms without its answer (typical: 2 ms)
    assert latency.slow("a") and not latency.slow("b") and not latency.slow("c")
    assert latency.expected(BLOCK) < 0.005  # the typical node is still the fast ones


def test_one_slow_answer_is_averaged_in_and_a_recovered_node_is_fast_again():
    latency = _learned()
    latency.observe("a", BLOCK, 0.05)
    assert not latency.slow("a")  # one slow answer among fast ones: averaged in
    latency.stopped("a", BLOCK, 0.05)
    assert latency.slow("a")
    for _ in range(10):
        latency.observe("a", BLOCK, 0.002)  # it answers fast again
    assert not latency.slow("a")


def test_a_new_nodes_first_slow_answer_is_no_verdict_but_its_next_ones_are():
    """A node's first request pays for connecting: one slow answer of a new node does not mark it slow (reads would
    then skip it for `RETRY_SLOW_S`), a few slow ones do."""
    latency = _learned()
    latency.observe("d", 0, 0.05)  # 50 ms against a typical 2 ms
    assert not latency.slow("d")
    latency.observe("d", 0, 0.05)
    assert not latency.slow("d")
    latency.observe("d", 0, 0.05)
    assert latency.slow("d")


def test_a_new_node_stopped_once_is_slow_at_once():
    latency = _learned()
    latency.stopped("d", BLOCK, 0.05)
    assert latency.slow("d")
    latency.observe("d", BLOCK, 0.05)  # still slow, answering: not cleared for having few answers
    assert latency.slow("d")


def test_a_node_slow_at_moving_bytes_is_slow_whatever_its_round_trip():
    """Nodes that only serve large requests (a load's share) are judged at that size: a node 5x slower at moving
    4 MiB is slow, though no small request ever measured its round trip."""
    latency = NodeLatency()
    large = 4 << 20
    for _ in range(5):
        for address in ("a", "b", "c"):
            latency.observe(address, large, 0.004)
    for _ in range(3):
        latency.observe("d", large, 0.020)
    assert latency.slow("d") and not latency.slow("a")


def test_a_node_a_little_slower_is_not_slow():
    latency = _learned()
    for _ in range(5):
        latency.observe("d", BLOCK, 0.005)  # 2.5x the typical 2 ms: a busy host's noise, not a slow node
    assert not latency.slow("d")
