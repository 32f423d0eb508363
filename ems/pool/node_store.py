"""What a pool node needs of the store it serves (`NodeStore`), and how a tenant's keys are stored in it.

Contract:
* `NodeStore` (a Protocol; `ems.store.kv_store.KvStore` and `ems.pool.tiered_store.TieredStore` are ones, see
  `KvStore` for the contract in full): allocation and recycling of value buffers with reservations, storing owned
  or copied values (checked in one batch), lookups, reads into the caller's buffers, holds, and the memory figures
  a node logs (`NodeStoreStats`).
* Tenants: every key a node stores is the tenant's namespace (`tenant_prefix(access_id)`: the id, u16
  length-prefixed, so no two tenants' prefixes overlap) followed by the client's key; `split_tenant` parses one
  back (None when it does not parse).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ems.buffers import Buffer
from ems.transport.exists_holds import Hold


def tenant_prefix(access_id: str) -> bytes:
    """The namespace of a tenant's keys: its id, length-prefixed so no two tenants' prefixes overlap."""
    raw = access_id.encode("ascii")
    return struct.pack("<H", len(raw)) + raw


def split_tenant(stored_key: bytes) -> tuple[str, bytes] | None:
    """(tenant id, the client's key) of a key as the store holds it (`tenant_prefix` + key), or None when it does
    not parse (a node's repair, `ems.pool.repair`, connects to other nodes as each key's tenant)."""
    if len(stored_key) < 2:
        return None
    n = struct.unpack_from("<H", stored_key)[0]
    if len(stored_key) < 2 + n:
        return None
    try:
        return stored_key[2 : 2 + n].decode("ascii"), stored_key[2 + n :]
    except UnicodeDecodeError:
        return None


class NodeStoreStats(Protocol):
    """The memory figures a node logs (`ems.store.kv_store.StoreStats` has them)."""

    used_bytes: int
    spare_bytes: int
    capacity_bytes: int


class NodeStore(Protocol):
    """What the node needs of the store it serves (`ems.store.kv_store.KvStore` is one); see that class for the contract."""

    @property
    def capacity_bytes(self) -> int: ...

    @staticmethod
    def charge_of(key_len: int, nbytes: int) -> int: ...

    def allocate(self, nbytes: int, reserve: int = 0) -> np.ndarray: ...

    def recycle(self, buffer: np.ndarray, reserved: int = 0) -> None: ...

    def put_owned(self, key: bytes, value: Buffer, reserved: int = 0) -> bool: ...

    def put_owned_each(self, keys: Sequence[bytes], values: Sequence[Buffer], reserved: Sequence[int]) -> list[bool]:
        """`put_owned` of each value, the values checked in one batch first (a large batch gives the GIL away once,
        on a worker thread, instead of holding it per value: the event loop keeps progressing UCX meanwhile)."""
        ...

    def put_copied_each(
        self, keys: Sequence[bytes], buffers: Sequence[np.ndarray], sources: Sequence[Buffer], reserved: Sequence[int]
    ) -> list[bool]:
        """`put_owned_each` of `buffers` (from `allocate`), each first filled from the source beside it, copy and
        check in one pass: a save out of memory the client can still write (the copies are what is checked)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]: ...

    def read_into(self, values: Sequence[Buffer], outs: Sequence[Buffer], progress: int = 0, signalled: int = 0) -> None:
        """Copy each value (as `get_many` returned it) into the buffer of `outs` beside it, in one call; `progress`:
        0, or the address of a u32 to publish `i + 1` to after copy i for i < `signalled` (`shm.py`)."""
        ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def hold_many(self, keys: Sequence[bytes], hold: Hold) -> list[bool]:
        """Lease or pin each key held (`ems.store.index.Holds`); True where it is held and kept as asked."""
        ...

    def stats(self) -> NodeStoreStats: ...
