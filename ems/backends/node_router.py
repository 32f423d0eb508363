"""Routing a pool call's keys to their nodes: owners and replicas, per-node requests within the limits, with one
deadline; reads in `ems.backends.reads`, the fan-out in `ems.backends.fanout`, what is known of each node's speed in
`ems.backends.latency`.

Contract:
* Each key has `replicas` owning nodes among the live ones (`ems.cluster.rendezvous.ranked_owners`, rendezvous hashing of
  its route key, or of its placement unit and then its route key within the unit's group where the request gives
  `units`; `ems.cluster.placement.Members` holds the live set, which membership may change between calls). A call
  (a `PoolCall`, as the pool's) sends batched requests per node it needs, nodes in parallel, and returns by the
  request's deadline (`PoolCall.until`). A node that fails or does not answer in time fails only its own keys
  (those of its requests that had not been answered); its error is reported in `PoolOutcome.errors`.
* A node's keys are cut, in request order, into requests within `limits` (`protocol.RequestLimits`: its
  `batches` and the wire's per-key costs) and sent one after the other, so a call of any size works; the caller
  never sees the cut.
* A put goes to every owner of each key at once; see `put` for when a value counts as stored. Once every key has
  been answered by one owner, a put waits for the owners still sending only as long as `NodeLatency.abort_delay`
  says, then gives up on them (`FanOut.writes`): a slow node does not hold every save up to its deadline.
* A read (`ems.backends.reads.read`) asks each wanted key's first owner, and sends what it missed, found damaged (not
  the `expected` value) or could not get from a failed node to the next node, until the deadline; while the pool
  rebalances after a join it also asks the nodes after the owners (`Members.fallback`). With replicas (and `hedge`,
  the `pool_hedge` setting), reads are hedged: a node slower than `NodeLatency.hedge_delay` has its keys asked of
  the next owner too, and slow nodes are asked last. A read's `results` may come filled in for some keys by a layer
  above (the read cache): only the others are wanted (None for `get`, False for `get_into` and `exists`).
* Hot units (`ems.backends.hot_reads.HotReads`, `hot`): a get or get_into whose keys have units counts its reads by
  unit; a key of a unit hot enough for copies asks the copy node `HotReads.first` picks before its owners (one try
  more: a miss, a damaged value or a failure there goes on to the owners as above, hedged when `hedge` is on, even
  with one replica), and what it then read elsewhere is written to that copy node in the background. With copies in
  play, every value of such a key is checked against `expected` (whatever `read_check` says), so a damaged or stale
  copy is a miss that falls back, and only checked values are copied; a get without `expected` reads no copies. An
  `exists` without a hold asks the same copy nodes first (it is not counted as a read); one with a hold asks the
  owners only, so that the hold is kept where a load falls back to. A call whose units are all cold is the owners'
  read, unchanged.
* Results come back in request order; interpreting them (the consecutive prefix, raising when nothing was
  reachable) is the caller's job.
"""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from ems.backends.base import PoolCall, PoolOutcome, ReadCheck
from ems.backends.fanout import FanOut, WarmNodes
from ems.backends.hedges import Hedge
from ems.backends.hot_reads import HotReads
from ems.backends.latency import NodeLatency
from ems.backends.reads import read
from ems.buffers import Buffer
from ems.cluster.placement import Members, View
from ems.cluster.rendezvous import UNIT_WIDTH, ranked_owners
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.store.value_format import HEADER_SIZE, matches
from ems.transport.base import AsPlaced, NodeClient, NodeLocation, SharedBuffer, TransportError
from ems.transport.exists_holds import Hold
from ems.transport.protocol import WIRE_LIMITS, Costs, RequestLimits, key_lens

HEALTH_PINGS = 8  # nodes `healthy` pings at most
HEALTH_FIRST = 2  # ... of which it pings these first


def pool_location(nodes: Sequence[NodeClient]) -> NodeLocation:
    """Where a pool of `nodes` lives: in this process when every node does (and there is one), else remote."""
    local = bool(nodes) and all(n.location is NodeLocation.IN_PROCESS for n in nodes)
    return NodeLocation.IN_PROCESS if local else NodeLocation.REMOTE


