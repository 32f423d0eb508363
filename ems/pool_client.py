"""The pool as one client sees it: routing, per-node fan-out with deadlines, and the local read cache.

Contract:
* Each key has `replicas` owning nodes among the live ones (`ems.cluster.routing.ranked_owners`, rendezvous hashing of
  its route key; `ems.cluster.placement.Members` holds the live set, which membership may change between calls). A call
  sends batched requests per node it needs, nodes in parallel, and waits at most the option's timeout in all (0, or
  anything above `MAX_TIMEOUT_MS`: that maximum). A node that fails or does not answer in time fails only its own
  keys (those of its requests that had not been answered); its error is reported in `PoolOutcome.errors`.
* A node's keys are split, in request order, into requests within the wire protocol's limits (`RequestLimits`:
  keys, data bytes, meta bytes and data frames per request) and sent one after the other, so a call of any size
  works; the caller never sees the split.
* A put goes to every owner of each key at once; see `put` for when a value counts as stored. A read asks each
  key's first owner, and sends what it missed, found damaged (not the `expected` value) or could not get from a
  failed node to the next owner, until the deadline.
* The local read cache (remote pools only) keeps what this client wrote when `write_rcache` is set and serves reads
  first; with `read_local_only` a read never leaves the process. The embedded pool is local, so it always serves.
* Results come back in request order; interpreting them (the consecutive prefix, raising when nothing was
  reachable) is the caller's job.
* Several calls of one request in flight (a job's chunks): `start(call)` runs a call on the client's pipeline
  threads and returns its `Future`; `put` and `get_into` take an absolute `deadline` so the chunks of one request
  share its timeout. The pipeline threads are apart from the fan-out threads, so a started call that fans out to
  several nodes never waits for a thread it holds.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import numpy as np

from ems.buffers import Buffer
from ems.cluster.placement import Members
from ems.cluster.routing import ranked_owners
from ems.errors import EmsErrorCode
from ems.store import KvStore
from ems.transport import protocol
from ems.transport.base import NodeClient, TransportError
from ems.transport.inprocess import InProcessNode
from ems.types import MAX_TIMEOUT_MS, CcKvOption
from ems.value_format import HEADER_SIZE, ExpectedValues, matches

T = TypeVar("T")
R = TypeVar("R")
Costs = tuple[np.ndarray, np.ndarray, np.ndarray]  # per key: data bytes, meta bytes, data frames

PUT_META_PER_KEY = 12  # value length u64 + key length u32 (+ 8 per data frame)
KEY_META_PER_KEY = 4  # key length u32
PIPELINE_THREADS = 8  # calls started with `PoolClient.start` that run at once (more wait in order)


@dataclass
class PoolOutcome(Generic[T]):
    """Per-key results in request order, and the errors of the nodes that failed."""

    results: list[T]
    errors: list[TransportError] = field(default_factory=list)
    nodes_contacted: int = 0
    #: a get's present values were all checked against `expected` already (the caller need not check them again)
    verified: bool = False

    @property
    def unreachable(self) -> bool:
        """Every node this call needed failed."""
        return self.nodes_contacted > 0 and len(self.errors) == self.nodes_contacted

    def first_error(self) -> TransportError | None:
        """The error to raise for an unreachable pool: a timeout if any node timed out."""
        for error in self.errors:
            if error.status_code() == EmsErrorCode.EMS_IO_TIMEOUT:
                return error
        return self.errors[0] if self.errors else None


def timeout_seconds(option: CcKvOption) -> float:
    """The option's timeout in seconds, clamped to `MAX_TIMEOUT_MS`; 0 (no limit) is that maximum too."""
    timeout_ms = option.timeout if 0 < option.timeout < MAX_TIMEOUT_MS else MAX_TIMEOUT_MS
    return timeout_ms / 1000.0


def deadline_of(option: CcKvOption) -> float:
    """The `time.monotonic()` by which a request started now must be done."""
    return time.monotonic() + timeout_seconds(option)


def _remaining(option: CcKvOption, deadline: float | None) -> float:
    return timeout_seconds(option) if deadline is None else max(0.0, deadline - time.monotonic())


