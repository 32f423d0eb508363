"""EmsHiCacheStorage through SGLang's own code: `StorageBackendFactory` builds it from the JSON a user writes, SGLang's
`MHATokenToKVPoolHost` (every layout it offers on CPU) is the memory that moves, and real `ems.pool` nodes hold the
pages. Two host pools ("servers", one in a process of its own) share pages byte-exact; a killed node gives misses,
not errors; bad configs are refused naming the key; exists is SGLang's prefix count; ranks get their namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.storage", reason="SGLang is not installed (CI: its own venv, .ci/run)")

from sglang_testlib import build, extra, fill, host_pool, mla_host_pool, page_bytes, page_indices, storage_config

from ems import Ems, EmsException
from ems.datapath.keys import namespace
from ems.integrations.sglang.backend import EmsHiCacheStorage, page_hash
from ems.integrations.sglang.namespace import storage_identity

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def keys_of(n: int, salt: int = 0) -> list[str]:
    """SGLang-like page keys: 64 hex digits (SHA-256)."""
    import hashlib

    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def same_pages(a, pages_a: list[int], b, pages_b: list[int]) -> bool:
    return all(torch.equal(page_bytes(a, p), page_bytes(b, q)) for p, q in zip(pages_a, pages_b))


def switch_server() -> None:
    """A second server in this process: SGLang runs one backend per process (`Ems.init` once per process)."""
    Ems.shutdown()


def test_loaded_by_sglangs_factory_from_user_json(pool_nodes):
    node = pool_nodes()
    host = host_pool("layer_first")
    backend = build(extra([node.address]), host)
    assert isinstance(backend, EmsHiCacheStorage)
    assert backend.config.interface_v1 and backend.config.lease_ms == 10_000


@pytest.mark.parametrize("layout", LAYOUTS)
def test_registered_without_a_copy(pool_nodes, layout):
    """The registered planes are views of SGLang's kv_buffer, and a get writes the host pool itself."""
    node = pool_nodes()
    host = host_pool(layout)
    fill(host, 1)
    backend = build(extra([node.address]), host)
    start = host.kv_buffer.data_ptr()
    end = start + host.kv_buffer.numel() * host.kv_buffer.element_size()
    for pair in backend._planes:
        for plane in pair:
            assert plane.untyped_storage().data_ptr() == host.kv_buffer.untyped_storage().data_ptr()
            assert start <= plane.data_ptr() < end
    keys = keys_of(3)
    before = [page_bytes(host, p) for p in (0, 5, 6)]
    assert backend.batch_set_v1(keys, page_indices(host, [0, 5, 6])) == [True] * 3
    fill(host, 2)
    assert backend.batch_get_v1(keys, page_indices(host, [7, 1, 2])) == [True] * 3
    assert all(torch.equal(page_bytes(host, p), b) for p, b in zip((7, 1, 2), before))


def test_page_bytes_oracle_matches_sglang():
    host = host_pool("layer_first")
    fill(host, 3)
    flat = host.get_data_page(2 * host.page_size, flat=True).contiguous().view(torch.uint8)
    assert torch.equal(page_bytes(host, 2).reshape(-1), flat)


@pytest.mark.parametrize(("writer", "reader"), [("layer_first", "page_first"), ("page_first_direct", "layer_first")])
def test_two_servers_share_pages_byte_exact(pool_nodes, writer, reader):
    """Server A saves pages from its host pool; server B (another layout) gets them into other host pages."""
    nodes = [pool_nodes(), pool_nodes()]
    config = extra([n.address for n in nodes])
    a = host_pool(writer)
    fill(a, 10)
    keys = keys_of(12)
    pages_a = [3, 1, 7, 2, 5, 9, 11, 4, 6, 8, 10, 12]
    server_a = build(config, a)
    assert server_a.batch_set_v1(keys, page_indices(a, pages_a)) == [True] * 12
    switch_server()
    b = host_pool(reader)
    fill(b, 20)
    server_b = build(config, b)
    assert server_b.batch_exists(keys) == 12
    pages_b = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    assert server_b.batch_get_v1(keys, page_indices(b, pages_b)) == [True] * 12
    assert same_pages(a, pages_a, b, pages_b)


