"""Kernel launches per save and per load, through the public API: one per layer group, whatever the number of blocks.

The embedded pool gathers every value of a request straight into the store's buffers and scatters straight from
the stored values; the pipelined path (pool nodes; here a node behind the fault-injecting wrapper, so the client
does not see an in-process store) gathers into staging. Both must issue one kernel launch per layer group on the
Triton kernels (the interpreter here; triton-ascend's in CI's second run), and at most one op per plane on the
torch path: counts that do not grow with the number of blocks.
"""

from __future__ import annotations

import pytest
import torch

from ems import CcConfig, CcKvOption, ContextCaching, Ems, EmsConfig, StoreLayerGroupDesc
from ems.backends.pool_client import PoolClient
from ems.kernels.select import triton_importable
from ems.store.kv_store import KvStore
from ems.transport.inprocess import InProcessNode
from tests.fault_injection import FaultyNode

BLOCK_SIZE = 4
BACKENDS = ["torch"] + (["triton"] if triton_importable() else [])


def _cache(layers: int, blocks: int, generator: torch.Generator) -> list[list[torch.Tensor]]:
    return [[torch.randn(blocks, BLOCK_SIZE, 2, 8, generator=generator).half() for _ in range(2)] for _ in range(layers)]


def _slots(blocks: list[int]) -> list[int]:
    return [b * BLOCK_SIZE + t for b in blocks for t in range(BLOCK_SIZE)]


def _launches(cc: ContextCaching, call) -> int:  # type: ignore[no-untyped-def]
    backend = cc._backend_for(torch.device("cpu"))
    before = backend.ops_issued
    call()
    return backend.ops_issued - before


def _embedded(backend: str) -> ContextCaching:
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "launches"), pool_capacity="16MiB", kernel_backend=backend))
    cc = Ems.get_cc()
    assert cc is not None
    return cc


def _pipelined(backend: str) -> ContextCaching:
    from ems.settings import resolve_settings

    pool = PoolClient([FaultyNode(InProcessNode(KvStore(16 << 20)))])
    return ContextCaching(CcConfig(0, 0, "launches"), None, pool, resolve_settings(EmsConfig(kernel_backend=backend)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["embedded", "pipelined"])
@pytest.mark.parametrize("groups", [1, 2])
def test_one_launch_per_layer_group_whatever_the_blocks(backend: str, path: str, groups: int) -> None:
    generator = torch.Generator().manual_seed(7 + groups)
    layers, blocks = 2, 12
    cc = _embedded(backend) if path == "embedded" else _pipelined(backend)
    try:
        cache = _cache(layers, blocks, generator)
        descs = None
        if groups == 2:  # one layer per group
            descs = [StoreLayerGroupDesc(BLOCK_SIZE, [0]), StoreLayerGroupDesc(BLOCK_SIZE, [1])]
        cc.register_kvcache(cache, descs) if descs else cc.register_kvcache(cache)
        option = CcKvOption(timeout=60000)
        for count in (1, 3, 6):
            source = list(range(count))
            target = list(range(blocks - count, blocks))
            hashes = [1000 * count + i for i in range(count)]
            offsets = [BLOCK_SIZE] * count
            bound = groups if backend == "triton" else 2 * layers  # launches per layer group; torch: ops per plane
            saved = _launches(cc, lambda: cc.save(_slots(source), hashes, offsets, option))
            assert 1 <= saved <= bound, f"{count} blocks saved with {saved} ops"
            loaded = _launches(cc, lambda: cc.load(_slots(target), hashes, offsets, option))
            assert 1 <= loaded <= bound, f"{count} blocks loaded with {loaded} ops"
            for layer in cache:
                for plane in layer:
                    assert torch.equal(plane[blocks - count :], plane[:count])
    finally:
        if path == "embedded":
            Ems.shutdown()
        else:
            cc.close()