class NodeRouter:
    """Routes batched put/get/exists to the owning nodes; see the module docstring."""

    def __init__(
        self,
        nodes: Sequence[NodeClient],
        replicas: int = 1,
        connect: Callable[[str], NodeClient] | None = None,
        limits: RequestLimits = WIRE_LIMITS,
        hedge: bool = True,
    ) -> None:
        if not nodes and connect is None:
            raise ValueError("a pool client needs at least one node")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas = replicas
        self.limits = limits
        self.hedge = hedge  # reads hedged around slow nodes (with replicas)
        #: with replicas, a damaged copy sends a read on to the next owner: each value read is checked here
        self.read_check = ReadCheck.EXPECTED if replicas > 1 else ReadCheck.NONE
        self.members = Members(nodes, connect)
        #: where the pool's nodes live: in this process only when every node says so (`NodeClient.location`)
        self.location = pool_location(nodes)
        self.latency = NodeLatency()
        #: the connections kept warm: a bounded set, least recently used closed once idle (a large pool)
        self.warm = WarmNodes()
        self.fanout = FanOut(limits, self.latency, self.location, lambda: 4 * len(self.members.view.nodes), self.warm)
        #: hot units' read copies: which node a read asks first, and the copies written back (bounded)
        self.hot = HotReads(self.fanout, limits)
        self.members.on_change(self._forget)

    def _forget(self, added: list[str], removed: list[str]) -> None:
        for address in removed:  # (a node that came back is in both: measured afresh)
            self.latency.forget(address)

    @property
    def nodes(self) -> list[NodeClient]:
        """The nodes placement uses now (the live set)."""
        return list(self.members.view.nodes)

    def _read(
        self,
        request: PoolCall,
        wanted: np.ndarray,
        call: Any,
        costs: Any,
        results: list,
        deadline: Deadline,
        accept: Any,
        hedge: Hedge | None,
        view: View | None = None,
        first: np.ndarray | None = None,
        served: np.ndarray | None = None,
    ) -> PoolOutcome:
        hedged = self.hedge and (self.replicas > 1 or first is not None)
        return read(
            self.fanout,
            self.members.view if view is None else view,
            request.route_keys,
            wanted,
            call,
            costs,
            results,
            deadline,
            accept,
            self.replicas,
            self.members.fallback,
            hedge if hedged else None,
            request.units,
            first,
            served,
        )

    # ---- batched operations ----

    def put(
        self, request: PoolCall, values: Sequence[Sequence[Buffer]], value_lens: np.ndarray | None = None
    ) -> PoolOutcome[bool]:
        """Store each value at its `replicas` owning nodes in parallel; `results[i]` is True when the value is
        stored: at least one owner acknowledged it and no owner that answered refused it. An owner that failed as a
        whole (lost, timed out) does not undo the others' acknowledgements: the value is stored with fewer copies,
        and the failure is in `errors`. With one replica this is exactly "the owner acknowledged it".

        `value_lens` (int64, bytes of each value, its parts together) saves measuring every part when the caller
        knows them; it is only used to cut requests at the limits."""
        keys, deadline = request.keys, request.until()
        results: list = [False] * len(keys)
        outcome: PoolOutcome[bool] = PoolOutcome(results)
        view = self.members.view
        if not keys:
            return outcome
        if not view.nodes:
            outcome.nodes_contacted = 1
            outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_ERROR, "no pool node is live"))
            return outcome
        ranks = ranked_owners(request.route_keys, view.seeds, self.replicas, request.units)
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

        answers = self.fanout.writes(
            node_keys,
            len(keys),
            lambda node, idx, d: node.put([keys[i] for i in idx.tolist()], [values[i] for i in idx.tolist()], d),
            costs,
            deadline,
            outcome,
            observe=len(view.nodes) > 1,
        )
        acked = np.zeros(len(keys), dtype=bool)
        refused = np.zeros(len(keys), dtype=bool)
        for (_, idx), answer in zip(node_keys, answers):
            flags = answer.answers
            ok = np.asarray(flags, dtype=bool)
            got = idx[: len(flags)]  # a node that failed midway acknowledged a prefix of its keys
            acked[got[ok]] = True
            refused[got[~ok]] = True
        outcome.results = (acked & ~refused).tolist()
        return outcome

    def get(self, request: PoolCall, results: list | None = None) -> PoolOutcome[Buffer | None]:
        """Each wanted key's stored value (`results[i]` None: wanted), or None.

        With replicas, a damaged copy (not the `expected` value) sends the key on to the next owner, so each value
        is checked here (`read_check` is `ReadCheck.EXPECTED`). With one owner there is nowhere to go: the caller
        checks."""
        keys, expected = request.keys, request.expected
        results = [None] * len(keys) if results is None else results
        check = expected if self.read_check is ReadCheck.EXPECTED else None
        view = self.members.view
        wanted = np.fromiter((r is None for r in results), dtype=bool, count=len(keys))
        first = self._first(request, wanted, view)

        def accept(i: int, value: object) -> bool:
            if value is None:
                return False
            verify = check if first is None or first[i] < 0 else expected  # (a hot key's value: always checked)
            return verify is None or matches(cast(Buffer, value), verify, i)  # a reply's value is a Buffer

        def costs(idx: np.ndarray) -> Costs:
            # the reply carries the values: expected sizes bound it (an unexpected value is refused anyway)
            reply = None if expected is None else np.asarray(expected.payload_len, dtype=np.int64)[idx] + HEADER_SIZE
            return RequestLimits.key_costs(key_lens([keys[i] for i in idx.tolist()]), reply)

        def get(node: NodeClient, idx: np.ndarray, d: Deadline) -> list:
            return node.get([keys[i] for i in idx.tolist()], d)

        def prepare(idx: np.ndarray) -> tuple[Any, Any, Any]:  # a hedge's values are new buffers: kept as they are
            return get, accept, results.__setitem__

        served = None if first is None else np.full(len(keys), -1, dtype=np.int64)
        outcome = self._read(
            request, wanted, get, costs, results, request.until(), accept, Hedge(prepare, needs_quiet=False), view, first, served
        )
        if first is not None and served is not None:
            self.hot.write_back(view, first, served, keys, lambda i: cast(Buffer, results[i]))
        return outcome

    def get_into(
        self, request: PoolCall, outs: Sequence[Buffer], results: list | None = None, as_placed: AsPlaced | None = None
    ) -> PoolOutcome[bool]:
        """Place each wanted key's value (`results[i]` False: wanted) in the caller's writable buffer `outs[i]`,
        which the node receives it into without an intermediate copy when it travels alone; `results[i]` is True
        where a value of exactly `len(outs[i])` bytes is now in `outs[i]` (a buffer whose result is False holds
        unspecified bytes). With replicas each placed value is checked against `expected` (as `get`).
        `as_placed`: handed to a node that places values progressively (`UcxNode.get_into`) when the whole request
        goes to it as one call, with no replicas (it may then run while the node places them); else unused."""
        keys, expected = request.keys, request.expected
        results = [False] * len(keys) if results is None else results
        check = expected if self.read_check is ReadCheck.EXPECTED else None
        view = self.members.view
        wanted = ~np.asarray(results, dtype=bool)
        first = self._first(request, wanted, view)
        progressive = as_placed if check is None and first is None else None

        def verify(i: int, value: Buffer) -> bool:
            against = check if first is None or first[i] < 0 else expected  # (a hot key's value: always checked)
            return against is None or matches(value, against, i)

        def fetch(node: Any, idx: np.ndarray, d: Deadline) -> list[bool]:  # (`as_placed`: progressive nodes only)
            at = idx.tolist()
            wanted_keys, wanted_outs = [keys[i] for i in at], [outs[i] for i in at]
            if progressive is not None and idx.size == len(keys) and node.places_progressively:
                return cast(list[bool], node.get_into(wanted_keys, wanted_outs, d, as_placed=progressive))
            return cast(list[bool], node.get_into(wanted_keys, wanted_outs, d))

        def accept(i: int, placed: object) -> bool:  # a miss (or a value of another length) asks the next owner
            return bool(placed) and verify(i, outs[i])

        def costs(idx: np.ndarray) -> Costs:
            reply = np.fromiter((memoryview(outs[i]).nbytes for i in idx.tolist()), dtype=np.int64, count=idx.size)
            return RequestLimits.key_costs(key_lens([keys[i] for i in idx.tolist()]), reply)

        def prepare(idx: np.ndarray) -> tuple[Any, Any, Any]:
            """A hedge receives into buffers of its own; a value is copied into the caller's once adopted."""
            own = {i: np.empty(memoryview(outs[i]).nbytes, dtype=np.uint8) for i in idx.tolist()}

            def fetch_own(node: Any, sub: np.ndarray, d: Deadline) -> list[bool]:
                return cast(list[bool], node.get_into([keys[i] for i in sub], [own[i] for i in sub.tolist()], d))

            def accept_own(i: int, placed: object) -> bool:
                return bool(placed) and verify(i, own[i])

            def adopt(i: int, placed: object) -> None:
                memoryview(outs[i]).cast("B")[:] = own[i]
                results[i] = True

            return fetch_own, accept_own, adopt

        served = None if first is None else np.full(len(keys), -1, dtype=np.int64)
        outcome = self._read(
            request, wanted, fetch, costs, results, request.until(), accept, Hedge(prepare, needs_quiet=True), view, first, served
        )
        if first is not None and served is not None:
            self.hot.write_back(view, first, served, keys, lambda i: outs[i])
        return outcome

    def exists(self, request: PoolCall, results: list | None = None, hold: Hold | None = None) -> PoolOutcome[bool]:
        """Whether each wanted key (`results[i]` False: wanted) is held (with `hold`: held and kept as asked, by the
        node that answered for it)."""
        keys = request.keys
        results = [False] * len(keys) if results is None else results
        view = self.members.view
        wanted = ~np.asarray(results, dtype=bool)
        # where a hot unit's reads go (not a read itself); a hold is kept by the owners, where a load falls back to
        copies = hold is None and request.units is not None and len(view.nodes) >= 2 * UNIT_WIDTH
        first = self.hot.first(request, wanted, view, count=False) if copies else None

        def exists(node: NodeClient, idx: np.ndarray, d: Deadline) -> list:
            return node.exists([keys[i] for i in idx.tolist()], d, hold)

        def held(i: int, flag: object) -> bool:
            return bool(flag)

        return self._read(
            request,
            wanted,
            exists,
            lambda idx: RequestLimits.key_costs(key_lens([keys[i] for i in idx.tolist()])),
            results,
            request.until(),
            held,
            Hedge(lambda idx: (exists, held, results.__setitem__), needs_quiet=False),
            view,
            first,
        )

    def _first(self, request: PoolCall, wanted: np.ndarray, view: View) -> np.ndarray | None:
        """A get's or get_into's node to ask first per key (`HotReads.first`, its reads counted): None without units,
        or without `expected` (a copy's value must be checked before it is taken or copied on)."""
        if request.units is None or request.expected is None or len(view.nodes) < 2 * UNIT_WIDTH:
            return None  # (no copies: nothing else to run, not even `HotReads`)
        return self.hot.first(request, wanted, view)

    def healthy(self, timeout_s: float) -> bool:
        """True when at least one node answers a ping within `timeout_s`, of at most HEALTH_PINGS random ones: first
        HEALTH_FIRST of them, and the others only when none of those has answered in half the time (a ping connects:
        a healthy pool of any size costs an engine's start one or two connections, not one per node)."""
        if self.location is NodeLocation.IN_PROCESS:  # (nothing to reach)
            return True
        nodes = self.nodes
        if not nodes:
            return False
        nodes = random.sample(nodes, min(len(nodes), HEALTH_PINGS))
        deadline = Deadline.after(timeout_s)
        futures = [self.fanout.submit(node.ping, deadline) for node in nodes[:HEALTH_FIRST]]
        if _any_true(futures, timeout_s / 2):
            return True
        futures += [self.fanout.submit(node.ping, deadline) for node in nodes[HEALTH_FIRST:]]
        return _any_true(futures, deadline.left() + 0.5)

    def shm_staging(self, nbytes: int) -> SharedBuffer | None:
        """A buffer of `nbytes` in the memory the one node shares with this process (`NodeClient.shm_buffer`), or
        None: several nodes, or the node shares none."""
        nodes = self.nodes
        return nodes[0].shm_buffer(nbytes) if len(nodes) == 1 else None

    def close(self) -> None:
        self.members.close()
        self.hot.close()
        self.fanout.close()


def _any_true(futures: list[concurrent.futures.Future], timeout_s: float) -> bool:
    """Whether one of `futures` gives True within `timeout_s` (an exception counts as False); returns at the first."""
    try:
        for f in concurrent.futures.as_completed(futures, timeout=max(0.0, timeout_s)):
            if f.exception() is None and f.result():
                return True
    except concurrent.futures.TimeoutError:
        pass
    return False
