"""Helpers for the SDK-level tests (tests/client, tests/datapath, tests/backends, tests/store): random paged KV
caches, poisoning, exact byte comparison."""

from __future__ import annotations

import dataclasses
import random
import socket
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from ems import CcConfig, CcKvOption, ContextCaching, EmsConfig
from ems.backends.base import PoolCall
from ems.backends.embedded import EmbeddedPool
from ems.backends.pool_client import PoolClient
from ems.config import parse_size
from ems.datapath.planning import BlockPlan
from ems.records import Deadline
from ems.settings import resolve_settings
from ems.store.value_format import ExpectedValues, ValueKind, build_headers, checksum
from ems.transport.ucx.client import UcxNode

#: run a test that takes the `cc` fixture once per pool backend: the embedded pool, then a real Mooncake Store
on_both_pools = pytest.mark.parametrize("cc", ["embedded", "mooncake"], indirect=True)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]


def fill_random(t: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Overwrite `t` (any view) in place with fresh random data: never zeros, every byte pattern likely."""
    if t.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        info = torch.iinfo(t.dtype)
        src = torch.randint(max(info.min, -(1 << 30)), min(info.max, 1 << 30), t.shape, dtype=t.dtype, generator=gen)
        src[src == 0] = 1
    else:
        src = torch.randn(t.shape, dtype=torch.float32, generator=gen) * 3 + 0.5
        src = torch.where(src.to(t.dtype).to(torch.float32) == 0, torch.full_like(src, 1.5), src).to(t.dtype)
    t.copy_(src)
    return t


def make_cache(
    layers: int = 2,
    blocks: int = 6,
    block_size: int = 4,
    heads: int = 2,
    head_size: int = 8,
    dtype: torch.dtype = torch.float16,
    interleaved: bool = False,
    device: str = "cpu",
) -> list[list[torch.Tensor]]:
    """`[layers][K, V]` of `[blocks, block_size, heads, head_size]`, filled with random data.

    interleaved: one tensor `[blocks, 2, block_size, heads, head_size]` per layer, K = t[:, 0], V = t[:, 1]."""
    cache = []
    for _ in range(layers):
        if interleaved:
            t = torch.empty(blocks, 2, block_size, heads, head_size, dtype=dtype, device=device)
            if device != "meta":
                fill_random(t)
            cache.append([t[:, 0], t[:, 1]])
        else:
            pair = [torch.empty(blocks, block_size, heads, head_size, dtype=dtype, device=device) for _ in range(2)]
            if device != "meta":
                for t in pair:
                    fill_random(t)
            cache.append(pair)
    return cache


def tensors(cache) -> list[torch.Tensor]:
    return [t for pair in cache for t in pair]


def snapshot(cache) -> list[torch.Tensor]:
    return [t.clone() for t in tensors(cache)]


def poison(cache) -> list[torch.Tensor]:
    """Overwrite the whole cache with new random data; return a copy of what it now holds."""
    for t in tensors(cache):
        fill_random(t)
    return snapshot(cache)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def expected_after_load(original: Sequence[torch.Tensor], poisoned: Sequence[torch.Tensor], slots) -> list[torch.Tensor]:
    """Per tensor: the poisoned contents with the rows of `slots` taken from `original`."""
    out = []
    slots = torch.as_tensor(np.asarray(slots, dtype=np.int64))
    for o, p in zip(original, poisoned):
        e = p.clone()
        if slots.numel():
            bs = o.shape[1]
            e[slots // bs, slots % bs] = o[slots // bs, slots % bs]
        out.append(e)
    return out


def assert_cache_equals(cache, expected: Sequence[torch.Tensor]) -> None:
    for i, (t, e) in enumerate(zip(tensors(cache), expected)):
        if not bytes_equal(t, e):
            diff = (as_bytes(t) != as_bytes(e)).reshape(t.shape[0], t.shape[1], -1).any(-1).nonzero().tolist()
            raise AssertionError(f"tensor {i} differs at [block, offset] rows {diff[:10]}")


def slots_of_blocks(block_ids: Sequence[int], block_size: int, offsets: Sequence[int] | None = None) -> list[int]:
    """The slot_mapping of whole blocks (or their first `offsets[i]` tokens)."""
    offsets = offsets or [block_size] * len(block_ids)
    return [b * block_size + o for b, n in zip(block_ids, offsets) for o in range(n)]


def direct_cc(nodes, *, model_id: str = "test-model", cc_config=None, tenant=None, limits=None, **settings) -> ContextCaching:
    """A `ContextCaching` around `PoolClient(nodes)` (with request `limits`, default the protocol's), without
    `Ems.init`."""
    cc_config = cc_config or CcConfig(rank_id=0, device_id=0, model_id=model_id)
    resolved = resolve_settings(EmsConfig(**settings))
    pool = PoolClient(list(nodes)) if limits is None else PoolClient(list(nodes), limits=limits)
    return ContextCaching(cc_config, tenant, pool, resolved)


def embedded_cc(store, *, model_id: str = "test-model", **settings) -> ContextCaching:
    """A `ContextCaching` around `EmbeddedPool(store)` (the pool `Ems.init` builds without nodes), without
    `Ems.init`."""
    cc_config = CcConfig(rank_id=0, device_id=0, model_id=model_id)
    return ContextCaching(cc_config, None, EmbeddedPool(store), resolve_settings(EmsConfig(**settings)))


def set_chunk_bytes(cc: ContextCaching, size: str) -> None:
    """The chunk size of `cc`'s next jobs (`Settings.chunk_bytes`: EMS_CHUNK_BYTES is read once, at `Ems.init`)."""
    cc._settings = dataclasses.replace(cc._settings, chunk_bytes=parse_size("EMS_CHUNK_BYTES", size))


def keyed(
    keys: Sequence[bytes],
    option: CcKvOption | None = None,
    deadline: Deadline | None = None,
    expected: ExpectedValues | None = None,
) -> PoolCall:
    """A pool request whose keys are their own route keys (a test that calls a backend directly), with `option` (the
    default option when None)."""
    return PoolCall(keys, keys, CcKvOption() if option is None else option, deadline, expected)


def store_of_ems():
    """The embedded store behind the initialised `Ems` (white-box: for 'nothing was written' checks)."""
    from ems import Ems

    return Ems._pool.store  # type: ignore[union-attr]


def store_refused_value(address: str, key: bytes, route_key: bytes, plan: BlockPlan, i: int, how: str) -> None:
    """Store under value i's key a well-formed value the load must refuse: of another layout, or another length."""
    payload = np.random.default_rng(i).integers(0, 255, int(plan.expected.payload_len[i]), dtype=np.uint8).tobytes()
    sig = plan.expected.layout_sig ^ (1 if how == "layout" else 0)
    if how == "length":
        payload = payload[:-64]
    expected = ExpectedValues(
        ValueKind.BLOCKS_V1, sig, plan.expected.tokens_digest[i : i + 1], np.array([len(payload)], dtype=np.int64)
    )
    header = build_headers(expected, [checksum([payload])])[0]
    node = UcxNode(address, connect_timeout_ms=2000)
    try:
        assert node.put([key], [[header, payload]], 5.0) == [True]
    finally:
        node.close()


_PORTS = random.SystemRandom()  # (not the test-seeded `random`: two test processes must not draw the same ports)


def free_port() -> int:
    """A loopback TCP port that is free now, below the kernel's ephemeral range: a port from that range (what binding
    port 0 gives) can be taken by any outgoing connection, UCX's included, before the process it was picked for
    binds it, which failed a node's start with "Address already in use"."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for _ in range(200):
        port = _PORTS.randrange(10_000, max(ephemeral_low, 10_001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")
