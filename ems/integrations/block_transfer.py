"""Whole engine blocks through the public `ContextCaching` API: keys, lookups, loads, async saves, statistics.

Contract (no engine imports):
* A registered slot is one engine block (`kv_layouts`), so a save or load of blocks `ids` under `hashes` is
  `save(slot_mapping=ids, hashes=keys, offsets=[1]*n)`.
* Keys: `block_keys(hashes, tp_rank, tp_size, shared)` folds the tensor-parallel rank into each block hash
  (`hash128 << 16 | tp_size << 8 | tp_rank`; MLA's `shared` tag `0xFFFF` is one key for all ranks), so one process
  (an engine's scheduler) can ask for every rank's blocks in a single `exists` call: `lookup` counts a block as hit
  only if every rank holds it. Engine hashes may be bytes (vLLM's sha256 block hashes: the first 16 bytes are used)
  or ints. With an `epoch` (the namespace's epoch, `ems.integrations.epoch`: random bytes) a block's 128 bits are
  BLAKE2b keyed by the epoch, so the keys of one epoch are never the keys of another, whatever the engine's hashes
  (a reset moves to a new random epoch). With `lease_ms`, `lookup` counts only blocks the pool leases to the load
  that follows (`ContextCaching.exists(..., lease_ms=...)`): eviction cannot take them before it. With MLA (one
  shared key per block) the first rank's read ends the lease.
* `BlockMover.load` is synchronous and returns which engine blocks did *not* arrive (a pool that fails, partly or
  wholly, is reported, never raised: the engine recomputes those blocks). `start_load` / `poll_load` are the same
  load asynchronously (`ContextCaching.async_load`): `poll_load` never blocks and gives the `LoadOutcome` once it
  has finished. `save_async` returns once the blocks are copied out of the engine's cache
  (`ContextCaching.async_save`); failures only cost future misses; its `on_end` says when the save has ended (the
  pool acknowledged it, or it failed or was never sent).
* Placement (`chain_prefix`, on lookups, loads and saves): the engine hashes of the chain's blocks before
  `hashes[0]`, from the chain's first block (`[]`: hashes[0] is the first). With it the keys go to the SDK with
  their chain position (`chain_prefix=`, this rank's keys of those blocks), so a prompt's blocks are placed by
  their placement units and a call touches a bounded number of pool nodes whatever the pool's size
  (docs/concepts/placement.md); without it (None) each key is placed by itself. The two never meet (another key
  form): every save, lookup and load of one block must agree on giving it.
* KV cache groups (a hybrid model: full and sliding-window attention): `group_hashes(hashes, group)` tags each
  engine hash with its group (a 16-byte BLAKE2b of the hash's 128 bits, personalised by the group index), so the
  blocks of one position in two groups are two keys and never collide; a model with one group uses its hashes
  untagged (its keys as before).
* Never blocks on back-pressure: the mover keeps at most `inflight_budget` async calls of its own pending (at most
  the client's `max_inflight`, whose semaphore would otherwise make the caller wait for a slow pool). A save
  beyond it is dropped (counted as failed: a later miss) and `start_load` returns None (the caller retries).
* `TransferStats` counts lookups (hit/miss blocks), loads and saves (blocks, failed blocks, bytes, seconds);
  `drain()` hands over and resets what was counted since the last call. Thread-safe. A load's or save's blocks,
  bytes and seconds are its call's job record (`CcFuture.job`, the `ems.records` record that also feeds
  `ContextCaching.jobs` and its metrics): one account of each transfer. The mover itself counts only what never
  became a job (dropped by the in-flight budget, refused before it started) and what a job did not do.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ems import CcFuture, CcKvOption, CcResult, ContextCaching, EmsException

logger = logging.getLogger("ems.integrations")

EngineHash = bytes | int


def _nothing() -> None:
    """A save's `on_end` when the caller gives none."""


SHARED_TAG = 0xFFFF
MAX_TP = 255


def _hash128(h: EngineHash) -> int:
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(bytes(h[:16]), "little")
    if isinstance(h, int):
        return h & ((1 << 128) - 1)
    raise TypeError(f"block hash must be bytes or int, got {type(h).__name__}")


def _epoch_hash(h: EngineHash, epoch: bytes) -> int:
    if not epoch:
        return _hash128(h)
    digest = hashlib.blake2b(_hash128(h).to_bytes(16, "little"), key=epoch, digest_size=16).digest()
    return int.from_bytes(digest, "little")


