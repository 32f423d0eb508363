"""EmsHiCacheStorage's v2 calls (hybrid models) through SGLang's own code: `StorageBackendFactory` builds the backend,
SGLang's `HostPoolGroup` holds its real host pools (the KV anchor `MHATokenToKVPoolHost`, an SWA
`MHATokenToKVPoolHost`, a `MambaPoolHost`), registered as `HybridCacheController.attach_storage_backend` does, and
its `PoolTransfer`s drive `batch_set_v2` / `batch_get_v2` / `batch_exists_v2` against real `ems.pool` nodes. Pages
move byte-exact between two servers of other layouts; pools never share a key; the hit is the prefix every pool can
restore; a killed node gives misses; a pool the backend cannot view misses instead of raising."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.storage", reason="SGLang is not installed (CI: its own venv, .ci/run)")

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult
from sglang_testlib import (
    build_hybrid,
    dsa_pools,
    extra,
    fill,
    fill_mamba,
    host_pool,
    hybrid_group,
    mamba_host_pool,
    page_bytes,
    page_indices,
    storage_config,
)

from ems import Ems, EmsException
from ems.integrations.sglang.backend import page_hash
from ems.integrations.sglang.namespace import pool_model_id

TRAILING, ALL = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES


def keys_of(n: int, salt: int) -> list[str]:
    return [hashlib.sha256(f"v2:{salt}:{i}".encode()).hexdigest() for i in range(n)]


def slots(*indices: int) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.int64)


def state(host, slot: int) -> torch.Tensor:
    """A Mamba slot's bytes as SGLang itself flattens them (`MambaPoolHost.get_data_page`)."""
    return host.get_data_page(slot).view(torch.uint8).clone()


def hybrid_server(config, kv_layout: str, mamba_layout: str, swa_layout: str, seed: int, **more):
    kv, mamba, swa = host_pool(kv_layout), mamba_host_pool(mamba_layout, side_state=True), host_pool(swa_layout, layers=2)
    fill(kv, seed)
    fill_mamba(mamba, seed + 1)
    fill(swa, seed + 2)
    backend = build_hybrid(config, hybrid_group(kv, mamba=mamba, swa=swa), **more)
    return backend, kv, mamba, swa


def test_hybrid_pages_move_byte_exact_between_two_servers(pool_nodes):
    """Server A backs up 6 KV pages, the Mamba state at the last page and the SWA window of the last 2 pages; server
    B (every pool in another layout) finds all 6 restorable and gets every pool's bytes exactly."""
    nodes = [pool_nodes(), pool_nodes()]
    config = extra([n.address for n in nodes])
    a, kv_a, mamba_a, swa_a = hybrid_server(config, "page_first", "page_first", "layer_first", 10)
    keys = keys_of(6, 1)
    assert a.batch_set_v1(keys, page_indices(kv_a, [5, 4, 3, 2, 1, 0])) == [True] * 6
    written = a.batch_set_v2(
        [
            PoolTransfer(name=PoolName.MAMBA, host_indices=slots(7), keys=keys[5:], hit_policy=TRAILING),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa_a, [3, 8]), keys=keys[4:], hit_policy=TRAILING),
        ]
    )
    assert written == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    Ems.shutdown()  # a second server (SGLang runs one backend per process)
    b, kv_b, mamba_b, swa_b = hybrid_server(config, "layer_first", "page_first_direct", "page_first", 20)
    query = [
        PoolTransfer(name=PoolName.MAMBA, keys=keys[5:], hit_policy=TRAILING),
        PoolTransfer(name=PoolName.SWA, keys=keys[4:], hit_policy=TRAILING),
    ]
    hits = b.batch_exists_v2(keys, query)
    assert isinstance(hits, PoolTransferResult)
    assert hits.kv_hit_pages == 6 and hits.restorable_prefix_pages == [6]
    assert hits.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6, PoolName.SWA: 6}
    assert b.batch_get_v1(keys, page_indices(kv_b, [10, 11, 12, 13, 14, 15])) == [True] * 6
    got = b.batch_get_v2(
        [
            PoolTransfer(name=PoolName.MAMBA, host_indices=slots(12), keys=keys[5:], hit_policy=TRAILING),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa_b, [20, 21]), keys=keys[4:], hit_policy=TRAILING),
        ]
    )
    assert got == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    assert all(torch.equal(page_bytes(kv_a, p), page_bytes(kv_b, q)) for p, q in zip([5, 4, 3, 2, 1, 0], range(10, 16)))
    assert torch.equal(state(mamba_a, 7), state(mamba_b, 12))
    assert torch.equal(page_bytes(swa_a, 3), page_bytes(swa_b, 20)) and torch.equal(page_bytes(swa_a, 8), page_bytes(swa_b, 21))
    assert not torch.equal(state(mamba_a, 7), state(mamba_b, 11))  # (the neighbours were not written)