def test_second_server_in_its_own_process(pool_nodes):
    """Two processes, each with its own SGLang host pool and backend, share pages through the pool nodes."""
    node = pool_nodes()
    config = extra([node.address])
    a = host_pool("page_first")
    fill(a, 30)
    keys = keys_of(6, salt=1)
    pages = [5, 4, 3, 2, 1, 0]
    assert build(config, a).batch_set_v1(keys, page_indices(a, pages)) == [True] * 6
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(HERE / "second_server.py"), json.dumps(config), "layer_first", ",".join(keys)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    import hashlib

    assert answer["exists"] == 6 and answer["got"] == [True] * 6
    assert answer["digests"] == [hashlib.sha256(page_bytes(a, p).numpy().tobytes()).hexdigest() for p in pages]


def test_batch_exists_is_the_prefix_count(pool_nodes):
    node = pool_nodes()
    host = host_pool("layer_first")
    fill(host, 4)
    backend = build(extra([node.address]), host)
    keys = keys_of(6, salt=2)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:2] + keys[3:], page_indices(host, [0, 1, 3, 4, 5])) == [True] * 5
    assert backend.batch_exists(keys) == 2  # keys[2] is missing: the count stops there
    assert backend.batch_exists(keys[3:]) == 3
    assert backend.batch_exists([]) == 0
    # a get of a batch with a hole: the pages up to the hole, then misses
    assert backend.batch_get_v1(keys, page_indices(host, [10, 11, 12, 13, 14, 15])) == [True, True] + [False] * 4


def test_a_killed_node_gives_misses_not_errors(pool_nodes):
    node = pool_nodes()
    host = host_pool("page_first")
    fill(host, 5)
    backend = build(extra([node.address], timeout_ms=1000, read_cache_capacity=0), host)  # (no local copies)
    keys = keys_of(4, salt=3)
    assert backend.batch_set_v1(keys, page_indices(host, [0, 1, 2, 3])) == [True] * 4
    before = host.kv_buffer.view(torch.uint8).clone()
    node.kill()
    started = time.monotonic()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, page_indices(host, [4, 5, 6, 7])) == [False] * 4
    assert backend.batch_set_v1(keys_of(2, salt=4), page_indices(host, [8, 9])) == [False] * 2
    assert backend.exists(keys[0]) is False
    assert time.monotonic() - started < 15  # each call within its timeout, no hang
    assert torch.equal(host.kv_buffer.view(torch.uint8), before)  # a failed get wrote nothing


