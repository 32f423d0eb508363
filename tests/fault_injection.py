"""A fault-injecting `NodeClient`: wraps a real node (usually `InProcessNode(KvStore(cap))`) and misbehaves on demand.

    node = FaultyNode(InProcessNode(KvStore(1 << 20)))
    node.drop_puts_for(lambda key: ...)   # chosen puts are acknowledged False and never stored
    node.corrupt_stored(key, "flip")      # damage a stored value in place (flip a byte / truncate / replace)
    node.corrupt_gets = "flip"            # damage every value on its way back
    node.fail = True                      # every call raises TransportError(EMS_IO_ERROR)
    node.delay_s = 0.2                    # every call sleeps first (with `self_timed`, at most until its deadline,
                                          # then times out)
    node.hang = True                      # every call blocks until `release()` (past any timeout)
    node.partitioned = True               # every call waits out its deadline, then times out (a cut link; with
                                          # `self_timed = True`, a transport that bounds its calls, like UcxNode)
    node.abort()                          # calls sleeping or hanging now fail at once, as UcxNode.abort does

Keys are the storage keys the client computed: `namespace (16 bytes) | form byte | caller's key`;
`v1_key_suffix(h)` is the tail of a V1 block hash's key, so `key.endswith(...)`/`key[17:] ==` selects a block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from ems.buffers import Buffer
from ems.datapath.keys import encode_hash
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport.base import NodeClient, TransportError
from ems.transport.exists_holds import Hold

NAMESPACE_PREFIX = 17  # 16-byte namespace + 1 form byte


def v1_key_suffix(block_hash: int) -> bytes:
    return encode_hash(block_hash)


def is_block(key: bytes, block_hashes: Iterable[int]) -> bool:
    suffix = key[NAMESPACE_PREFIX:]
    return any(suffix == encode_hash(h) for h in block_hashes)


def damage(value: bytes, mode: str, position: int | None = None) -> bytes:
    """`flip`: invert one payload byte (the last unless `position`); `header`: flip a header byte;
    `truncate`: drop the last byte; `empty`: nothing left."""
    data = bytearray(value)
    if mode == "flip":
        i = len(data) - 1 if position is None else position
        data[i] ^= 0xFF
    elif mode == "header":
        data[8 if position is None else position] ^= 0x01
    elif mode == "truncate":
        del data[-1:]
    elif mode == "empty":
        data = bytearray()
    else:
        raise ValueError(mode)
    return bytes(data)


class FaultyNode(NodeClient):
    def __init__(self, inner: NodeClient, address: str | None = None) -> None:
        self.inner = inner
        self.address = address or f"faulty-{id(self):x}"
        self.fail = False
        self.delay_s = 0.0
        self.hang = False
        self.partitioned = False
        self.corrupt_gets: str | None = None
        self._drop: Callable[[bytes], bool] = lambda key: False
        self._released = threading.Event()
        self._aborts = 0  # bumped by abort(): a sleeping or hanging call that sees it change fails
        self._abort_event = threading.Condition()
        self.aborted = 0
        self.calls = {"put": 0, "get": 0, "exists": 0, "ping": 0}
        self.dropped: list[bytes] = []

    # ---- configuration ----

    def drop_puts_for(self, predicate: Callable[[bytes], bool]) -> None:
        self._drop = predicate

    def drop_blocks(self, block_hashes: Sequence[int]) -> None:
        hashes = list(block_hashes)
        self._drop = lambda key: is_block(key, hashes)

    @property
    def store(self):  # the wrapped KvStore
        return self.inner.store  # type: ignore[attr-defined]

    def stored_keys(self) -> list[bytes]:
        return list(self.store._entries.keys())

    def corrupt_stored(self, key: bytes, mode: str = "flip", replacement: bytes | None = None) -> None:
        """Replace the stored value of `key` behind the store's back (as a torn write or a bad disk would)."""
        store = self.store
        with store._lock:
            old = bytes(store._entries[key])
            store._entries[key] = replacement if replacement is not None else damage(old, mode)

    def release(self) -> None:
        self._released.set()

    def abort(self) -> None:
        with self._abort_event:
            self._aborts += 1
            self.aborted += 1
            self._abort_event.notify_all()

    def _sleep(self, seconds: float) -> None:
        """Sleep `seconds`, or fail at once when `abort()` is called meanwhile (what an aborted connection does)."""
        with self._abort_event:
            start, end = self._aborts, time.monotonic() + seconds
            while self._aborts == start and time.monotonic() < end:
                self._abort_event.wait(end - time.monotonic())
            if self._aborts != start:
                raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.address}: aborted")

    # ---- the misbehaviour ----

    def _before(self, op: str, timeout_s: float) -> None:
        self.calls[op] += 1
        if self.fail:
            raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.address}: injected failure")
        if self.delay_s:
            left = Deadline.within(timeout_s).left()
            if self.self_timed and self.delay_s > left:  # a transport that bounds its calls gives up at the deadline
                self._sleep(left)
                raise TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{self.address}: no answer in time (slow)")
            self._sleep(self.delay_s)
        if self.partitioned:
            self._sleep(Deadline.within(timeout_s).left())
            raise TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{self.address}: no answer in time (partitioned)")
        if self.hang:
            start, end = self._aborts, time.monotonic() + 30.0
            while not self._released.wait(0.02) and time.monotonic() < end:
                if self._aborts != start:
                    raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.address}: aborted")

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], timeout_s: float) -> list[bool]:
        self._before("put", timeout_s)
        keep = [i for i, k in enumerate(keys) if not self._drop(k)]
        self.dropped.extend(k for k in keys if self._drop(k))
        stored = self.inner.put([keys[i] for i in keep], [values[i] for i in keep], timeout_s) if keep else []
        results = [False] * len(keys)
        for i, ok in zip(keep, stored):
            results[i] = ok
        return results

    def get(self, keys: Sequence[bytes], timeout_s: float) -> list[Buffer | None]:
        self._before("get", timeout_s)
        values = self.inner.get(keys, timeout_s)
        if self.corrupt_gets:
            values = [None if v is None else damage(bytes(v), self.corrupt_gets) for v in values]
        return values

    def exists(self, keys: Sequence[bytes], timeout_s: float, hold: Hold | None = None) -> list[bool]:
        self._before("exists", timeout_s)
        return self.inner.exists(keys, timeout_s, hold)

    def ping(self, timeout_s: float) -> bool:
        self.calls["ping"] += 1
        return not self.fail and not self.hang