def group_hashes(hashes: Sequence[EngineHash], group: int) -> list[bytes]:
    """`hashes` tagged with KV cache group `group` (see the module contract)."""
    if not 0 <= group < 1 << 16:
        raise ValueError(f"KV cache group {group} out of range")
    salt = group.to_bytes(2, "little")
    return [
        hashlib.blake2b(_hash128(h).to_bytes(16, "little"), digest_size=16, person=b"ems-kv-group", salt=salt).digest()
        for h in hashes
    ]


def rank_tag(tp_rank: int, tp_size: int, shared: bool) -> int:
    if shared:
        return SHARED_TAG
    if not 0 <= tp_rank < tp_size <= MAX_TP:
        raise ValueError(f"tp_rank {tp_rank} / tp_size {tp_size} out of range (tp_size <= {MAX_TP})")
    return (tp_size << 8) | tp_rank


def block_keys(hashes: Sequence[EngineHash], tp_rank: int, tp_size: int, shared: bool, epoch: bytes = b"") -> list[int]:
    """The pool keys of one rank's blocks (in `epoch`)."""
    tag = rank_tag(tp_rank, tp_size, shared)
    return [(_epoch_hash(h, epoch) << 16) | tag for h in hashes]


def lookup_keys(hashes: Sequence[EngineHash], tp_size: int, shared: bool, epoch: bytes = b"") -> list[int]:
    """Every rank's keys, block by block (block 0 of ranks 0..tp-1, then block 1, ...)."""
    if shared:
        return block_keys(hashes, 0, 1, True, epoch)
    tags = [rank_tag(r, tp_size, False) for r in range(tp_size)]
    return [(_epoch_hash(h, epoch) << 16) | tag for h in hashes for tag in tags]


@dataclass
class TransferStats:
    lookup_hit_blocks: int = 0
    lookup_miss_blocks: int = 0
    lookup_skipped_blocks: int = 0  # not asked: the pool counted as down (`lookup_breaker`)
    breaker_trips: int = 0
    lookup_save_waits: int = 0  # lookups asked again: short of blocks still being saved (`save_wait_ms`)
    load_blocks: int = 0
    load_failed_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    # in-step loads that ran out of their bound (`in_step_ms`): the bytes they asked for and the seconds they took
    # (the step policy's rate learns from them: `StepPolicy.record_late_load`)
    load_late_bytes: int = 0
    load_late_seconds: float = 0.0
    save_blocks: int = 0
    save_failed_blocks: int = 0
    save_bytes: int = 0
    save_seconds: float = 0.0

    def add(self, other: TransferStats) -> TransferStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TransferStats:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def summary(self) -> dict[str, int | float]:
        """What an operator reads: hits, misses, bytes and GB/s each way."""
        return {
            "hit_blocks": self.lookup_hit_blocks,
            "miss_blocks": self.lookup_miss_blocks,
            "hit_rate": round(self.lookup_hit_blocks / max(1, self.lookup_hit_blocks + self.lookup_miss_blocks), 4),
            "skipped_blocks": self.lookup_skipped_blocks,
            "breaker_trips": self.breaker_trips,
            "save_waits": self.lookup_save_waits,
            "loaded_blocks": self.load_blocks,
            "load_failed_blocks": self.load_failed_blocks,
            "loaded_bytes": self.load_bytes,
            "load_GBps": round(self.load_bytes / self.load_seconds / 1e9, 3) if self.load_seconds > 0 else 0.0,
            "saved_blocks": self.save_blocks,
            "save_failed_blocks": self.save_failed_blocks,
            "saved_bytes": self.save_bytes,
            "save_GBps": round(self.save_bytes / self.save_seconds / 1e9, 3) if self.save_seconds > 0 else 0.0,
        }


