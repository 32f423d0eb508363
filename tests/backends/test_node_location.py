"""Where a pool client's nodes live (`NodeClient.location`) decides its read cache, local-only reads and threads:
nodes in this process are called on the calling thread and always serve; one node elsewhere makes the pool remote."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from ems_testlib import keyed
from fault_injection import FaultyNode

from ems.backends.pool_client import PoolClient
from ems.buffers import Buffer
from ems.records import Deadline
from ems.store.kv_store import KvStore
from ems.store.value_format import ExpectedValues, ValueKind, build_headers, checksum
from ems.transport.base import NodeLocation
from ems.transport.inprocess import InProcessNode
from ems.types import CcKvOption


def _value() -> bytes:
    """A well-formed value (a node's store checks what it is given)."""
    payload = b"payload"
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 7, np.zeros(1, dtype=np.uint64), np.full(1, len(payload), dtype=np.int64))
    return build_headers(expected, [checksum([payload])])[0] + payload


class _RemoteRecorder(FaultyNode):
    """A node elsewhere (as every `FaultyNode`), recording the threads its gets ran on."""

    def __init__(self, address: str) -> None:
        super().__init__(InProcessNode(KvStore(1 << 20)), address)
        self.threads: list[int] = []

    def get(self, keys: Sequence[bytes], deadline: Deadline | float) -> list[Buffer | None]:
        self.threads.append(threading.get_ident())
        return super().get(keys, deadline)


class _LocalRecorder(InProcessNode):
    """A node in this process, recording the threads its gets ran on."""

    def __init__(self, address: str) -> None:
        super().__init__(KvStore(1 << 20))
        self.address = address
        self.threads: list[int] = []

    def get(self, keys: Sequence[bytes], deadline: Deadline | float) -> list[Buffer | None]:
        self.threads.append(threading.get_ident())
        return super().get(keys, deadline)


def test_nodes_in_this_process_serve_local_only_reads_without_a_read_cache():
    node = InProcessNode(KvStore(1 << 20))
    assert node.location is NodeLocation.IN_PROCESS
    pool = PoolClient([node], read_cache_capacity=1 << 20)
    try:
        assert pool.location is NodeLocation.IN_PROCESS and pool.read_cache is None
        assert pool.describe() == "embedded" and pool.healthy()
        assert pool.put(keyed([b"k"], CcKvOption()), [[_value()]]).results == [True]
        # a local-only read still reaches the node: it is in this process
        got = pool.get(keyed([b"k"], CcKvOption(read_local_only=True))).results
        assert [None if v is None else bytes(v) for v in got] == [_value()]
    finally:
        pool.close()


def test_one_node_elsewhere_makes_the_pool_remote():
    remote = FaultyNode(InProcessNode(KvStore(1 << 20)), address="n1:1")
    assert remote.location is NodeLocation.REMOTE
    pool = PoolClient([InProcessNode(KvStore(1 << 20)), remote], read_cache_capacity=1 << 20)
    try:
        assert pool.location is NodeLocation.REMOTE and pool.read_cache is not None
        assert pool.put(keyed([b"k"], CcKvOption(write_rcache=False)), [[_value()]]).results == [True]
        # a local-only read does not leave the process: the read cache holds nothing, so it misses
        assert pool.get(keyed([b"k"], CcKvOption(read_local_only=True))).results == [None]
        got = pool.get(keyed([b"k"], CcKvOption())).results
        assert [None if v is None else bytes(v) for v in got] == [_value()]
    finally:
        pool.close()


def test_remote_nodes_are_called_on_the_fan_out_threads_in_process_ones_inline():
    keys = [bytes([i]) for i in range(32)]
    for recorder, inline in ((_RemoteRecorder, False), (_LocalRecorder, True)):
        nodes = [recorder("n1:1"), recorder("n2:1")]
        pool = PoolClient(nodes)
        try:
            pool.router.get(keyed(keys, CcKvOption(), Deadline.after(5.0)))
            threads = [t for node in nodes for t in node.threads]
            assert len(threads) == 2 and all((t == threading.get_ident()) is inline for t in threads)
        finally:
            pool.close()
