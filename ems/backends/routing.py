"""Routing a pool call's keys to their nodes: owners and replicas, per-node requests within the limits, fan-out with
one deadline.

Contract:
* Each key has `replicas` owning nodes among the live ones (`ems.cluster.routing.ranked_owners`, rendezvous hashing of
  its route key; `ems.cluster.placement.Members` holds the live set, which membership may change between calls). A call
  sends batched requests per node it needs, nodes in parallel, and returns by its `Deadline`. A node that fails or
  does not answer in time fails only its own keys (those of its requests that had not been answered); its error is
  reported in `PoolOutcome.errors`.
* A node's keys are cut, in request order, into requests within `limits` (`protocol.RequestLimits`: its
  `batches` and the wire's per-key costs) and sent one after the other, so a call of any size works; the caller
  never sees the cut.
* A put goes to every owner of each key at once; see `put` for when a value counts as stored. A read asks each
  wanted key's first owner, and sends what it missed, found damaged (not the `expected` value) or could not get
  from a failed node to the next owner, until the deadline. A read's `results` may come filled in for some keys by
  a layer above (the read cache): only the others are wanted (None for `get`, False for `get_into` and `exists`).
* Results come back in request order; interpreting them (the consecutive prefix, raising when nothing was
  reachable) is the caller's job.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from ems.backends.base import PoolOutcome
from ems.buffers import Buffer
from ems.cluster.placement import Members
from ems.cluster.routing import ranked_owners
from ems.deadline import Deadline
from ems.errors import EmsErrorCode
from ems.store.kv_store import KvStore
from ems.store.value_format import HEADER_SIZE, ExpectedValues, matches
from ems.transport.base import AsPlaced, NodeClient, TransportError
from ems.transport.holds import Hold
from ems.transport.inprocess import InProcessNode
from ems.transport.protocol import WIRE_LIMITS, Costs, RequestLimits, key_lens

NodeCall = Callable[[NodeClient, np.ndarray, Deadline], list]  # one request to one node: its keys' indices


class NodeRouter:
    """Routes batched put/get/exists to the owning nodes; see the module docstring."""

    def __init__(
        self,
        nodes: Sequence[NodeClient],
        replicas: int = 1,
        connect: Callable[[str], NodeClient] | None = None,
        limits: RequestLimits = WIRE_LIMITS,
    ) -> None:
        if not nodes and connect is None:
            raise ValueError("a pool client needs at least one node")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas = replicas
        self.limits = limits
        self.members = Members(nodes, connect)
        self.is_local = bool(nodes) and all(isinstance(n, InProcessNode) for n in nodes)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    @property
    def nodes(self) -> list[NodeClient]:
        """The nodes placement uses now (the live set)."""
        return list(self.members.view.nodes)

    @property
    def local_store(self) -> KvStore | None:
        """The embedded pool's store when the only node is in-process (the one-pass data path), else None."""
        nodes = self.members.view.nodes
        if len(nodes) == 1 and isinstance(nodes[0], InProcessNode):
            store = nodes[0].store
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

    def _run_per_node(
        self,
        node_keys: list[tuple[NodeClient, np.ndarray]],
        call: NodeCall,
        costs: Callable[[np.ndarray], Costs],
        deadline: Deadline,
        outcome: PoolOutcome,
    ) -> list[tuple[list, bool]]:
        """Run `call(node, indices, deadline)` for each node's keys, nodes in parallel, in requests within the limits
        (`costs(indices)` → per-key data bytes, meta bytes, data frames), until `deadline`. Per node: the answers for
        a prefix of its keys (all of them unless its node failed) and whether the node failed (its error is added
        to `outcome.errors`)."""

        def run(node: NodeClient, idx: np.ndarray) -> tuple[list, TransportError | None]:
            answers: list = []
            for batch in self.limits.batches(costs(idx)):
                if deadline.expired():
                    return answers, TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{node.address}: no answer in time")
                try:
                    answers.extend(call(node, idx[batch], deadline))
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
        timeout_s = deadline.left()
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
        call: NodeCall,
        costs: Callable[[np.ndarray], Costs],
        results: list,
        deadline: Deadline,
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
        if n == 1:  # one live node owns every key (the usual same-host node): one round, nothing to rank
            ((values, _),) = self._run_per_node([(view.nodes[0], pending)], call, costs, deadline, outcome)
            for i, value in zip(pending[: len(values)].tolist(), values):  # a failed node answered a prefix
                if accept(i, value):
                    results[i] = value
            outcome.nodes_contacted = 1
            return outcome
        depth = n if self.replicas > 1 or n > 1 else 1  # a failed owner passes its keys on: rank every node
        ranks = ranked_owners([route_keys[i] for i in pending.tolist()], view.seeds, depth)
        pos = np.zeros(pending.size, dtype=np.int64)  # each pending key's next rank to ask
        tries = np.zeros(pending.size, dtype=np.int64)  # answers (miss or damaged) each key has had
        failed = np.zeros(n, dtype=bool)
        contacted = np.zeros(n, dtype=bool)
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
            if deadline.expired():
                break
        outcome.nodes_contacted = int(contacted.sum())
        return outcome

    # ---- batched operations ----

    def put(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        values: Sequence[Sequence[Buffer]],
        deadline: Deadline,
        value_lens: np.ndarray | None = None,
    ) -> PoolOutcome[bool]:
        """Store each value at its `replicas` owning nodes in parallel; `results[i]` is True when the value is
        stored: at least one owner acknowledged it and no owner that answered refused it. An owner that failed as a
        whole (lost, timed out) does not undo the others' acknowledgements: the value is stored with fewer copies,
        and the failure is in `errors`. With one replica this is exactly "the owner acknowledged it".

        `value_lens` (int64, bytes of each value, its parts together) saves measuring every part when the caller
        knows them; it is only used to cut requests at the limits."""
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
            return RequestLimits.put_costs(key_lens([keys[i] for i in idx.tolist()]), data, parts)

        answers = self._run_per_node(
            node_keys,
            lambda node, idx, d: node.put([keys[i] for i in idx], [values[i] for i in idx], d),
            costs,
            deadline,
            outcome,
        )
        acked = np.zeros(len(keys), dtype=bool)
        refused = np.zeros(len(keys), dtype=bool)
        for (_, idx), (flags, _) in zip(node_keys, answers):
            ok = np.asarray(flags, dtype=bool)
            got = idx[: len(flags)]  # a node that failed midway acknowledged a prefix of its keys
            acked[got[ok]] = True
            refused[got[~ok]] = True
        outcome.results = (acked & ~refused).tolist()
        return outcome

    def get(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        deadline: Deadline,
        expected: ExpectedValues | None = None,
        results: list | None = None,
    ) -> PoolOutcome[Buffer | None]:
        """Each wanted key's stored value (`results[i]` None: wanted), or None.

        With replicas, a damaged copy (not the `expected` value) sends the key on to the next owner, so each value
        is checked here (once: `verified` tells the caller). With one owner there is nowhere to go: the caller
        checks."""
        results = [None] * len(keys) if results is None else results
        check = expected if self.replicas > 1 else None

        def accept(i: int, value: object) -> bool:
            if value is None:
                return False
            return check is None or matches(cast(Buffer, value), check, i)  # a reply's value is a Buffer

        def costs(idx: np.ndarray) -> Costs:
            # the reply carries the values: expected sizes bound it (an unexpected value is refused anyway)
            reply = None if expected is None else np.asarray(expected.payload_len, dtype=np.int64)[idx] + HEADER_SIZE
            return RequestLimits.key_costs(key_lens([keys[i] for i in idx.tolist()]), reply)

        outcome = self._fan_out(
            route_keys,
            np.fromiter((r is None for r in results), dtype=bool, count=len(keys)),
            lambda node, idx, d: node.get([keys[i] for i in idx], d),
            costs,
            results,
            deadline,
            accept,
        )
        outcome.verified = check is not None
        return outcome

    def get_into(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        outs: Sequence[Buffer],
        deadline: Deadline,
        expected: ExpectedValues | None = None,
        results: list | None = None,
        as_placed: AsPlaced | None = None,
    ) -> PoolOutcome[bool]:
        """Place each wanted key's value (`results[i]` False: wanted) in the caller's writable buffer `outs[i]`,
        which the node receives it into without an intermediate copy when it travels alone; `results[i]` is True
        where a value of exactly `len(outs[i])` bytes is now in `outs[i]` (a buffer whose result is False holds
        unspecified bytes). With replicas each placed value is checked against `expected` (as `get`).
        `as_placed`: handed to a node that places values progressively (`UcxNode.get_into`) when the whole request
        goes to it as one call, with no replicas (it may then run while the node places them); else unused."""
        results = [False] * len(keys) if results is None else results
        check = expected if self.replicas > 1 else None
        progressive = as_placed if check is None else None

        def fetch(node: Any, idx: np.ndarray, d: Deadline) -> list[bool]:
            wanted_keys, wanted_outs = [keys[i] for i in idx], [outs[i] for i in idx]
            if progressive is not None and idx.size == len(keys) and getattr(node, "places_progressively", False):
                return cast(list[bool], node.get_into(wanted_keys, wanted_outs, d, as_placed=progressive))
            return cast(list[bool], node.get_into(wanted_keys, wanted_outs, d))

        def accept(i: int, placed: object) -> bool:  # a miss (or a value of another length) asks the next owner
            return bool(placed) and (check is None or matches(outs[i], check, i))

        def costs(idx: np.ndarray) -> Costs:
            reply = np.fromiter((memoryview(outs[i]).nbytes for i in idx.tolist()), dtype=np.int64, count=idx.size)
            return RequestLimits.key_costs(key_lens([keys[i] for i in idx.tolist()]), reply)

        outcome = self._fan_out(
            route_keys,
            ~np.asarray(results, dtype=bool),
            fetch,
            costs,
            results,
            deadline,
            accept,
        )
        outcome.verified = check is not None
        return outcome

    def exists(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        deadline: Deadline,
        results: list | None = None,
        hold: Hold | None = None,
    ) -> PoolOutcome[bool]:
        """Whether each wanted key (`results[i]` False: wanted) is held (with `hold`: held and kept as asked, by the
        node that answered for it)."""
        results = [False] * len(keys) if results is None else results
        return self._fan_out(
            route_keys,
            ~np.asarray(results, dtype=bool),
            lambda node, idx, d: node.exists([keys[i] for i in idx], d, hold),
            lambda idx: RequestLimits.key_costs(key_lens([keys[i] for i in idx.tolist()])),
            results,
            deadline,
            lambda i, held: bool(held),
        )

    def healthy(self, timeout_s: float) -> bool:
        """True when at least one node answers a ping within `timeout_s`."""
        if self.is_local:
            return True
        nodes = self.nodes
        if not nodes:
            return False
        deadline = Deadline.after(timeout_s)
        futures = [self._pool().submit(node.ping, deadline) for node in nodes]
        done, _ = concurrent.futures.wait(futures, timeout=timeout_s + 0.5)
        return any(f.result() for f in done if f.exception() is None)

    def shm_staging(self, nbytes: int) -> Any | None:
        """A buffer of `nbytes` in the shared-memory region of the one node (`UcxNode.shm_buffer`), or None."""
        nodes = self.nodes
        shm_buffer = getattr(nodes[0], "shm_buffer", None) if len(nodes) == 1 else None
        return None if shm_buffer is None else shm_buffer(nbytes)

    def close(self) -> None:
        self.members.close()
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
