"""The pool as one client sees it: routing, per-node fan-out with deadlines, and the local read cache.

Contract:
* Each key has one owning node (`transport.routing`, rendezvous hashing of its route key). A call sends batched
  requests per owning node, nodes in parallel, and waits at most the option's timeout (0, or anything above
  `MAX_TIMEOUT_MS`: that maximum). A node that fails or does not answer in time fails only its own keys (those of
  its requests that had not been answered); its error is reported in `PoolOutcome.errors`.
* A node's keys are split, in request order, into requests within the wire protocol's limits (`RequestLimits`:
  keys, data bytes, meta bytes and data frames per request) and sent one after the other, so a call of any size
  works; the caller never sees the split.
* The local read cache (remote pools only) keeps what this client wrote when `write_rcache` is set and serves reads
  first; with `read_local_only` a read never leaves the process. The embedded pool is local, so it always serves.
* Results come back in request order; interpreting them (the consecutive prefix, raising when nothing was
  reachable) is the caller's job.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from ems.errors import EmsErrorCode
from ems.store import KvStore
from ems.transport import protocol
from ems.transport.base import NodeClient, TransportError
from ems.transport.inprocess import InProcessNode
from ems.transport.routing import node_seeds, owners
from ems.types import MAX_TIMEOUT_MS, CcKvOption
from ems.value_format import HEADER_SIZE, Buffer, ExpectedValues, matches

T = TypeVar("T")
Costs = Tuple[np.ndarray, np.ndarray, np.ndarray]  # per key: data bytes, meta bytes, data frames

PUT_META_PER_KEY = 12  # value length u64 + key length u32 (+ 8 per data frame)
KEY_META_PER_KEY = 4  # key length u32


@dataclass
class PoolOutcome(Generic[T]):
    """Per-key results in request order, and the errors of the nodes that failed."""

    results: List[T]
    errors: List[TransportError] = field(default_factory=list)
    nodes_contacted: int = 0

    @property
    def unreachable(self) -> bool:
        """Every node this call needed failed."""
        return self.nodes_contacted > 0 and len(self.errors) == self.nodes_contacted

    def first_error(self) -> Optional[TransportError]:
        """The error to raise for an unreachable pool: a timeout if any node timed out."""
        for error in self.errors:
            if error.status_code() == EmsErrorCode.EMS_IO_TIMEOUT:
                return error
        return self.errors[0] if self.errors else None


def timeout_seconds(option: CcKvOption) -> float:
    """The option's timeout in seconds, clamped to `MAX_TIMEOUT_MS`; 0 (no limit) is that maximum too."""
    timeout_ms = option.timeout if 0 < option.timeout < MAX_TIMEOUT_MS else MAX_TIMEOUT_MS
    return timeout_ms / 1000.0


@dataclass(frozen=True)
class RequestLimits:
    """The most one request to one node may carry (defaults: the wire protocol's limits)."""

    max_keys: int = protocol.MAX_KEYS
    max_data_bytes: int = protocol.MAX_DATA_BYTES
    max_meta_bytes: int = protocol.MAX_META_BYTES
    max_chunks: int = protocol.MAX_CHUNKS


def split_batches(limits: RequestLimits, data: np.ndarray, meta: np.ndarray, chunks: np.ndarray) -> List[slice]:
    """Consecutive slices of items (costs per item: data bytes, meta bytes, data frames) such that each slice keeps
    every limit; an item that alone exceeds one still travels, alone (the node then refuses it)."""
    n = len(data)
    cums = [np.concatenate(([0], np.cumsum(c, dtype=np.int64))) for c in (data, meta, chunks)]
    caps = (limits.max_data_bytes, limits.max_meta_bytes, limits.max_chunks)
    batches: List[slice] = []
    start = 0
    while start < n:
        end = min(n, start + limits.max_keys)
        for cum, cap in zip(cums, caps):
            # the largest end with cum[end] - cum[start] <= cap
            end = min(end, int(np.searchsorted(cum, cum[start] + cap, side="right")) - 1)
        end = max(end, start + 1)
        batches.append(slice(start, end))
        start = end
    return batches