def test_pool_down_at_start_misses_then_serves(pool_nodes):
    """A pool that does not answer when SGLang attaches: the backend is built, every call misses, and once the node
    answers (asked again at most every RETRY_INIT_S) pages move."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    host = host_pool("layer_first")
    fill(host, 6)
    backend = build(extra([f"127.0.0.1:{port}"], connect_timeout_ms=1500), host)
    keys = keys_of(2, salt=5)
    assert backend.batch_set_v1(keys, page_indices(host, [0, 1])) == [False, False]
    assert backend.batch_exists(keys) == 0
    from pool_testlib import PoolProcess

    node = PoolProcess("64MiB", port=port)
    try:
        deadline = time.monotonic() + 30
        while backend.batch_set_v1(keys, page_indices(host, [0, 1])) != [True, True]:
            assert time.monotonic() < deadline, "the backend never reached the node that came up"
            time.sleep(0.5)
        assert backend.batch_exists(keys) == 2
    finally:
        node.cleanup()


@pytest.mark.parametrize(
    ("more", "named"),
    [
        ({"pool_node": "127.0.0.1:1"}, "unknown keys ['pool_node']"),
        ({"timeout_ms": -1}, "hicache_storage_backend_extra_config.timeout_ms"),
        ({"lease_ms": 10**9}, "hicache_storage_backend_extra_config.lease_ms"),
        ({"interface_v1": "yes"}, "hicache_storage_backend_extra_config.interface_v1"),
        ({"local_pool": "maybe"}, "hicache_storage_backend_extra_config.local_pool"),
        ({"model_id": "Bad Id"}, "hicache_storage_backend_extra_config.model_id"),
        ({"pool_replicas": 0}, "pool_replicas"),
    ],
)
def test_bad_configs_refused_naming_the_key(more, named):
    host = host_pool("layer_first")
    with pytest.raises(EmsException) as info:
        build(extra(["127.0.0.1:1"], **more), host)
    assert named in info.value.message()


def test_unsupported_layout_refused_naming_it(pool_nodes):
    node = pool_nodes()
    host = host_pool("layer_first")
    host.layout = "page_unified"  # (SGLang's unified layout needs a device; its name is what is refused)
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra([node.address])), host)
    with pytest.raises(ValueError, match="page_unified"):
        backend.register_mem_pool_host(host)


def _ns(**fields) -> bytes:
    cc = storage_identity(storage_config(None, **fields), None)
    return namespace(None, cc, 1)


def test_namespace_holds_every_rank_field_that_decides_the_bytes():
    base = _ns(tp_rank=0, tp_size=2)
    assert _ns(tp_rank=1, tp_size=2) != base  # TP ranks hold different heads
    assert _ns(tp_rank=0, tp_size=4) != base
    assert _ns(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2) != _ns(tp_rank=0, tp_size=2, pp_size=2)
    assert _ns(tp_rank=0, tp_size=2, attn_cp_rank=1, attn_cp_size=2) != _ns(tp_rank=0, tp_size=2, attn_cp_size=2)
    assert _ns(tp_rank=0, tp_size=2, model_name="other/model") != base
    assert _ns(tp_rank=0, tp_size=2, dp_rank=1) == base  # DP replicas hold the same bytes
    assert _ns(tp_rank=0, tp_size=2, is_page_first_layout=True) == base  # the stored value does not depend on it
    # MLA: one copy shared by the TP ranks
    assert _ns(tp_rank=1, tp_size=2, mla=True) == _ns(tp_rank=0, tp_size=2, mla=True) != base
    # MLA with decode context parallelism: each DCP rank holds its own slice of a page's tokens
    mla_dcp = dict(tp_size=2, mla=True, dcp_size=2, logical_page_size=8)
    assert _ns(tp_rank=0, dcp_rank=0, **mla_dcp) != _ns(tp_rank=1, dcp_rank=1, **mla_dcp)


@pytest.mark.parametrize("mla", [False, True])
def test_tp_ranks_through_the_pool(pool_nodes, mla):
    """Rank 0 of TP 2 saves; rank 1 (another server process's rank) finds its pages only for MLA."""
    node = pool_nodes()
    config = extra([node.address])
    host = host_pool("layer_first")
    fill(host, 7)
    keys = keys_of(3, salt=6)
    rank0 = build(config, host, tp_rank=0, tp_size=2, mla=mla)
    assert rank0.batch_set_v1(keys, page_indices(host, [0, 1, 2])) == [True] * 3
    switch_server()
    rank1 = build(config, host_pool("layer_first"), tp_rank=1, tp_size=2, mla=mla)
    assert rank1.batch_exists(keys) == (3 if mla else 0)


def test_legacy_interface_copies_flat_pages(pool_nodes):
    """interface_v1 off: SGLang's generic path (`get_data_page` → batch_set; batch_get into dummy flat pages →
    `set_from_flat_data_page`), as its cache controller runs it."""
    node = pool_nodes()
    config = extra([node.address], interface_v1=0)
    a = host_pool("page_first")
    fill(a, 8)
    backend = build(config, a)
    keys = keys_of(3, salt=7)
    page = a.page_size
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set(keys, [a.get_data_page(p * page) for p in (1, 2, 3)]) is True
    assert backend.batch_exists(keys) == 3 and backend.exists(keys[0])
    got = backend.batch_get(keys + keys_of(1, salt=8), [a.get_dummy_flat_data_page() for _ in range(4)])
    assert got[3] is None and all(isinstance(t, torch.Tensor) for t in got[:3])
    for p, data in zip((10, 11, 12), got[:3]):
        a.set_from_flat_data_page(p * page, data)
    assert same_pages(a, [1, 2, 3], a, [10, 11, 12])
    single = backend.get(keys[1])
    assert single is not None and torch.equal(single.view(torch.uint8), a.get_data_page(2 * page).view(torch.uint8))


def test_page_hash_is_deterministic():
    assert page_hash("ff") == 255 and page_hash("a" * 64) == int("a" * 64, 16)
    assert page_hash("x" * 70) == page_hash("x" * 70) != page_hash("x" * 71)
    assert page_hash("f" * 65) < 1 << 256


def test_storage_metrics_as_sglang_reads_them(pool_nodes):
    """With SGLang's --enable-storage-metrics, get_stats gives its `StorageMetrics` (its collector asserts the type)."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    node = pool_nodes()
    host = host_pool("layer_first")
    backend = build(extra([node.address]), host, enable_storage_metrics=True)
    keys = keys_of(3, salt=9)
    assert backend.batch_set_v1(keys, page_indices(host, [0, 1, 2])) == [True] * 3
    assert backend.batch_get_v1(keys, page_indices(host, [3, 4, 5])) == [True] * 3
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics) and stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # each figure is reported once


@pytest.mark.parametrize(("writer", "reader"), [("layer_first", "page_first"), ("page_first_direct", "layer_first")])
def test_mla_pages_shared_by_tp_ranks_byte_exact(pool_nodes, writer, reader):
    """SGLang's MLA host pool (latent and rope parts registered as K and V, no copy): TP rank 0 writes (SGLang's
    storage writer), rank 1 of another server with another layout reads the same bytes."""
    node = pool_nodes()
    config = extra([node.address])
    a = mla_host_pool(writer)
    fill(a, 40)
    keys = keys_of(5, salt=10)
    rank0 = build(config, a, tp_rank=0, tp_size=2, mla=True)
    for pair in rank0._planes:
        assert all(t.untyped_storage().data_ptr() == a.kv_buffer.untyped_storage().data_ptr() for t in pair)
    assert rank0.batch_set_v1(keys, page_indices(a, [1, 2, 3, 4, 5])) == [True] * 5
    switch_server()
    b = mla_host_pool(reader)
    fill(b, 41)
    rank1 = build(config, b, tp_rank=1, tp_size=2, mla=True)
    assert rank1.batch_exists(keys) == 5
    assert rank1.batch_get_v1(keys, page_indices(b, [10, 9, 8, 7, 6])) == [True] * 5
    assert same_pages(a, [1, 2, 3, 4, 5], b, [10, 9, 8, 7, 6])


def test_a_hung_node_costs_at_most_the_timeout(pool_nodes):
    """A node that stops answering (SIGSTOP): every call returns misses within its timeout, none hangs SGLang's
    prefetch or backup thread."""
    node = pool_nodes()
    host = host_pool("layer_first")
    fill(host, 11)
    backend = build(extra([node.address], timeout_ms=1000, read_cache_capacity=0), host)
    keys = keys_of(4, salt=11)
    assert backend.batch_set_v1(keys, page_indices(host, [0, 1, 2, 3])) == [True] * 4
    node.pause()
    try:
        for call in (
            lambda: backend.batch_exists(keys) == 0,
            lambda: backend.batch_get_v1(keys, page_indices(host, [4, 5, 6, 7])) == [False] * 4,
            lambda: backend.batch_set_v1(keys_of(2, salt=12), page_indices(host, [8, 9])) == [False] * 2,
        ):
            started = time.monotonic()
            assert call()
            assert time.monotonic() - started < 6  # the 1 s timeout, with room for a loaded machine
    finally:
        node.resume()


def test_pages_with_their_prefix_keys_are_stored_by_unit_and_shared(pool_nodes):
    """With `hicache_storage_pass_prefix_keys`, SGLang hands each batch the keys of the pages before it: the pages
    are stored under their placement unit (`chain_prefix`: the scale issue's key form) and a second server that passes the same
    prefix finds them, batch by batch, as SGLang's prefetch asks (prefix_keys grown by each batch's keys); one that
    passes none places pages by their own key and does not meet them."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    node = pool_nodes()
    config = extra([node.address], hicache_storage_pass_prefix_keys=True)
    a = host_pool("layer_first")
    fill(a, 40)
    keys = keys_of(8, salt=7)
    server_a = build(config, a)
    first, second = keys[:4], keys[4:]
    assert server_a.batch_set_v1(first, page_indices(a, [0, 1, 2, 3]), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4
    assert server_a.batch_set_v1(second, page_indices(a, [4, 5, 6, 7]), HiCacheStorageExtraInfo(prefix_keys=first)) == [True] * 4
    switch_server()
    b = host_pool("page_first")
    fill(b, 50)
    server_b = build(config, b)
    assert server_b.batch_exists(second, HiCacheStorageExtraInfo(prefix_keys=first)) == 4
    assert (
        server_b.batch_get_v1(second, page_indices(b, [10, 11, 12, 13]), HiCacheStorageExtraInfo(prefix_keys=first)) == [True] * 4
    )
    assert same_pages(a, [4, 5, 6, 7], b, [10, 11, 12, 13])
    assert server_b.batch_exists(second, HiCacheStorageExtraInfo(prefix_keys=None)) == 0  # placed by key: not met
