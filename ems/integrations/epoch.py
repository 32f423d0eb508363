"""The namespace's epoch: one small well-known record per model in the pool, so that a reset reaches every engine.

Contract (no engine imports):
* The record is the V0 key `EPOCH_KEY` in the model's namespace (`Ems.init`'s `model_id`, and the tenant), so
  every engine of one model on one pool reads the same record and engines of other models never see it. Its value
  is 16 random bytes, the key with which `block_transfer` hashes every block key of that epoch.
* `EpochRecord.current()` reads the record; when it is missing (a new pool, or the record was evicted) it writes a
  fresh random epoch and reads it back, so engines that race converge on the last one written (a loser only
  misses what it saved before it learnt the winner). A random epoch, never a counter: a record lost to eviction
  never brings back an old epoch's blocks. A pool that cannot be read gives a private random epoch (only misses)
  and `ok=False`, to be read again later. A client that was shut down raises its refusal (`EMS_INVALID_ARGUMENT`)
  instead: no later read could succeed.
* `EpochRecord.reset()` writes a fresh random epoch: from then on every block saved before is a miss for every
  engine that reads the record. Returns the new epoch, or None when the pool did not take the write (the caller
  reports the reset as failed).
* The record is pinned (`ContextCaching.exists(..., pin=True)` after each write and each read: the pool keeps it
  from eviction until it is replaced), so pressure on the pool cannot silently reset every engine's hits by taking
  it. A pool that cannot pin it (a Mooncake Store: its pins are set at put; a node whose pin budget is used up)
  keeps it as an ordinary value, said once in the log; an engine that then finds it gone writes a fresh epoch (only
  misses, never an old epoch's blocks).
* Writes never go to the client's local read cache (`write_rcache=False`), so a read always asks the pool. One
  record's reads and writes run one at a time (they share its buffer: a read beside a reset could otherwise write
  the old epoch back as the new one).
* `EpochWatch(record, refresh_s)`: one engine's view of the epoch (its scheduler's): read at start, on `reset()`, and
  every `refresh_s` by a daemon thread (never on the engine's step), so a reset by another engine reaches this one
  within `refresh_s`. A read that fails keeps the epoch it had, and so does a read that began before a `reset()`
  ended (it may have read the epoch the reset replaced: taking it would bring back, until the next read, the blocks
  the reset was to hide). It reads again within `RETRY_S` while it has only a
  private epoch (the pool could not be read at start), and `RETRY_S` after it wrote the record (it created it, or
  reset): engines that start, or reset, at the same moment converge on the last one written within `RETRY_S`, not
  `refresh_s` (two engines started together used to save and look up in different epochs for 5 s). Its thread ends
  at `close()` or once the client is shut down (an engine that never closed its watch left a thread retrying, and
  logging, every `RETRY_S` for the rest of the process).
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field

import torch

from ems import CcKvOption, ContextCaching, EmsErrorCode, EmsException, KvBufferWrapper, PrimaryKey

logger = logging.getLogger("ems.integrations")

EPOCH_BYTES = 16
RETRY_S = 0.5  # an `EpochWatch` with a private epoch reads the record again this soon
EPOCH_KEY = PrimaryKey(distribute_key="ems-integrations-epoch", attribute_key="v1")


def new_epoch() -> bytes:
    return secrets.token_bytes(EPOCH_BYTES)


@dataclass(frozen=True)
class EpochRead:
    epoch: bytes
    ok: bool  # False: the pool could not be read; `epoch` is a private one
    # this read found no record and wrote it: another engine may have written one at once (not part of the value)
    wrote: bool = field(default=False, compare=False)


class EpochRecord:
    """Reads and writes one model's epoch record (see the module contract)."""

    def __init__(self, cc: ContextCaching, timeout_ms: int = 5000) -> None:
        self._cc = cc
        self._option = CcKvOption(write_rcache=False, timeout=timeout_ms)
        self._buffer = torch.zeros(EPOCH_BYTES, dtype=torch.uint8)
        self._lock = threading.Lock()  # one read or write at a time: they share `_buffer`
        self.pinned = False  # the last pin asked for was granted
        self._said_unpinned = False

    def _wrapper(self) -> list[list[KvBufferWrapper]]:
        return [[KvBufferWrapper(self._buffer.data_ptr(), EPOCH_BYTES)]]

    def read(self) -> bytes | None:
        """The recorded epoch, or None when there is none; raises EmsException when the pool cannot be read."""
        with self._lock:
            self._buffer.zero_()
            result = self._cc.load(self._option, [EPOCH_KEY], self._wrapper())
            if result.success != 1:
                return None
            epoch = bytes(self._buffer.numpy().tobytes())
        self.pin()
        return epoch

    def write(self, epoch: bytes) -> bool:
        with self._lock:
            self._buffer.copy_(torch.frombuffer(bytearray(epoch[:EPOCH_BYTES]), dtype=torch.uint8))
            try:
                written = self._cc.save(self._option, [EPOCH_KEY], self._wrapper()).success == 1
            except EmsException as exc:
                logger.warning("could not write the namespace epoch: %s", exc.message())
                return False
        if written:
            self.pin()
        return written

    def pin(self) -> bool:
        """Ask the pool to keep the record from eviction (see the module contract); whether it does."""
        self.pinned = self._cc.exists([EPOCH_KEY], self._option, pin=True).success == 1
        if not self.pinned and not self._said_unpinned:
            self._said_unpinned = True
            logger.warning(
                "the pool did not pin the namespace epoch record (a Mooncake Store, or a node's pin budget used up): "
                "eviction may take it, and an engine that finds it gone starts a new epoch (earlier blocks then miss)"
            )
        return self.pinned

    def current(self) -> EpochRead:
        wrote = False
        try:
            epoch = self.read()
            if epoch is None:
                wrote = self.write(new_epoch())
                epoch = self.read()
        except EmsException as exc:
            if exc.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT:
                raise  # refused, not failed: the client was shut down (no later read can succeed)
            logger.warning("could not read the namespace epoch (pool down?): using a private one: %s", exc.message())
            return EpochRead(new_epoch(), False)
        return EpochRead(epoch, True, wrote) if epoch is not None else EpochRead(new_epoch(), False)

    def reset(self) -> bytes | None:
        epoch = new_epoch()
        return epoch if self.write(epoch) else None


