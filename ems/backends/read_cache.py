"""The local read cache: values this client wrote (or read) kept in this process, served before the pool is asked.

Contract:
* A `ReadCache` is a `KvStore` of `capacity` bytes in this process (evicting the least recently used); the pool
  client puts it in front of its nodes for remote pools only (the embedded pool is local already).
* `remember(keys, values, stored)` keeps the values a put stored (the caller decides when: `write_rcache`).
* `lookup`, `place` and `contains` answer what the cache holds, in request order, and leave the rest to the pool
  (None / False). With `expected` (value i of the call is `expected`'s value i), an entry that is not exactly the
  expected value (damaged, or written by another layout) is dropped from the cache and reported missing, so it never
  shadows a good copy in the pool. `place` copies a value into the caller's buffer only when its length is the
  buffer's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ems.buffers import Buffer
from ems.store.kv_store import KvStore
from ems.store.value_format import ExpectedValues, matches


class ReadCache:
    """A client-side cache of values; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        self.store = KvStore(capacity, verify_on_put=False)

    def remember(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], stored: Sequence[bool]) -> None:
        for key, value, ok in zip(keys, values, stored):
            if ok:
                self.store.put(key, value)

    def lookup(self, keys: Sequence[bytes], expected: ExpectedValues | None = None) -> list[Buffer | None]:
        """Each key's cached value, or None."""
        results = self.store.get_many(keys)
        if expected is not None:
            for i, value in enumerate(results):
                if value is not None and not matches(value, expected, i):
                    self.store.delete(keys[i])
                    results[i] = None
        return results

    def place(self, keys: Sequence[bytes], outs: Sequence[Buffer], expected: ExpectedValues | None = None) -> list[bool]:
        """Copy each cached value into `outs[i]`; True where it was there with exactly that buffer's length."""
        placed = [False] * len(keys)
        for i, value in enumerate(self.store.get_many(keys)):
            if value is None:
                continue
            if expected is not None and not matches(value, expected, i):
                self.store.delete(keys[i])
                continue
            out = memoryview(outs[i]).cast("B")
            source = memoryview(value).cast("B")
            if source.nbytes == out.nbytes:
                out[:] = source
                placed[i] = True
        return placed

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self.store.contains_many(keys)