def _storages(host) -> set[int]:
    buffers = [host.kv_buffer] if isinstance(host.kv_buffer, torch.Tensor) else list(host.kv_buffer)
    return {b.untyped_storage().data_ptr() for b in buffers}


def test_side_pools_are_registered_without_a_copy(pool_nodes):
    node = pool_nodes()
    backend, _kv, mamba, swa = hybrid_server(extra([node.address]), "layer_first", "page_first", "page_first", 30)
    for name, host in (("mamba", mamba), ("swa", swa)):
        side = backend._side_pools[name]
        assert side.host is host and side.cc.layout is not None
        assert all(t.untyped_storage().data_ptr() in _storages(host) for pair in side.planes for t in pair)
    # a get writes the host pool itself: fill a slot from the pool and read it through SGLang's own flat page
    keys = keys_of(2, 2)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots(1, 2), keys=keys)]) == {
        PoolName.MAMBA: [True, True]
    }
    before = [state(mamba, 1), state(mamba, 2)]
    fill_mamba(mamba, 31)
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots(9, 3), keys=keys)]) == {
        PoolName.MAMBA: [True, True]
    }
    assert torch.equal(state(mamba, 9), before[0]) and torch.equal(state(mamba, 3), before[1])


def test_pools_never_share_a_key(pool_nodes):
    """The same page key in two pools of the same geometry (SWA, draft SWA) and in the KV pool: three values."""
    node = pool_nodes()
    kv, swa, draft = host_pool("layer_first"), host_pool("layer_first"), host_pool("layer_first")
    for i, h in enumerate((kv, swa, draft)):
        fill(h, 40 + i)
    backend = build_hybrid(extra([node.address]), hybrid_group(kv, swa=swa, draft_swa=draft))
    keys = keys_of(3, 3)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa, [0, 1, 2]), keys=keys)]) == {
        PoolName.SWA: [True] * 3
    }
    assert backend.batch_exists(keys) == 0  # not a KV page
    as_draft = [PoolTransfer(name=PoolName.DRAFT_SWA, host_indices=page_indices(draft, [0, 1, 2]), keys=keys)]
    before = draft.kv_buffer.view(torch.uint8).clone()
    assert backend.batch_get_v2(as_draft) == {PoolName.DRAFT_SWA: [False] * 3}
    assert torch.equal(draft.kv_buffer.view(torch.uint8), before)
    assert backend.batch_set_v1(keys, page_indices(kv, [0, 1, 2])) == [True] * 3
    hits = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT_SWA, hit_policy=ALL), PoolTransfer(name=PoolName.SWA)])
    assert hits.kv_hit_pages == 0 and hits.extra_pool_hit_pages == {PoolName.KV: 3}
    assert backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, hit_policy=ALL)]).kv_hit_pages == 3
    # the names, the TP rank (the Mamba state is sharded even for an MLA model) are in the model id
    sc = storage_config(None, tp_rank=1, tp_size=2, mla=True)
    sc0 = storage_config(None, tp_rank=0, tp_size=2, mla=True)
    assert len({pool_model_id(sc, None, n) for n in ("swa", "draft_swa", "mamba", "indexer")}) == 4
    assert pool_model_id(sc, None, "swa") == pool_model_id(sc0, None, "swa")
    assert pool_model_id(sc, None, "mamba") != pool_model_id(sc0, None, "mamba")


