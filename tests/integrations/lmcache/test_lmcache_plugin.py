"""`ems.integrations.lmcache.EmsRemoteConnector` built by LMCache's own storage-backend creation
(`CreateStorageBackends` → `RemoteBackend` → its plugin loading) from the `remote_storage_plugins` and `extra_config`
a user writes: two LMCache instances (each its own local CPU backend) share chunks through a real `ems.pool` node
(the host's local node, in a temporary folder); what moves is LMCache's own memory objects, a get filling an object
of the reading instance's allocator in place; a killed node gives misses, never errors; bad keys are refused naming
them.

Runs where lmcache is importable (CI: `.venv-vllm`, see .ci/run); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import threading
import time

import pytest


def _installed(name: str) -> bool:
    """The package is installed (this folder, on sys.path's tests/integrations, is only a namespace of that name)."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


pytestmark = pytest.mark.skipif(not _installed("lmcache"), reason="lmcache is not installed (pip install lmcache==0.5.6)")

CHUNK = 32  # tokens per LMCache chunk: [2, 2 layers, 32 tokens, 32] float16 = 8 KiB, two 4 KiB slots


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture
def node(tmp_path):
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    directory = str(tmp_path / "pool")
    local = ensure_local_pool(directory, "64MiB")
    yield directory, local
    stop_local_pool(directory)


def plugin_extra(directory: str, name: str = "ems", **settings) -> dict:
    extra = {
        f"remote_storage_plugin.{name}.module_path": "ems.integrations.lmcache",
        f"remote_storage_plugin.{name}.class_name": "EmsRemoteConnector",
        f"remote_storage_plugin.{name}.local_pool_dir": directory,
    }
    extra.update({f"remote_storage_plugin.{name}.{k}": v for k, v in settings.items()})
    return extra


def lmcache_config(extra: dict, plugins=("ems",)):
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_dict(
        {
            "chunk_size": CHUNK,
            "local_cpu": True,
            "max_local_cpu_size": 0.02,
            "remote_storage_plugins": list(plugins),
            "extra_config": extra,
        }
    )


def metadata(worker_id: int = 0):
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name="test-org/tiny-model",
        world_size=2,
        local_world_size=2,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.float16,
        kv_shape=(2, 2, CHUNK, 4, 8),
        chunk_size=CHUNK,
    )


@pytest.fixture
def instances(loop):
    """`make(extra)` → LMCache's storage backends of one instance; every backend is closed at the end."""
    made: list = []

    def make(extra: dict, worker_id: int = 0, plugins=("ems",)):
        from lmcache.v1.storage_backend import CreateStorageBackends

        backends = CreateStorageBackends(lmcache_config(extra, plugins), metadata(worker_id), loop, dst_device="cpu")
        made.append(backends)
        return backends

    yield make
    for backends in made:
        for backend in reversed(list(backends.values())):
            try:
                backend.close()
            except Exception:
                pass


def key(i: int, worker_id: int = 0):
    import torch
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey("test-org/tiny-model", 2, worker_id, 1000 + i, torch.float16)


def filled(local, seed: int):
    """A full-chunk memory object of `local`'s allocator, filled with random bytes."""
    import torch

    obj = local.allocate(metadata().get_shapes(), metadata().get_dtypes(), None)
    gen = torch.Generator().manual_seed(seed)
    obj.raw_data[: obj.get_size()].copy_(torch.randint(0, 256, (obj.get_size(),), dtype=torch.uint8, generator=gen))
    return obj


def raw(obj) -> bytes:
    return bytes(obj.byte_array)


class PutsDone:
    """`on_complete_callback` for LMCache's put forms: `wait(keys)` returns once each key's put has completed.

    LMCache 0.5.6's batched form does not list its keys in `put_tasks` (only the single form does), so
    `exists_in_put_tasks` says nothing about a batch still running: its per-key completion callback is the one signal.
    """

    def __init__(self) -> None:
        self.done: set = set()
        self.cond = threading.Condition()

    def __call__(self, key) -> None:
        with self.cond:
            self.done.add(key)
            self.cond.notify_all()

    def wait(self, keys, timeout_s: float = 20.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.done.issuperset(keys), timeout_s):
                raise AssertionError(f"puts did not finish: {len(set(keys) - self.done)} of {len(keys)} pending")