@dataclass(frozen=True)
class RequestLimits:
    """The most one request to one node may carry (defaults: the wire protocol's limits)."""

    max_keys: int = protocol.MAX_KEYS
    max_data_bytes: int = protocol.MAX_DATA_BYTES
    max_meta_bytes: int = protocol.MAX_META_BYTES
    max_data_frames: int = protocol.MAX_DATA_FRAMES


def split_batches(limits: RequestLimits, data: np.ndarray, meta: np.ndarray, chunks: np.ndarray) -> list[slice]:
    """Consecutive slices of items (costs per item: data bytes, meta bytes, data frames) such that each slice keeps
    every limit; an item that alone exceeds one still travels, alone (the node then refuses it)."""
    n = len(data)
    cums = [np.concatenate(([0], np.cumsum(c, dtype=np.int64))) for c in (data, meta, chunks)]
    caps = (limits.max_data_bytes, limits.max_meta_bytes, limits.max_data_frames)
    batches: list[slice] = []
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
        self,
        nodes: Sequence[NodeClient],
        read_cache_capacity: int = 0,
        replicas: int = 1,
        connect: Callable[[str], NodeClient] | None = None,
        limits: RequestLimits = RequestLimits(),
    ) -> None:
        if not nodes and connect is None:
            raise ValueError("a PoolClient needs at least one node")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas = replicas
        self.limits = limits
        self.members = Members(nodes, connect)
        self.is_local = bool(nodes) and all(isinstance(n, InProcessNode) for n in nodes)
        self.read_cache: KvStore | None = (
            KvStore(read_cache_capacity, verify_on_put=False) if read_cache_capacity > 0 and not self.is_local else None
        )
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pipeline: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []

    @property
    def nodes(self) -> list[NodeClient]:
        """The nodes placement uses now (the live set)."""
        return list(self.members.view.nodes)

    def set_members(self, addresses: Sequence[str]) -> None:
        """Route to exactly these nodes from now on (membership changes; see `ems.cluster.placement.Members`)."""
        self.members.set(addresses)

    def describe(self) -> str:
        """ "embedded", or the live nodes' addresses (for logs)."""
        return "embedded" if self.is_local else ", ".join(n.address for n in self.nodes)

    def prepare_staging(self, buffer: Any) -> None:
        """Nothing to do: UCX registers what it sends (see `ems.pool_backend`)."""

    def release_staging(self, buffer: Any) -> None:
        """Nothing to do (see `prepare_staging`)."""

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` first when this client closes (e.g. stop a membership watch)."""
        self._on_close.append(callback)

    @property
    def local_store(self) -> KvStore | None:
        """The embedded pool's store when this client's only node is in-process (the one-pass data path), else None."""
        if len(self.nodes) == 1 and isinstance(self.nodes[0], InProcessNode):
            store = self.nodes[0].store
            return store if isinstance(store, KvStore) else None
        return None

    # ---- fan-out ----

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(8, 4 * len(self.members.view.nodes)), thread_name_prefix="ems-pool"
                )
            return self._executor

    def start(self, call: Callable[[], R]) -> concurrent.futures.Future[R]:
        """Run `call` on the pipeline threads (at most `PIPELINE_THREADS` at once, the rest in the order started)
        and return its future: how one request keeps several calls in flight (see the module docstring)."""
        with self._executor_lock:
            if self._pipeline is None:
                self._pipeline = concurrent.futures.ThreadPoolExecutor(
                    max_workers=PIPELINE_THREADS, thread_name_prefix="ems-pipe"
                )
            return self._pipeline.submit(call)

    def _run_per_node(
        self,
        node_keys: list[tuple[NodeClient, np.ndarray]],
        call: Callable[[NodeClient, np.ndarray, float], list],
        costs: Callable[[np.ndarray], Costs],
        deadline: float,
        outcome: PoolOutcome,
    ) -> list[tuple[list, bool]]:
        """Run `call(node, indices, timeout)` for each node's keys, nodes in parallel, in requests within the limits
        (`costs(indices)` → per-key data bytes, meta bytes, data frames), until `deadline`. Per node: the answers for
        a prefix of its keys (all of them unless its node failed) and whether the node failed (its error is added
        to `outcome.errors`)."""

        def run(node: NodeClient, idx: np.ndarray) -> tuple[list, TransportError | None]:
            answers: list = []
            for batch in split_batches(self.limits, *costs(idx)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return answers, TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{node.address}: no answer in time")
                try:
                    answers.extend(call(node, idx[batch], remaining))
                except TransportError as error:
                    return answers, error
            return answers, None

        out: list[tuple[list, bool]] = [([], True)] * len(node_keys)
        if self.is_local or (len(node_keys) == 1 and node_keys[0][0].self_timed):
            # in-process, nothing can hang; a lone node whose transport bounds every call by its deadline itself
            # needs no watching thread either: no thread hop
            for j, (node, idx) in enumerate(node_keys):
                answers, error = run(node, idx)
                if error is not None:
                    outcome.errors.append(error)
                out[j] = (answers, error is not None)
            return out
        timeout_s = max(0.0, deadline - time.monotonic())
        futures = {self._pool().submit(run, node, idx): j for j, (node, idx) in enumerate(node_keys)}
        done, not_done = concurrent.futures.wait(futures, timeout=timeout_s)
        for future in done:
            node = node_keys[futures[future]][0]
            try:
                answers, error = future.result()
            except Exception as exc:  # a transport bug must not become a wrong block: fail the node's keys
                outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_ERROR, f"{node.address}: {exc!r}"))
                continue
            if error is not None:
                outcome.errors.append(error)
            out[futures[future]] = (answers, error is not None)
        for future in not_done:
            node = node_keys[futures[future]][0]
            outcome.errors.append(
                TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{node.address}: no answer within {timeout_s:.3f} s")
            )
        return out

    def _fan_out(
        self,
        route_keys: Sequence[bytes],
        wanted: np.ndarray,
        call: Callable[[NodeClient, np.ndarray, float], list],
        costs: Callable[[np.ndarray], Costs],
        results: list,
        timeout_s: float,
        accept: Callable[[int, object], bool],
    ) -> PoolOutcome:
        """A read: ask each wanted key's first owner; a key not answered with an accepted value goes to its next
        owner in rank order, round by round, until the deadline. A miss or a damaged value uses up one of the key's
        `replicas` tries; a node that failed (lost, timed out) does not, and is skipped for the rest of the call, so
        a key whose owner died is read from the owners after it (also before membership drops the dead node).
        Fills `results`."""
        outcome = PoolOutcome(results)
        pending = np.nonzero(wanted)[0]
        if pending.size == 0:
            return outcome
        view = self.members.view
        n = len(view.nodes)
        if n == 0:
            outcome.nodes_contacted = 1
            outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_ERROR, "no pool node is live"))
            return outcome
        depth = n if self.replicas > 1 or n > 1 else 1  # a failed owner passes its keys on: rank every node
        ranks = ranked_owners([route_keys[i] for i in pending.tolist()], view.seeds, depth)
        pos = np.zeros(pending.size, dtype=np.int64)  # each pending key's next rank to ask
        tries = np.zeros(pending.size, dtype=np.int64)  # answers (miss or damaged) each key has had
        failed = np.zeros(n, dtype=bool)
        contacted = np.zeros(n, dtype=bool)
        deadline = time.monotonic() + timeout_s
        while pending.size:
            rows = np.arange(pending.size)
            candidate = ranks[rows, np.minimum(pos, depth - 1)]
            while True:  # skip owners that already failed in this call
                skip = failed[candidate] & (pos < depth)
                if not skip.any():
                    break
                pos[skip] += 1
                candidate = ranks[rows, np.minimum(pos, depth - 1)]
            keep = pos < depth
            pending, ranks, pos, tries, candidate = pending[keep], ranks[keep], pos[keep], tries[keep], candidate[keep]
            if pending.size == 0:
                break
            node_ids = np.unique(candidate).tolist()
            node_keys = [(view.nodes[j], pending[candidate == j]) for j in node_ids]
            contacted[node_ids] = True
            answers = self._run_per_node(node_keys, call, costs, deadline, outcome)
            accepted = np.zeros(len(results), dtype=bool)
            answered = np.zeros(len(results), dtype=bool)
            for j, (_, idx), (values, node_failed) in zip(node_ids, node_keys, answers):
                failed[j] |= node_failed
                got = idx[: len(values)]  # a node that failed midway answered a prefix of its keys
                answered[got] = True
                for i, value in zip(got.tolist(), values):
                    if accept(i, value):
                        results[i] = value
                        accepted[i] = True
            got = answered[pending]
            pos[got] += 1
            tries[got] += 1
            keep = ~accepted[pending] & (tries < self.replicas) & (pos < depth)
            pending, ranks, pos, tries = pending[keep], ranks[keep], pos[keep], tries[keep]
            if time.monotonic() >= deadline:
                break
        outcome.nodes_contacted = int(contacted.sum())
        return outcome

    # ---- batched operations ----

    def put(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        values: Sequence[Sequence[Buffer]],
        option: CcKvOption,
        value_lens: np.ndarray | None = None,
        deadline: float | None = None,
    ) -> PoolOutcome[bool]:
        """Store each value at its `replicas` owning nodes in parallel; `results[i]` is True when the value is
        stored: at least one owner acknowledged it and no owner that answered refused it. An owner that failed as a
        whole (lost, timed out) does not undo the others' acknowledgements: the value is stored with fewer copies,
        and the failure is in `errors`. With one replica this is exactly "the owner acknowledged it".

        `value_lens` (int64, bytes of each value, its parts together) saves measuring every part when the caller
        knows them; it is only used to split requests at the limits. `deadline` (monotonic seconds) replaces the
        option's timeout when given."""
        results: list = [False] * len(keys)
        outcome: PoolOutcome[bool] = PoolOutcome(results)
        view = self.members.view
        if not keys:
            return outcome
        if not view.nodes:
            outcome.nodes_contacted = 1
            outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_ERROR, "no pool node is live"))
            return outcome
        ranks = ranked_owners(route_keys, view.seeds, self.replicas)
        node_ids = np.unique(ranks)
        node_keys = [(view.nodes[n], np.nonzero((ranks == n).any(axis=1))[0]) for n in node_ids.tolist()]
        outcome.nodes_contacted = len(node_keys)

        def costs(idx: np.ndarray) -> Costs:
            parts = np.fromiter((len(values[i]) for i in idx.tolist()), dtype=np.int64, count=idx.size)
            if value_lens is not None:
                data = np.asarray(value_lens, dtype=np.int64)[idx]
            else:
                data = np.fromiter(
                    (sum(memoryview(p).nbytes for p in values[i]) for i in idx.tolist()), dtype=np.int64, count=idx.size
                )
            return data, _key_meta(keys, idx, PUT_META_PER_KEY) + 8 * parts, parts

        answers = self._run_per_node(
            node_keys,
            lambda node, idx, t: node.put([keys[i] for i in idx], [values[i] for i in idx], t),
            costs,
            time.monotonic() + _remaining(option, deadline),
            outcome,
        )
        acked = np.zeros(len(keys), dtype=bool)
        refused = np.zeros(len(keys), dtype=bool)
        for (_, idx), (flags, _) in zip(node_keys, answers):
            ok = np.asarray(flags, dtype=bool)
            got = idx[: len(flags)]  # a node that failed midway acknowledged a prefix of its keys
            acked[got[ok]] = True
            refused[got[~ok]] = True
        stored = acked & ~refused
        outcome.results = results = stored.tolist()
        if self.read_cache is not None and option.write_rcache:
            for i in np.nonzero(results)[0].tolist():
                self.read_cache.put(keys[i], values[i])
        return outcome

    def get(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        option: CcKvOption,
        expected: ExpectedValues | None = None,
    ) -> PoolOutcome[Buffer | None]:
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
        # With replicas, a damaged copy sends the key on to the next owner, so each value is checked here (once:
        # `verified` tells the caller). With one owner there is nowhere to go: the caller checks, as before.
        check = expected if self.replicas > 1 else None

        def accept(i: int, value: object) -> bool:
            if value is None:
                return False
            return check is None or matches(cast(Buffer, value), check, i)  # a reply's value is a Buffer

        def costs(idx: np.ndarray) -> Costs:
            # the reply carries the values: expected sizes bound it (an unexpected value is refused anyway)
            if expected is None:
                data = np.zeros(idx.size, dtype=np.int64)
            else:
                data = np.asarray(expected.payload_len, dtype=np.int64)[idx] + HEADER_SIZE
            return data, _key_meta(keys, idx, KEY_META_PER_KEY), np.zeros(idx.size, dtype=np.int64)

        outcome = self._fan_out(
            route_keys,
            wanted,
            lambda node, idx, t: node.get([keys[i] for i in idx], t),
            costs,
            results,
            timeout_seconds(option),
            accept,
        )
        outcome.verified = check is not None
        return outcome

    def get_into(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        outs: Sequence[Buffer],
        option: CcKvOption,
        expected: ExpectedValues | None = None,
        deadline: float | None = None,
    ) -> PoolOutcome[bool]:
        """Place each key's value in the caller's writable buffer `outs[i]` (read cache first, then, unless
        local-only, the owning node, which receives it there without an intermediate copy when it travels alone);
        `results[i]` is True where a value of exactly `len(outs[i])` bytes is now in `outs[i]`. A buffer whose
        result is False holds unspecified bytes. Nothing is allocated per value on the UCX path.

        `expected` (value i of the call is `expected`'s value i) is `get`'s: a read-cache entry that is not the
        expected value is dropped and fetched from its node, and with replicas each value a node placed is checked
        (`outcome.verified`), so a damaged copy sends the key on to the next owner instead of being accepted. With
        one owner the caller checks. `deadline` (monotonic seconds) replaces the option's timeout when given."""
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        results: list = [False] * len(keys)
        if self.read_cache is not None:
            for i, value in enumerate(self.read_cache.get_many(keys)):
                out = memoryview(outs[i]).cast("B")
                if value is not None and expected is not None and not matches(value, expected, i):
                    self.read_cache.delete(keys[i])
                elif value is not None and memoryview(value).nbytes == out.nbytes:
                    out[:] = memoryview(value).cast("B")
                    results[i] = True
        if option.read_local_only and not self.is_local:
            return PoolOutcome(results)
        check = expected if self.replicas > 1 else None

        def accept(i: int, placed: object) -> bool:  # a miss (or a value of another length) asks the next owner
            return bool(placed) and (check is None or matches(outs[i], check, i))

        def costs(idx: np.ndarray) -> Costs:
            data = np.fromiter((memoryview(outs[i]).nbytes for i in idx.tolist()), dtype=np.int64, count=idx.size)
            return data, _key_meta(keys, idx, KEY_META_PER_KEY), np.zeros(idx.size, dtype=np.int64)

        outcome = self._fan_out(
            route_keys,
            ~np.asarray(results, dtype=bool),
            lambda node, idx, t: node.get_into([keys[i] for i in idx], [outs[i] for i in idx], t),
            costs,
            results,
            _remaining(option, deadline),
            accept,
        )
        outcome.verified = check is not None
        return outcome

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
            lambda i, held: bool(held),
        )

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when at least one node answers a ping within `timeout_s` (the pool is usable)."""
        if self.is_local:
            return True
        nodes = self.nodes
        if not nodes:
            return False
        futures = [self._pool().submit(node.ping, timeout_s) for node in nodes]
        done, _ = concurrent.futures.wait(futures, timeout=timeout_s + 0.5)
        return any(f.result() for f in done if f.exception() is None)

    def shm_staging(self, nbytes: int) -> Any | None:
        """A buffer of `nbytes` in the shared-memory region of this pool's one node (`UcxNode.shm_buffer`: its calls
        move values lying there without a copy), or None: several nodes, a node elsewhere, or no room."""
        nodes = self.nodes
        shm_buffer = getattr(nodes[0], "shm_buffer", None) if len(nodes) == 1 else None
        return None if shm_buffer is None else shm_buffer(nbytes)

    def close(self) -> None:
        for callback in self._on_close:
            try:
                callback()
            except Exception:  # closing must release everything even if one step fails
                pass
        self.members.close()
        with self._executor_lock:
            for executor in (self._executor, self._pipeline):
                if executor is not None:
                    executor.shutdown(wait=False, cancel_futures=True)
            self._executor = self._pipeline = None