def test_exists_v2_is_the_prefix_every_pool_restores(pool_nodes):
    node = pool_nodes()
    backend, kv, _mamba, swa = hybrid_server(extra([node.address]), "page_first", "page_first", "layer_first", 50)
    keys = keys_of(8, 4)
    assert backend.batch_set_v1(keys[:6], page_indices(kv, list(range(6)))) == [True] * 6  # KV: 6 of the 8 pages
    # Mamba states at pages 2 and 5; SWA pages 0..3
    assert backend.batch_set_v2(
        [
            PoolTransfer(name=PoolName.MAMBA, host_indices=slots(2, 5), keys=[keys[2], keys[5]]),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa, [0, 1, 2, 3]), keys=keys[:4]),
        ]
    ) == {PoolName.MAMBA: [True, True], PoolName.SWA: [True] * 4}

    def ask(*transfers):
        return backend.batch_exists_v2(keys, list(transfers))

    mamba_at_end = PoolTransfer(name=PoolName.MAMBA, keys=keys[7:], hit_policy=TRAILING)
    hits = ask(mamba_at_end)
    assert (hits.kv_hit_pages, hits.restorable_prefix_pages) == (6, [6])  # the state after page 5
    assert hits.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6}
    swa_all = PoolTransfer(name=PoolName.SWA, hit_policy=ALL)
    hits = ask(swa_all)
    assert (hits.kv_hit_pages, hits.restorable_prefix_pages) == (4, [1, 2, 3, 4])
    assert ask(swa_all, mamba_at_end).kv_hit_pages == 0  # no prefix both can restore
    # an SWA window of 2 pages ending the KV prefix: pages 4 and 5 are not there
    assert ask(PoolTransfer(name=PoolName.SWA, keys=keys[:2], hit_policy=TRAILING)).kv_hit_pages == 0
    # a state stored before the run that ends the KV prefix is not seen (a shorter hit, never a wrong one)
    assert backend.batch_exists_v2(keys[:5], [mamba_at_end]).kv_hit_pages == 0
    assert backend.batch_exists_v2(keys[:3], [mamba_at_end]).restorable_prefix_pages == [3]
    # a pool this backend does not serve restores nothing; a transfer naming the KV pool gates nothing
    assert ask(PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL)).kv_hit_pages == 0
    assert ask(PoolTransfer(name=PoolName.KV, hit_policy=ALL)).kv_hit_pages == 6
    assert ask().kv_hit_pages == 6 and backend.batch_exists_v2([], [mamba_at_end]).kv_hit_pages == 0


def test_kv_transfers_and_bad_transfers(pool_nodes):
    """A v2 transfer of the KV pool goes through the v1 path; indices that do not cover the keys, an unknown pool
    and a missing key are misses, never exceptions."""
    node = pool_nodes()
    backend, kv, _mamba, swa = hybrid_server(extra([node.address]), "page_first", "page_first", "page_first", 60)
    keys = keys_of(3, 5)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=page_indices(kv, [0, 1, 2]), keys=keys)]) == {
        PoolName.KV: [True] * 3
    }
    assert backend.batch_exists(keys) == 3
    bad = backend.batch_set_v2(
        [
            PoolTransfer(name=PoolName.MAMBA, host_indices=slots(1, 2), keys=keys),  # 2 slots for 3 pages
            PoolTransfer(name=PoolName.SWA, host_indices=None, keys=keys),
            PoolTransfer(name=PoolName.INDEXER, host_indices=page_indices(swa, [0, 1, 2]), keys=keys),
            PoolTransfer(name=PoolName.DRAFT, keys=[]),
        ]
    )
    assert bad == {PoolName.MAMBA: [False] * 3, PoolName.SWA: [False] * 3, PoolName.INDEXER: [False] * 3, PoolName.DRAFT: []}
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots(1, 2), keys=keys[:2])]) == {
        PoolName.MAMBA: [True, True]
    }
    got = backend.batch_get_v2(
        [PoolTransfer(name=PoolName.MAMBA, host_indices=slots(4, 5, 6), keys=[keys[0], keys_of(1, 6)[0], keys[1]])]
    )
    assert got == {PoolName.MAMBA: [True, False, False]}  # up to the first miss


