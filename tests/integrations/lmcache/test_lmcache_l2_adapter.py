"""`ems.integrations.lmcache.EmsL2Adapter` built by LMCache's own L2 adapter loading (`--l2-adapter` JSON →
`parse_args_to_l2_adapters_config` → `create_l2_adapter`, the plugin type) over an L1 arena described as LMCache's
multi-process server describes its own (`L1MemoryDesc`), driven as LMCache's controllers drive an adapter (submit a
task, wait for its event fd, pop or query the result; LMCache's own `check` mode does the same): two adapters over
two arenas share objects through a real `ems.pool` node, in place; a killed node gives failed stores and zero bits;
bad parameters are refused naming them.

Runs where lmcache is importable (CI: `.venv-vllm`); skipped otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import signal

import pytest


def _installed(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


pytestmark = pytest.mark.skipif(not _installed("lmcache"), reason="lmcache is not installed (pip install lmcache==0.5.6)")

ALIGN = 4096
OBJ_BYTES = 3 * ALIGN  # three slots an object


@pytest.fixture
def node(tmp_path):
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    directory = str(tmp_path / "pool")
    local = ensure_local_pool(directory, "64MiB")
    yield directory, local
    stop_local_pool(directory)


class Arena:
    """An L1 arena of `count` aligned objects, as LMCache's memory manager lays them out."""

    def __init__(self, count: int) -> None:
        import torch
        from lmcache.v1.distributed.internal_api import L1MemoryDesc

        self.buffer = torch.zeros(count * OBJ_BYTES + ALIGN, dtype=torch.uint8)
        base = (-self.buffer.data_ptr()) % ALIGN  # the arena starts aligned
        self.arena = self.buffer[base : base + count * OBJ_BYTES]
        self.desc = L1MemoryDesc(ptr=self.arena.data_ptr(), size=self.arena.numel(), align_bytes=ALIGN)

    def obj(self, i: int):
        import torch
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        raw = self.arena[i * OBJ_BYTES : (i + 1) * OBJ_BYTES]
        meta = MemoryObjMetadata(
            shape=torch.Size([OBJ_BYTES]),
            dtype=torch.uint8,
            address=raw.data_ptr(),
            phy_size=OBJ_BYTES,
            fmt=MemoryFormat.KV_2LTD,
            ref_count=1,
        )
        return TensorMemoryObj(raw, meta, parent_allocator=None)


@pytest.fixture
def adapters():
    made: list = []

    def make(params: dict, arena: Arena):
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

        spec = {
            "type": "plugin",
            "module_path": "ems.integrations.lmcache",
            "class_name": "EmsL2Adapter",
            "adapter_params": params,
        }
        config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
        adapter = create_l2_adapter(config.adapters[0], l1_memory_desc=arena.desc)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()


def keys(n: int, rank: int = 0, salt: str = ""):
    from lmcache.v1.distributed.api import ObjectKey

    return [
        ObjectKey(chunk_hash=i.to_bytes(16, "big"), model_name="test-org/tiny", kv_rank=rank, cache_salt=salt) for i in range(n)
    ]


def wait(fd: int, timeout_ms: int = 30_000) -> None:
    from lmcache.v1.platform import consume_fd

    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if not poll.poll(timeout_ms):
        raise AssertionError("the adapter did not signal its event fd")
    consume_fd(fd)


def store(adapter, ks, objs) -> object:
    task = adapter.submit_store_task(ks, objs)
    wait(adapter.get_store_event_fd())
    return adapter.pop_completed_store_tasks()[task]


def lookup(adapter, ks) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(ks, {})
    wait(adapter.get_lookup_and_lock_event_fd())
    return adapter.query_lookup_and_lock_result(task).get_indices_list()


def load(adapter, ks, objs) -> list[int]:
    task = adapter.submit_load_task(ks, objs)
    wait(adapter.get_load_event_fd())
    return adapter.query_load_result(task).get_indices_list()


def test_two_adapters_share_objects_in_place(node, adapters):
    import torch

    directory, _ = node
    a_mem, b_mem = Arena(8), Arena(8)
    a = adapters({"local_pool_dir": directory}, a_mem)
    b = adapters({"local_pool_dir": directory}, b_mem)
    a_mem.arena.copy_(torch.randint(0, 256, (a_mem.arena.numel(),), dtype=torch.uint8))
    ks = keys(4)
    result = store(a, ks, [a_mem.obj(i) for i in (0, 2, 4, 6)])
    assert result.is_successful() and result.bytes_transferred() == 4 * OBJ_BYTES
    assert lookup(b, ks + keys(6)[4:]) == [0, 1, 2, 3]  # the last two were never stored
    assert lookup(b, keys(4, rank=1)) == []  # another KV rank's slice
    assert lookup(b, keys(4, salt="tenant-b")) == []  # another cache salt
    assert load(b, ks, [b_mem.obj(i) for i in (7, 5, 3, 1)]) == [0, 1, 2, 3]
    for src, dst in zip((0, 2, 4, 6), (7, 5, 3, 1)):
        assert torch.equal(b_mem.obj(dst).raw_data, a_mem.obj(src).raw_data)  # in B's own arena
    b.submit_unlock(ks)


def test_a_load_reports_the_loaded_prefix(node, adapters):
    directory, _ = node
    mem = Arena(6)
    a = adapters({"local_pool_dir": directory}, mem)
    ks = keys(3)
    assert store(a, ks[:1], [mem.obj(0)]).is_successful()
    assert load(a, ks, [mem.obj(3), mem.obj(4), mem.obj(5)]) == [0]


def test_a_killed_node_gives_failed_stores_and_no_bits(node, adapters):
    directory, local = node
    mem = Arena(4)
    a = adapters({"local_pool_dir": directory, "timeout_ms": 1000, "lookup_timeout_ms": 300}, mem)
    ks = keys(2)
    assert store(a, ks[:1], [mem.obj(0)]).is_successful()
    os.kill(local.pid, signal.SIGKILL)
    assert lookup(a, ks) == []
    assert load(a, ks[:1], [mem.obj(2)]) == []
    assert not store(a, ks[1:], [mem.obj(1)]).is_successful()


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"timeout_ms": -5}, "adapter_params.timeout_ms"),
        ({"io_threads": "many"}, "adapter_params.io_threads"),
        ({"max_object_bytes": 0}, "adapter_params.max_object_bytes"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_parameters_are_refused_naming_them(tmp_path, adapters, bad, named):
    with pytest.raises(ValueError, match=named):
        adapters({"local_pool": "off", **bad}, Arena(1))


def test_the_guides_l2_adapter_command_is_what_lmcache_parses():
    """The `--l2-adapter` JSON docs/guides/lmcache.md gives is accepted by LMCache's own parser as a plugin adapter
    naming this package's class (the server itself does not run here: see the module docstring)."""
    import re
    from pathlib import Path

    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    page = (Path(__file__).resolve().parents[3] / "docs" / "guides" / "lmcache.md").read_text()
    found = re.search(r"--l2-adapter '(\{.*?\})'", page, re.S)
    assert found, "the guide's --l2-adapter command"
    spec = json.loads(found.group(1))
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    assert config is not None and spec["module_path"] == "ems.integrations.lmcache" and spec["class_name"] == "EmsL2Adapter"
    from ems.integrations import lmcache as plugin

    assert hasattr(plugin, spec["class_name"])
