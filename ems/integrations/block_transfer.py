"""Whole engine blocks through the public `ContextCaching` API: keys, lookups, loads, async saves, statistics.

Contract (no engine imports):
* A registered slot is one engine block (`kv_layouts`), so a save or load of blocks `ids` under `hashes` is
  `save(slot_mapping=ids, hashes=keys, offsets=[1]*n)`.
* Keys (`ems.integrations.engine_keys`): each block's pool key folds in the tensor-parallel rank (MLA: one key for
  all ranks) and the namespace's epoch, so one process can ask for every rank's blocks in one `exists` call:
  `lookup` counts a block as hit only if every rank holds it. With `lease_ms`, `lookup` counts only blocks the pool
  leases to the load that follows (`ContextCaching.exists(..., lease_ms=...)`): eviction cannot take them before
  it. With MLA (one shared key per block) the first rank's read ends the lease.
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
* Never blocks on back-pressure: the mover keeps at most `inflight_budget` async calls of its own pending (at most
  the client's `max_inflight`, whose semaphore would otherwise make the caller wait for a slow pool). A save
  beyond it is dropped (counted as failed: a later miss) and `start_load` returns None (the caller retries).
* Counts (`ems.integrations.transfer_stats`): a load's or save's blocks, bytes and seconds are its call's job record
  (`CcFuture.job`); the mover itself counts only what never became a job (dropped by the in-flight budget, refused
  before it started) and what a job did not do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ems import CcFuture, CcKvOption, CcResult, ContextCaching, EmsException
from ems.integrations.engine_keys import EngineHash, block_keys, lookup_keys
from ems.integrations.transfer_stats import StatsSink

logger = logging.getLogger("ems.integrations")


def _nothing() -> None:
    """A save's `on_end` when the caller gives none."""


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