def test_a_killed_node_gives_misses_not_errors(pool_nodes):
    node = pool_nodes()
    backend, kv, mamba, swa = hybrid_server(
        extra([node.address], timeout_ms=1000, read_cache_capacity=0), "page_first", "page_first", "page_first", 70
    )
    keys = keys_of(2, 7)
    assert backend.batch_set_v1(keys, page_indices(kv, [0, 1])) == [True, True]
    transfers = [
        PoolTransfer(name=PoolName.MAMBA, host_indices=slots(1), keys=keys[1:], hit_policy=TRAILING),
        PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa, [0, 1]), keys=keys, hit_policy=TRAILING),
    ]
    assert backend.batch_set_v2(transfers) == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    assert backend.batch_exists_v2(keys, transfers).kv_hit_pages == 2
    memory = [mamba.temporal_buffer.view(torch.uint8).clone(), swa.kv_buffer.view(torch.uint8).clone()]
    node.kill()
    started = time.monotonic()
    hits = backend.batch_exists_v2(keys, transfers)
    assert hits.kv_hit_pages == 0 and not hits.restorable_prefix_pages
    assert backend.batch_get_v2(transfers) == {PoolName.MAMBA: [False], PoolName.SWA: [False, False]}
    assert backend.batch_set_v2(transfers) == {PoolName.MAMBA: [False], PoolName.SWA: [False, False]}
    assert time.monotonic() - started < 20  # each call within its timeout, no hang
    assert torch.equal(mamba.temporal_buffer.view(torch.uint8), memory[0]) and torch.equal(
        swa.kv_buffer.view(torch.uint8), memory[1]
    )
    backend.close()


def test_a_pool_that_cannot_be_viewed_misses(pool_nodes, caplog):
    """A side pool whose layout this backend cannot view (here SGLang's unified layout, by name) is logged at
    registration and misses; the attach goes on."""
    node = pool_nodes()
    kv, odd = host_pool("layer_first"), host_pool("layer_first")
    odd.layout = "page_unified"
    with caplog.at_level("WARNING", logger="ems.sglang"):
        backend = build_hybrid(extra([node.address]), hybrid_group(kv, indexer=odd))
    assert "side pool 'indexer' is not stored" in caplog.text and "page_unified" in caplog.text
    keys = keys_of(2, 8)
    transfer = PoolTransfer(name=PoolName.INDEXER, host_indices=page_indices(odd, [0, 1]), keys=keys)
    assert backend.batch_set_v2([transfer]) == {PoolName.INDEXER: [False, False]}
    assert backend.batch_set_v1(keys, page_indices(kv, [0, 1])) == [True, True]
    assert backend.batch_exists_v2(keys, [transfer]).kv_hit_pages == 0


def test_bad_config_refused_naming_the_key():
    with pytest.raises(EmsException) as info:
        build_hybrid(extra(["127.0.0.1:1"], lease_ms=-1), hybrid_group(host_pool("page_first"), mamba=mamba_host_pool()))
    assert "hicache_storage_backend_extra_config.lease_ms" in info.value.message()