def connector(remote):
    """The plugin's own object inside LMCache's instrumented wrapper."""
    from ems.integrations.lmcache import EmsRemoteConnector

    conn = getattr(remote.connection, "_connector", remote.connection)
    assert isinstance(conn, EmsRemoteConnector)
    return conn


def test_two_instances_share_chunks_filled_in_place(node, instances, loop):
    directory, _ = node
    a = instances(plugin_extra(directory))
    b = instances(plugin_extra(directory))
    remote_a, remote_b = a["RemoteBackend-ems"], b["RemoteBackend-ems"]
    keys = [key(i) for i in range(5)]
    objs = [filled(a["LocalCPUBackend"], i) for i in range(5)]
    expected = [raw(o) for o in objs]
    puts = PutsDone()
    remote_a.batched_submit_put_task(keys[:4], objs[:4], on_complete_callback=puts)  # the batched form
    remote_a.submit_put_task(keys[4], objs[4], on_complete_callback=puts)  # the single form
    puts.wait(keys)
    for obj in objs:
        obj.ref_count_down()
    assert remote_b.batched_contains(keys) == 5
    assert remote_b.contains(keys[0]) is True
    conn_b = connector(remote_b)
    assert asyncio.run_coroutine_threadsafe(conn_b.exists(keys[1]), loop).result(20) is True
    assert asyncio.run_coroutine_threadsafe(conn_b.batched_async_contains("l", keys, True), loop).result(20) == 5
    got = remote_b.batched_get_blocking(keys[:4])
    single = remote_b.get_blocking(keys[4])
    region = conn_b.region
    for obj, want in zip([*got, single], expected):
        assert obj is not None and raw(obj) == want
        assert region.base <= obj.data_ptr < region.base + region.memory.numel()  # in B's own allocator buffer
        obj.ref_count_down()
    # another TP rank's chunk with the same hash is another key
    assert remote_b.batched_contains([key(0, worker_id=1)]) == 0


def test_an_allocator_aligned_to_the_chunk_moves_a_chunk_as_one_slot(node, instances):
    directory, _ = node
    default = connector(instances(plugin_extra(directory))["RemoteBackend-ems"])
    assert (default.unit, default.slots_per_chunk) == (4096, 2)  # LMCache's default alignment: 4 KiB runs
    extra = {**plugin_extra(directory), "local_cpu.pinned_align_bytes": 8192}
    a = instances(extra)
    conn = connector(a["RemoteBackend-ems"])
    assert (conn.unit, conn.slots_per_chunk) == (8192, 1)
    obj = filled(a["LocalCPUBackend"], 11)
    a["RemoteBackend-ems"].submit_put_task(key(400), obj).result(20)
    got = instances(extra)["RemoteBackend-ems"].get_blocking(key(400))  # an instance of the same alignment
    assert got is not None and raw(got) == raw(obj)
    got.ref_count_down()
    obj.ref_count_down()
    # values are laid out by slots: an instance of another alignment has another namespace (a miss, never
    # bytes in another order)
    assert default.exists_sync(key(400)) is False


def test_misses_give_none_and_a_batched_get_returns_the_hit_prefix(node, instances):
    directory, _ = node
    a = instances(plugin_extra(directory))
    keys = [key(100 + i) for i in range(3)]
    obj = filled(a["LocalCPUBackend"], 7)
    a["RemoteBackend-ems"].submit_put_task(keys[0], obj).result(20)
    obj.ref_count_down()
    remote = a["RemoteBackend-ems"]
    assert remote.get_blocking(keys[1]) is None
    assert remote.contains(keys[1]) is False
    got = remote.batched_get_blocking(keys)
    assert got[0] is not None and got[1:] == [None, None]
    got[0].ref_count_down()
    assert remote.batched_contains(keys) == 1