def _key_meta(keys: Sequence[bytes], idx: np.ndarray, per_key: int) -> np.ndarray:
    return np.fromiter((len(keys[i]) + per_key for i in idx.tolist()), dtype=np.int64, count=idx.size)


class PoolClient:
    """Routes batched put/get/exists to the owning nodes; see the module docstring."""

    def __init__(
        self, nodes: Sequence[NodeClient], read_cache_capacity: int = 0, limits: RequestLimits = RequestLimits()
    ) -> None:
        if not nodes:
            raise ValueError("a PoolClient needs at least one node")
        self.nodes = list(nodes)
        self.limits = limits
        self.is_local = all(isinstance(n, InProcessNode) for n in self.nodes)
        self._seeds = node_seeds([n.address for n in self.nodes])
        self.read_cache: Optional[KvStore] = (
            KvStore(read_cache_capacity, verify_on_put=False)
            if read_cache_capacity > 0 and not self.is_local
            else None
        )
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._executor_lock = threading.Lock()

    # ---- fan-out ----

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(2, 4 * len(self.nodes)), thread_name_prefix="ems-pool"
                )
            return self._executor

    def _fan_out(
        self,
        route_keys: Sequence[bytes],
        wanted: np.ndarray,
        call: Callable[[NodeClient, np.ndarray, float], list],
        costs: Callable[[np.ndarray], Costs],
        results: list,
        timeout_s: float,
    ) -> PoolOutcome:
        """Run `call(node, indices, timeout)` for the wanted keys of each owning node, in requests within the limits
        (`costs(indices)` → per-key data bytes, meta bytes, data frames); fill `results`."""
        outcome = PoolOutcome(results)
        indices = np.nonzero(wanted)[0]
        if indices.size == 0:
            return outcome
        owner = owners([route_keys[i] for i in indices], self._seeds)
        per_node = [(self.nodes[n], indices[owner == n]) for n in np.unique(owner)]
        outcome.nodes_contacted = len(per_node)
        deadline = time.monotonic() + timeout_s

        def run(node: NodeClient, idx: np.ndarray) -> tuple[list, Optional[TransportError]]:
            """The node's answers for a prefix of `idx` (all of it unless it failed), and its error if any."""
            answers: list = []
            for batch in split_batches(self.limits, *costs(idx)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return answers, TransportError(
                        EmsErrorCode.EMS_IO_TIMEOUT, f"{node.address}: no answer within {timeout_s:.3f} s"
                    )
                try:
                    answers.extend(call(node, idx[batch], remaining))
                except TransportError as error:
                    return answers, error
            return answers, None

        def collect(idx: np.ndarray, answers: list, error: Optional[TransportError]) -> None:
            for i, value in zip(idx.tolist(), answers):
                results[i] = value
            if error is not None:
                outcome.errors.append(error)

        if self.is_local:  # in-process: nothing can hang, so no thread hop
            node, idx = per_node[0]
            collect(idx, *run(node, idx))
            return outcome
        futures = {self._pool().submit(run, node, idx): (node, idx) for node, idx in per_node}
        done, not_done = concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        for future in done:
            node, idx = futures[future]
            try:
                collect(idx, *future.result())
            except Exception as error:  # a transport bug must not become a wrong block: fail the node's keys
                outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_ERROR, f"{node.address}: {error!r}"))
        for future in not_done:
            node, _ = futures[future]
            outcome.errors.append(
                TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{node.address}: no answer within {timeout_s:.3f} s")
            )
        return outcome

    # ---- batched operations ----

    def put(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        values: Sequence[Sequence[Buffer]],
        option: CcKvOption,
        value_lens: Optional[np.ndarray] = None,
    ) -> PoolOutcome[bool]:
        """Store each value at its owning node; `results[i]` is True where the node acknowledged it.

        `value_lens` (int64, bytes of each value, its parts together) saves measuring every part when the caller
        knows them; it is only used to split requests at the limits."""
        results: list = [False] * len(keys)

        def costs(idx: np.ndarray) -> Costs:
            parts = np.fromiter((len(values[i]) for i in idx.tolist()), dtype=np.int64, count=idx.size)
            if value_lens is not None:
                data = np.asarray(value_lens, dtype=np.int64)[idx]
            else:
                data = np.fromiter(
                    (sum(memoryview(p).nbytes for p in values[i]) for i in idx.tolist()), dtype=np.int64, count=idx.size
                )
            return data, _key_meta(keys, idx, PUT_META_PER_KEY) + 8 * parts, parts

        outcome = self._fan_out(
            route_keys,
            np.ones(len(keys), dtype=bool),
            lambda node, idx, t: node.put([keys[i] for i in idx], [values[i] for i in idx], t),
            costs,
            results,
            timeout_seconds(option),
        )
        if self.read_cache is not None and option.write_rcache:
            for i in np.nonzero(results)[0].tolist():
                self.read_cache.put(keys[i], values[i])
        return outcome

    def get(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        option: CcKvOption,
        expected: Optional[ExpectedValues] = None,
    ) -> PoolOutcome[Optional[Buffer]]:
        """Each key's stored value, or None; the read cache first, then (unless local-only) the owning node.

        With `expected`, a read-cache entry that is not exactly the expected value (damaged, or written by another
        layout) is dropped from the read cache and fetched from its node instead, so it never shadows a good copy.
        """
        results: list = [None] * len(keys)
        if self.read_cache is not None:
            results = self.read_cache.get_many(keys)
            if expected is not None:
                for i, value in enumerate(results):
                    if value is not None and not matches(value, expected, i):
                        self.read_cache.delete(keys[i])
                        results[i] = None
        wanted = np.fromiter((r is None for r in results), dtype=bool, count=len(keys))
        if option.read_local_only and not self.is_local:
            return PoolOutcome(results)

        def costs(idx: np.ndarray) -> Costs:
            # the reply carries the values: expected sizes bound it (an unexpected value is refused anyway)
            if expected is None:
                data = np.zeros(idx.size, dtype=np.int64)
            else:
                data = np.asarray(expected.payload_len, dtype=np.int64)[idx] + HEADER_SIZE
            return data, _key_meta(keys, idx, KEY_META_PER_KEY), np.zeros(idx.size, dtype=np.int64)

        return self._fan_out(
            route_keys,
            wanted,
            lambda node, idx, t: node.get([keys[i] for i in idx], t),
            costs,
            results,
            timeout_seconds(option),
        )

    def exists(self, route_keys: Sequence[bytes], keys: Sequence[bytes], option: CcKvOption) -> PoolOutcome[bool]:
        """Whether each key is held (read cache first, then the owning node unless local-only)."""
        results: list = [False] * len(keys)
        if self.read_cache is not None:
            results = self.read_cache.contains_many(keys)
        if option.read_local_only and not self.is_local:
            return PoolOutcome(results)
        return self._fan_out(
            route_keys,
            ~np.asarray(results, dtype=bool),
            lambda node, idx, t: node.exists([keys[i] for i in idx], t),
            lambda idx: (np.zeros(idx.size, np.int64), _key_meta(keys, idx, KEY_META_PER_KEY), np.zeros(idx.size, np.int64)),
            results,
            timeout_seconds(option),
        )

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when at least one node answers a ping within `timeout_s` (the pool is usable)."""
        if self.is_local:
            return True
        futures = [self._pool().submit(node.ping, timeout_s) for node in self.nodes]
        done, _ = concurrent.futures.wait(futures, timeout=timeout_s + 0.5)
        return any(f.result() for f in done if f.exception() is None)

    def close(self) -> None:
        for node in self.nodes:
            try:
                node.close()
            except Exception:  # closing must release every node even if one fails
                pass
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