def sglang_controller(backend, group):
    """SGLang's own `HybridCacheController` methods for the storage side (backup, hit query, prefetch), bound to an
    instance that holds only what those methods read: the real controller's constructor needs CUDA events and
    process groups, which a CPU machine does not have."""
    from queue import Queue

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    controller = object.__new__(HybridCacheController)
    controller.page_size = group.page_size
    controller.storage_backend, controller.storage_backend_type = backend, "dynamic"
    controller.mem_pool_host, controller.storage_host_pool = group, group.anchor_entry.host_pool
    controller.storage_config = backend.storage_config  # (its is_storage_writer decides `backup_skip`)
    controller.page_set_func, controller.page_get_func = controller._page_set_zero_copy, controller._page_get_zero_copy
    controller.prefetch_sync_queue, controller.host_mem_release_queue = Queue(), Queue()
    controller.extra_host_mem_release_queues = {}
    return controller


def test_sglangs_hybrid_controller_backs_up_and_prefetches(pool_nodes):
    """SGLang's hybrid controller code drives the backend: its backup of a span (KV pages by batch_set_v1, the
    Mamba state and the SWA window by batch_set_v2), then on a second server its hit query (batch_exists_v2) and
    its prefetch (batch_get_v1, then batch_get_v2 of the side pools), over SGLang's own page hashes of the tokens."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    node = pool_nodes()
    config = extra([node.address])
    kv_a, mamba_a, swa_a = host_pool("page_first"), mamba_host_pool("page_first"), host_pool("layer_first", layers=2)
    fill(kv_a, 80), fill_mamba(mamba_a, 81), fill(swa_a, 82)
    group_a = hybrid_group(kv_a, mamba=mamba_a, swa=swa_a)
    a = sglang_controller(build_hybrid(config, group_a), group_a)
    page = kv_a.page_size
    tokens = list(range(100, 100 + 6 * page))
    hashes = get_storage_hash_str(tokens, None, page_size=page)
    backup = StorageOperation(
        page_indices(kv_a, [9, 8, 7, 6, 5, 4]),
        tokens,
        hash_value=hashes,
        pool_transfers=[
            PoolTransfer(name=PoolName.MAMBA, host_indices=slots(3), keys=hashes[-1:], hit_policy=TRAILING),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa_a, [1, 2]), keys=hashes[-2:], hit_policy=TRAILING),
        ],
    )
    a._page_backup_with_stable_layout(backup)
    assert backup.completed_tokens == 6 * page
    assert backup.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1, PoolName.SWA: 2}

    Ems.shutdown()  # a second server
    kv_b, mamba_b, swa_b = host_pool("layer_first"), mamba_host_pool("page_first_direct"), host_pool("page_first", layers=2)
    fill(kv_b, 90), fill_mamba(mamba_b, 91), fill(swa_b, 92)
    group_b = hybrid_group(kv_b, mamba=mamba_b, swa=swa_b)
    b = sglang_controller(build_hybrid(config, group_b), group_b)
    prefetch = PrefetchOperation(
        CacheRequestHandle(rid="req", attempt_id=0),
        tokens,
        pool_transfers=[
            PoolTransfer(name=PoolName.MAMBA, host_indices=slots(11), keys=[""], hit_policy=TRAILING),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa_b, [5, 6]), keys=["", ""], hit_policy=TRAILING),
        ],
    )
    hit_hashes, hit_tokens = b._storage_hit_query(prefetch)
    assert hit_hashes == hashes and hit_tokens == 6 * page
    assert prefetch.query_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6, PoolName.SWA: 6}
    prefetch.hash_value, prefetch.host_indices = hit_hashes, page_indices(kv_b, [0, 1, 2, 3, 4, 5])
    b._page_transfer_with_stable_layout(prefetch)
    acks = []
    while not b.prefetch_sync_queue.empty():
        acks.append(b.prefetch_sync_queue.get())
    assert acks[0].completed_tokens == 6 * page and acks[-1].pool_hits == {PoolName.MAMBA: 1, PoolName.SWA: 2}
    assert all(torch.equal(page_bytes(kv_a, p), page_bytes(kv_b, q)) for p, q in zip([9, 8, 7, 6, 5, 4], range(6)))
    assert torch.equal(state(mamba_a, 3), state(mamba_b, 11))
    assert torch.equal(page_bytes(swa_a, 1), page_bytes(swa_b, 5)) and torch.equal(page_bytes(swa_a, 2), page_bytes(swa_b, 6))


def test_a_hybrid_server_in_its_own_process(pool_nodes):
    """Two processes, each with SGLang's host pools of a hybrid model and its own backend: the second gets the KV
    pages, the Mamba state and the SWA window the first stored, byte-exact."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    root = here.parent.parent.parent
    node = pool_nodes()
    config = extra([node.address])
    a, kv, mamba, swa = hybrid_server(config, "page_first", "page_first", "layer_first", 100)
    keys = keys_of(4, 9)
    assert a.batch_set_v1(keys, page_indices(kv, [8, 9, 10, 11])) == [True] * 4
    assert a.batch_set_v2(
        [
            PoolTransfer(name=PoolName.MAMBA, host_indices=slots(5), keys=keys[-1:]),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa, [0, 1]), keys=keys[-2:]),
        ]
    ) == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(here), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(here / "second_server.py"), json.dumps(config), "layer_first", ",".join(keys), "hybrid"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])

    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    assert answer["exists"] == 4 and answer["got"] == [True] * 4
    assert answer["exists_v2"] == [4, [4]] and answer["got_v2"] == [[True], [True, True]]
    assert answer["digests"] == [digest(page_bytes(kv, p)) for p in (8, 9, 10, 11)]
    assert answer["mamba"] == digest(mamba.get_data_page(5))
    assert answer["swa"] == [digest(page_bytes(swa, p)) for p in (0, 1)]


