"""The client against a real pool node at the protocol's limits (issue 7, defects 6 and 7): a call larger than one
request allows is split transparently, and a huge timeout is clamped, never an OverflowError."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: ems_testlib

from ems_testlib import direct_cc, fill_random, make_cache, snapshot, tensors

from ems import CcKvOption, CcResult
from ems.transport import protocol

pytestmark = pytest.mark.slow


def test_saving_more_blocks_than_one_request_holds_to_one_node(pool_nodes, node_clients):
    node = pool_nodes("64MiB")
    n = protocol.MAX_KEYS + 4464  # 70,000 blocks, all owned by the one node
    cc = direct_cc([node_clients(node.address)])
    try:
        cache = make_cache(layers=1, blocks=n, block_size=1, heads=1, head_size=2)  # 8 bytes per block
        cc.register_kvcache(cache)
        original = snapshot(cache)
        slots = torch.arange(n)
        hashes = list(range(10**6, 10**6 + n))
        offsets = [1] * n
        option = CcKvOption(timeout=60_000)
        assert cc.save(slots, hashes, offsets, option) == CcResult(n, n)
        assert cc.exists(hashes, option) == CcResult(n, n)
        for t in tensors(cache):
            fill_random(t)
        assert cc.load(slots, hashes, offsets, option) == CcResult(n, n)
        for t, o in zip(tensors(cache), original):
            assert torch.equal(t.view(torch.uint8), o.view(torch.uint8))
    finally:
        cc.close()


@pytest.mark.parametrize("timeout", [2**62, 2**100])
def test_a_huge_timeout_is_clamped_not_an_overflow(pool_nodes, node_clients, timeout):
    node = pool_nodes("16MiB")
    cc = direct_cc([node_clients(node.address)])
    try:
        cache = make_cache(layers=1, blocks=4, block_size=2)
        cc.register_kvcache(cache)
        original = snapshot(cache)
        option = CcKvOption(timeout=timeout)
        assert cc.save([0, 1, 2, 3], [1, 2], [2, 2], option) == CcResult(2, 2)
        assert cc.exists([1, 2], option) == CcResult(2, 2)
        for t in tensors(cache):
            fill_random(t)
        assert cc.load([0, 1, 2, 3], [1, 2], [2, 2], option) == CcResult(2, 2)
        assert all(torch.equal(t[:2].view(torch.uint8), o[:2].view(torch.uint8)) for t, o in zip(tensors(cache), original))
    finally:
        cc.close()