def test_a_killed_node_gives_misses_not_errors(node, instances):
    directory, local = node
    a = instances(plugin_extra(directory, timeout_ms=1000, lookup_timeout_ms=300))
    remote = a["RemoteBackend-ems"]
    keys = [key(200 + i) for i in range(2)]
    obj = filled(a["LocalCPUBackend"], 3)
    remote.submit_put_task(keys[0], obj).result(20)
    obj.ref_count_down()
    os.kill(local.pid, signal.SIGKILL)
    assert remote.contains(keys[0]) is False
    assert remote.batched_contains(keys) == 0
    assert remote.get_blocking(keys[0]) is None
    assert remote.batched_get_blocking(keys) == [None, None]
    obj = filled(a["LocalCPUBackend"], 4)
    future = remote.submit_put_task(keys[1], obj)  # LMCache never waits for a put: a failed one is counted
    assert future.exception(20) is not None
    deadline = time.monotonic() + 5
    while remote.put_failed_count != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert remote.put_failed_count == 1
    obj.ref_count_down()


def test_a_batched_put_the_pool_did_not_take_is_logged(node, instances, caplog):
    """LMCache 0.5.6 drops a batched put's exception (its callback never reads the future): the plugin says it."""
    directory, local = node
    a = instances(plugin_extra(directory, timeout_ms=1000, lookup_timeout_ms=300))
    remote = a["RemoteBackend-ems"]
    keys = [key(300 + i) for i in range(2)]
    objs = [filled(a["LocalCPUBackend"], 30 + i) for i in range(2)]
    os.kill(local.pid, signal.SIGKILL)
    puts = PutsDone()
    with caplog.at_level("WARNING", logger="ems.integrations.lmcache"):
        remote.batched_submit_put_task(keys, objs, on_complete_callback=puts)
        puts.wait(keys)
    assert any("a batched put of 2 chunks failed" in r.getMessage() for r in caplog.records)
    assert remote.batched_contains(keys) == 0
    for obj in objs:
        obj.ref_count_down()


def test_the_fs_backend_and_the_plugin_side_by_side(node, instances, tmp_path):
    """Two plugins of one instance, LMCache's fs and this one: each stores what it is given."""
    directory, _ = node
    extra = {**plugin_extra(directory), "remote_storage_plugin.fs.base_path": str(tmp_path / "fs")}
    a = instances(extra, plugins=("fs", "ems"))
    assert {"RemoteBackend-fs", "RemoteBackend-ems"} <= set(a)
    obj = filled(a["LocalCPUBackend"], 9)
    a["RemoteBackend-ems"].submit_put_task(key(300), obj).result(20)
    a["RemoteBackend-fs"].submit_put_task(key(300), obj).result(20)
    for name in ("RemoteBackend-ems", "RemoteBackend-fs"):
        got = a[name].get_blocking(key(300))
        assert raw(got) == raw(obj)
        got.ref_count_down()
    obj.ref_count_down()


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"timeout_ms": "soon"}, "extra_config.remote_storage_plugin.ems.timeout_ms"),
        ({"io_threads": 0}, "extra_config.remote_storage_plugin.ems.io_threads"),
        ({"pool_nodes": ["no-port"]}, "pool_nodes"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_configuration_is_refused_naming_the_key(tmp_path, instances, loop, bad, named):
    from lmcache.v1.exceptions import IrrecoverableException
    from lmcache.v1.storage_backend.connector import CreateConnector

    extra = plugin_extra(str(tmp_path), local_pool="off", **bad)
    backends = instances(extra)
    assert "RemoteBackend-ems" not in backends  # LMCache logged the refusal and created no backend for it
    with pytest.raises(IrrecoverableException, match=named):
        CreateConnector("plugin://ems", loop, backends["LocalCPUBackend"], lmcache_config(extra), None, plugin_name="ems")