def test_pool_down_at_attach_misses_then_serves_side_pools():
    """A pool that does not answer when SGLang attaches a hybrid model's backend: the attach goes on, every v2 call
    misses, and once the node answers the side pools' pages move."""
    import socket

    from pool_testlib import PoolProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend, kv, _mamba, swa = hybrid_server(
        extra([f"127.0.0.1:{port}"], connect_timeout_ms=1500), "page_first", "page_first", "page_first", 110
    )
    keys = keys_of(2, 10)
    transfers = [
        PoolTransfer(name=PoolName.MAMBA, host_indices=slots(1), keys=keys[1:], hit_policy=TRAILING),
        PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa, [0, 1]), keys=keys, hit_policy=TRAILING),
    ]
    assert backend.batch_set_v2(transfers) == {PoolName.MAMBA: [False], PoolName.SWA: [False, False]}
    assert backend.batch_exists_v2(keys, transfers).kv_hit_pages == 0
    node = PoolProcess("64MiB", port=port)
    try:
        deadline = time.monotonic() + 30
        while backend.batch_set_v2(transfers) != {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}:
            assert time.monotonic() < deadline, "the side pools never reached the node that came up"
            time.sleep(0.5)
        assert backend.batch_set_v1(keys, page_indices(kv, [0, 1])) == [True, True]
        assert backend.batch_exists_v2(keys, transfers).restorable_prefix_pages == [2]
    finally:
        backend.close()
        node.cleanup()