class EpochWatch:
    """An engine's view of the namespace epoch (see the module contract)."""

    def __init__(self, record: EpochRecord, refresh_s: float) -> None:
        self._record = record
        self._lock = threading.Lock()
        first = record.current()
        self._epoch = first.epoch
        self._soon = not first.ok or first.wrote  # read again within RETRY_S (see the contract)
        self._resets = 0  # resets so far: a read that began before one ended is not taken
        self._stopped = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(refresh_s,), name="ems-epoch", daemon=True)
        self._thread.start()

    @property
    def epoch(self) -> bytes:
        with self._lock:
            return self._epoch

    def _run(self, refresh_s: float) -> None:
        while not self._stopped:
            with self._lock:
                wait_s = min(refresh_s, RETRY_S) if self._soon else refresh_s
            if self._wake.wait(wait_s):  # a reset (wait RETRY_S from now) or close
                self._wake.clear()
                continue
            with self._lock:
                resets = self._resets
            try:
                read = self._record.current()
            except EmsException:  # the client was shut down under the watch: nothing left to read
                return
            with self._lock:
                if self._resets != resets:  # a reset ended during the read: it may have read the epoch replaced
                    self._soon = True
                    continue
                self._soon = not read.ok or read.wrote
                if read.ok:
                    if read.epoch != self._epoch:
                        logger.info("the namespace epoch changed (a reset, or another engine's record): earlier blocks miss")
                    self._epoch = read.epoch

    def reset(self) -> bool:
        """Write a new epoch; False when the pool did not take it (nothing changed)."""
        epoch = self._record.reset()
        if epoch is None:
            return False
        with self._lock:
            self._epoch = epoch
            self._resets += 1
            self._soon = True
        self._wake.set()
        return True

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
