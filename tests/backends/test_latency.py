"""`NodeLatency`: a request stopped past the abort delay (`FanOut.abandon`) marks its node slow at once; one slow
answer averaged in does not."""

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