@dataclass
class StatsSink:
    """Thread-safe `TransferStats` accumulator (`add(**counts)`, `drain()`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    stats: TransferStats = field(default_factory=TransferStats)
    total: TransferStats = field(default_factory=TransferStats)  # everything ever counted, never reset

    def add(self, **counts: Any) -> None:
        with self.lock:
            self.stats.add(TransferStats(**counts))
            self.total.add(TransferStats(**counts))

    def drain(self) -> TransferStats:
        with self.lock:
            out, self.stats = self.stats, TransferStats()
        return out

    def totals(self) -> TransferStats:
        with self.lock:
            return TransferStats.from_dict(self.total.to_dict())


def lookup(
    cc: ContextCaching,
    hashes: Sequence[EngineHash],
    tp_size: int,
    shared: bool,
    option: CcKvOption | None = None,
    stats: StatsSink | None = None,
    epoch: bytes = b"",
    lease_ms: int = 0,
    chain_prefix: Sequence[EngineHash] | None = None,
) -> int:
    """How many of `hashes`, from the first, every rank holds in the pool (a failing pool: 0); with `lease_ms`, only
    blocks the pool also leases for that long (kept from eviction until each rank's load reads them). With
    `chain_prefix` (the engine hashes of the chain's blocks before hashes[0]) the keys are placed by their chain's
    placement units: one `exists` per rank (each rank's keys are a chain of their own), the hits every rank has."""
    if not hashes:
        return 0
    kwargs: dict[str, Any] = {"lease_ms": lease_ms} if lease_ms > 0 else {}
    if chain_prefix is not None:
        ranks = [0] if shared else list(range(tp_size))
        hits = len(hashes)
        for rank in ranks:
            prefix = block_keys(chain_prefix, rank, tp_size, shared, epoch)
            result = cc.exists(block_keys(hashes, rank, tp_size, shared, epoch), option, chain_prefix=prefix, **kwargs)
            hits = min(hits, result.success)
    else:
        keys = lookup_keys(hashes, tp_size, shared, epoch)
        result = cc.exists(keys, option, **kwargs)
        hits = result.success // (1 if shared else tp_size)
    if stats is not None:
        stats.add(lookup_hit_blocks=hits, lookup_miss_blocks=len(hashes) - hits)
    return hits


@dataclass(frozen=True)
class LoadOutcome:
    loaded: int  # blocks written, from the first
    failed_block_ids: list[int]  # engine blocks that were promised but not written


@dataclass
class PendingLoad:
    block_ids: list[int]
    future: CcFuture | None  # None: failed to start, or already polled to its end
    started: float


class BlockMover:
    """Loads and saves one rank's whole engine blocks (see the module contract)."""

    def __init__(
        self,
        cc: ContextCaching,
        block_bytes: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        shared: bool = False,
        option: CcKvOption | None = None,
        stats: StatsSink | None = None,
        inflight_budget: int = 8,
    ) -> None:
        self._cc = cc
        self._budget = inflight_budget
        self._block_bytes = block_bytes
        self._tp_rank, self._tp_size, self._shared = tp_rank, tp_size, shared
        self._option = option or CcKvOption()
        self.stats = stats or StatsSink()
        self._pending: set[CcFuture] = set()
        self._reserved = 0  # async calls of this mover pending (saves and loads)
        self._lock = threading.Lock()
        # MLA: every rank holds the same latent KV; rank 0 alone writes it
        self.saves = not shared or tp_rank == 0

    def keys(self, hashes: Sequence[EngineHash], epoch: bytes = b"") -> list[int]:
        return block_keys(hashes, self._tp_rank, self._tp_size, self._shared, epoch)

    def _placement(self, chain_prefix: Sequence[EngineHash] | None, epoch: bytes) -> dict[str, Any]:
        """The call's `chain_prefix=` (this rank's keys of the chain's earlier blocks), or nothing: placed per key."""
        return {} if chain_prefix is None else {"chain_prefix": self.keys(chain_prefix, epoch)}

    def load(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[EngineHash],
        epoch: bytes = b"",
        option: CcKvOption | None = None,
        chain_prefix: Sequence[EngineHash] | None = None,
    ) -> LoadOutcome:
        """Load and wait for it (`option`: this call's, e.g. a shorter timeout; else the mover's; `chain_prefix`: see
        the module contract)."""
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
        n = len(block_ids)
        if n == 0:
            return LoadOutcome(0, [])
        future: CcFuture | None = None
        try:
            future = self._cc.async_load(
                list(block_ids), self.keys(hashes, epoch), [1] * n, option or self._option, **self._placement(chain_prefix, epoch)
            )
            loaded = min(future.result().success, n)
        except EmsException as exc:  # pool unreachable or timed out: nothing was written
            logger.warning("load of %d blocks failed, the engine recomputes them: %s", n, exc.message())
            loaded = 0
        self._count_load(n, loaded, future)
        return LoadOutcome(loaded, list(block_ids[loaded:]))

    def _count_load(self, n: int, loaded: int, future: CcFuture | None) -> None:
        job = future.job if future is not None else None
        if job is not None and loaded < n and job.blocks_total:  # the call returned (a raised one was logged)
            # the lookup promised these blocks: they were evicted, lost with a node, or failed verification since
            logger.warning("load of %d promised blocks: the pool served %d, the engine recomputes the rest", n, loaded)
        self.stats.add(
            load_blocks=loaded,
            load_failed_blocks=n - loaded,
            load_bytes=job.nbytes if job is not None and loaded else 0,
            load_seconds=job.seconds if job is not None and loaded else 0.0,
        )

    def _reserve(self) -> bool:
        with self._lock:
            if self._reserved >= self._budget:
                return False
            self._reserved += 1
            return True

    def _release(self) -> None:
        with self._lock:
            self._reserved -= 1

    def start_load(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[EngineHash],
        epoch: bytes = b"",
        option: CcKvOption | None = None,
        chain_prefix: Sequence[EngineHash] | None = None,
    ) -> PendingLoad | None:
        """Start loading (`option`: this call's, else the mover's); None when the mover's in-flight budget is used up
        (nothing started: try again later)."""
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
        if not self._reserve():
            return None
        n = len(block_ids)
        pending = PendingLoad(list(block_ids), None, time.perf_counter())
        try:
            pending.future = self._cc.async_load(
                list(block_ids), self.keys(hashes, epoch), [1] * n, option or self._option, **self._placement(chain_prefix, epoch)
            )
        except EmsException as exc:
            logger.warning("load of %d blocks failed, the engine recomputes them: %s", n, exc.message())
            self._release()
        return pending

    def poll_load(self, pending: PendingLoad) -> LoadOutcome | None:
        """The outcome of a started load once it has finished (None while it runs); never blocks."""
        n = len(pending.block_ids)
        loaded = 0
        future = pending.future
        if future is not None:
            if not self._cc.is_ready(future):
                return None
            try:
                loaded = min(future.result().success, n)
            except EmsException as exc:
                logger.warning("load of %d blocks failed, the engine recomputes them: %s", n, exc.message())
            finally:
                pending.future = None
                self._release()
        self._count_load(n, loaded, future)
        return LoadOutcome(loaded, list(pending.block_ids[loaded:]))

    def save_async(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[EngineHash],
        epoch: bytes = b"",
        on_end: Callable[[], None] | None = None,
        chain_prefix: Sequence[EngineHash] | None = None,
    ) -> bool:
        """Start saving (True), or drop the save when the in-flight budget is used up (False: a later miss).
        `on_end` is called once the save has ended: the pool acknowledged it or it failed (on the transfer's
        thread), or at once when nothing was sent (dropped, refused, nothing to save)."""
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
        ended = on_end or _nothing
        n = len(block_ids)
        if n == 0 or not self.saves:
            ended()
            return True
        if not self._reserve():
            self.stats.add(save_failed_blocks=n)
            ended()
            return False
        try:
            future = self._cc.async_save(
                list(block_ids), self.keys(hashes, epoch), [1] * n, self._option, **self._placement(chain_prefix, epoch)
            )
        except EmsException as exc:
            logger.warning("save of %d blocks failed (later lookups miss them): %s", n, exc.message())
            self.stats.add(save_failed_blocks=n)
            self._release()
            ended()
            return False
        with self._lock:
            self._pending.add(future)

        def done(f: CcFuture) -> None:
            try:
                result: CcResult = f.result()
                saved = min(result.success, n)
            except EmsException as exc:
                logger.warning("save of %d blocks failed (later lookups miss them): %s", n, exc.message())
                saved = 0
            job = f.job
            self.stats.add(
                save_blocks=saved,
                save_failed_blocks=n - saved,
                save_bytes=job.nbytes if job is not None and saved else 0,
                save_seconds=job.seconds if job is not None and saved else 0.0,
            )
            with self._lock:
                self._pending.discard(f)
                self._reserved -= 1
            ended()

        future.add_done_callback(done)
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def inflight(self) -> int:
        """Async calls (loads and saves) of this mover in flight."""
        with self._lock:
            return self._reserved

    def wait(self, timeout: float = 30.0) -> bool:
        """Wait until every async save has finished (True) or `timeout` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        while self.pending():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True
