"""The key-value store behind every pool: the embedded pool and each pool node use this same code.

Contract:
* Keys are opaque `bytes` (the client has already folded tenant, model, rank and layout into them).
* A value is an EMS value (`value_format`): `put` refuses a malformed or damaged one (bad header, wrong length,
  wrong checksum), so a torn write is never stored.
* Capacity is a hard limit in bytes (keys, values and a fixed per-entry overhead); when full, the least recently
  used entries are evicted. A value that alone exceeds the capacity is refused. Never an out-of-memory.
* `get` returns the stored immutable `bytes` object: the caller may read it after the entry is evicted.
  `put_owned` stores a buffer the caller hands over without copying it (a pool node's receive buffer); the caller
  promises never to write to it again, and `get` then returns that buffer.
* Thread-safe: one lock, held only for index updates, never while checksumming or copying.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from ems.value_format import Buffer, is_well_formed

ENTRY_OVERHEAD = 96  # bytes charged per entry for the index, so many tiny values cannot exceed the capacity


@dataclass
class StoreStats:
    entries: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
    puts: int = 0
    rejected_puts: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class KvStore:
    """A bounded, thread-safe LRU store of EMS values."""

    def __init__(self, capacity_bytes: int, verify_on_put: bool = True) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._verify_on_put = verify_on_put
        self._entries: "OrderedDict[bytes, Buffer]" = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity_bytes=capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @staticmethod
    def _charge(key: bytes, value: Buffer) -> int:
        return len(key) + memoryview(value).nbytes + ENTRY_OVERHEAD

    def put(self, key: bytes, parts: Sequence[Buffer]) -> bool:
        """Store the concatenation of `parts` under `key` (replacing any old value); False if refused."""
        value = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        return self.put_owned(key, value)

    def put_owned(self, key: bytes, value: Buffer) -> bool:
        """Store `value` itself (no copy) under `key`; the caller never writes to it again. False if refused."""
        charge = self._charge(key, value)
        if charge > self._capacity or (self._verify_on_put and not is_well_formed(value)):
            with self._lock:
                self._stats.rejected_puts += 1
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= self._charge(key, old)
            while self._used + charge > self._capacity:
                evicted_key, evicted = self._entries.popitem(last=False)
                self._used -= self._charge(evicted_key, evicted)
                self._stats.evictions += 1
            self._entries[key] = value
            self._used += charge
            self._stats.puts += 1
        return True

    def put_many(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> list[bool]:
        return [self.put(key, parts) for key, parts in zip(keys, values)]

    def get(self, key: bytes) -> Optional[Buffer]:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            return value

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[Buffer]]:
        return [self.get(key) for key in keys]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            value = self._entries.pop(key, None)
            if value is None:
                return False
            self._used -= self._charge(key, value)
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0

    def stats(self) -> StoreStats:
        with self._lock:
            self._stats.entries = len(self._entries)
            self._stats.used_bytes = self._used
            return StoreStats(**vars(self._stats))