@pytest.mark.parametrize(("writer", "reader"), [("page_first", "layer_first"), ("layer_first", "page_first_direct")])
def test_dsa_indexer_pages_move_byte_exact(pool_nodes, writer, reader):
    """SGLang's DSA indexer pool (one buffer row per page, KV-derived: its transfers carry the KV pages' host indices
    and keys, its hit policy all pages) beside its MLA KV pool: TP rank 0 of one server backs up, TP rank 1 of
    another server of another layout finds and gets the same bytes (MLA and its indexer: one copy for the TP ranks)."""
    node = pool_nodes()
    config = extra([node.address])
    kv_a, index_a = dsa_pools(writer)
    fill(kv_a, 120)
    index_a.index_k_with_scale_buffer.random_(0, 256, generator=torch.Generator().manual_seed(121))
    a = build_hybrid(config, hybrid_group(kv_a, indexer=index_a), tp_rank=0, tp_size=2, mla=True)
    assert a._side_pools["indexer"].view.page_slots == 1
    keys, page = keys_of(3, 11), kv_a.page_size
    source = page_indices(kv_a, [2, 0, 5])
    assert a.batch_set_v1(keys, source) == [True] * 3
    assert a.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=source, keys=keys)]) == {PoolName.INDEXER: [True] * 3}
    Ems.shutdown()  # a second server
    kv_b, index_b = dsa_pools(reader)
    fill(kv_b, 130)
    b = build_hybrid(config, hybrid_group(kv_b, indexer=index_b), tp_rank=1, tp_size=2, mla=True)
    hits = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL, indices_from_pool=PoolName.KV)])
    assert hits.kv_hit_pages == 3 and hits.extra_pool_hit_pages == {PoolName.KV: 3, PoolName.INDEXER: 3}
    target = page_indices(kv_b, [7, 6, 1])
    assert b.batch_get_v1(keys, target) == [True] * 3
    assert b.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=target, keys=keys)]) == {PoolName.INDEXER: [True] * 3}
    for p, q in zip([2, 0, 5], [7, 6, 1]):
        assert torch.equal(page_bytes(kv_a, p), page_bytes(kv_b, q))
        assert torch.equal(index_a.get_data_page(p * page).contiguous(), index_b.get_data_page(q * page).contiguous())
    assert not torch.equal(index_a.get_data_page(3 * page).contiguous(), index_b.get_data_page(3 * page).contiguous())


def test_mla_rank_that_does_not_write_kv_still_backs_up_its_mamba_state(pool_nodes):
    """An MLA model's TP rank 1 is not SGLang's storage writer (`backup_skip`): SGLang's hybrid backup writes only
    its Mamba state (TP-sharded), under rank 1's own keys; rank 0 of another server does not meet it."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import StorageOperation
    from sglang_testlib import mla_host_pool

    node = pool_nodes()
    config = extra([node.address])
    kv, mamba = mla_host_pool("page_first"), mamba_host_pool("page_first")
    fill(kv, 140), fill_mamba(mamba, 141)
    group = hybrid_group(kv, mamba=mamba)
    rank1 = sglang_controller(build_hybrid(config, group, tp_rank=1, tp_size=2, mla=True), group)
    assert rank1.backup_skip
    keys = keys_of(3, 12)
    mamba_at_end = PoolTransfer(name=PoolName.MAMBA, host_indices=slots(4), keys=keys[-1:], hit_policy=TRAILING)
    backup = StorageOperation(
        page_indices(kv, [0, 1, 2]), list(range(3 * kv.page_size)), hash_value=keys, pool_transfers=[mamba_at_end]
    )
    rank1._page_backup_with_stable_layout(backup)
    assert backup.completed_tokens == 3 * kv.page_size  # the state was stored: the span counts as backed up
    backend = rank1.storage_backend
    assert backend.batch_exists(keys) == 0  # no KV page written by this rank
    assert backend._side_pools["mamba"].count([page_hash(keys[-1])], backend.option) == 1
    Ems.shutdown()
    rank0 = build_hybrid(
        config, hybrid_group(mla_host_pool("layer_first"), mamba=mamba_host_pool()), tp_rank=0, tp_size=2, mla=True
    )
    assert rank0._side_pools["mamba"].count([page_hash(keys[-1])], rank0.option) == 0
