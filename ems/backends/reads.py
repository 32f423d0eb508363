"""A read's keys to the nodes that hold them: owners in rank order, failover, the fallback while the pool rebalances,
and hedging around slow nodes (used by `ems.backends.node_router.NodeRouter` for get, get_into and exists).

Contract (`read`):
* Each wanted key is asked of its first owner (rendezvous rank over the live nodes); a key not answered with an
  accepted value goes to its next node in rank order, round by round, until the deadline. A miss or a damaged value
  uses up one of the key's tries; a node that failed (lost, timed out) does not, and is skipped for the rest of the
  call, so a key whose owner died is read from the nodes after it (also before membership drops the dead node).
* Tries: `replicas`, plus `fallback()` (`Members.fallback`: nodes that joined or came back recently): while the pool
  rebalances after a join, a key's new owner may not hold it yet and its previous owner, now one rank further,
  does; so a key missing at its owners is also asked of that many nodes after them (keys placed by units: the
  order of `ems.cluster.rendezvous.read_order`, which also asks the unit's displaced group members). Never more than
  the nodes. A key's ranking goes `FAILOVER_SPARE` nodes past its tries (failed nodes are skipped), not over the
  whole pool.
* Slow nodes (`NodeLatency.slow`) are asked last among the nodes a key may try.
* Hedging (`hedge` given, and a key has another node it may try): a node's share that is slow to answer has its keys
  also asked of their next node, the first accepted value wins, and a hedged value goes into the caller's buffers
  only once the slow request can no longer write there (`ems.backends.hedges`, the contract in full). A small hedged
  read (under `SMALL_BYTES`) has its first request receive into buffers of its own too, so a hedge's value is taken
  at once (a request to a node that cannot be stopped, e.g. one still connecting to a partitioned node, then never
  holds the key up): the copy of a few small values costs less than the wait.
* A request to one node, of no value bytes to speak of (an exists, a few small values: under `SMALL_BYTES`), runs
  on the calling thread (no thread hop) when nothing could hedge it: no hedge, or none of its keys may try another
  node; otherwise it runs hedged as above.
* A node to ask first (`first`, a node index per key, -1: none; a hot unit's copy, `ems.cluster.hot`): such a key
  asks that node before its ranking, with one try more, so that a miss, a damaged value or a failure there goes on
  to the key's owners exactly as above (failover, fallback, hedging: a copy node slower than its hedge delay is
  hedged to the first owner; one known slow is not asked first, and its entry in `first` is set to -1). `served`
  (int per key, where given) gets the index of the node whose answer each key took (-1: none).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence

import numpy as np

from ems.backends.base import PoolOutcome
from ems.backends.fanout import CostsOf, FanOut, NodeRequest
from ems.backends.hedges import Accept, Hedge, Share, send_hedges, settle
from ems.backends.latency import SMALL_BYTES
from ems.cluster.placement import View
from ems.cluster.rendezvous import read_order
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport.base import NodeClient, TransportError


def read(
    fanout: FanOut,
    view: View,
    route_keys: Sequence[bytes],
    wanted: np.ndarray,
    call: NodeRequest,
    costs: CostsOf,
    results: list,
    deadline: Deadline,
    accept: Accept,
    replicas: int,
    fallback: Callable[[], int] = lambda: 0,
    hedge: Hedge | None = None,
    units: np.ndarray | None = None,
    first: np.ndarray | None = None,
    served: np.ndarray | None = None,
) -> PoolOutcome:
    """See the module docstring. Fills `results` (the accepted answers, and `served`) and returns the outcome."""
    outcome = PoolOutcome(results)
    pending = np.nonzero(wanted)[0]
    if pending.size == 0:
        return outcome
    n = len(view.nodes)
    if n == 0:
        outcome.nodes_contacted = 1
        outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_ERROR, "no pool node is live"))
        return outcome
    if n == 1:  # one live node owns every key (the usual same-host node): one round, nothing to rank
        (answer,) = fanout.all([(view.nodes[0], pending)], call, costs, deadline, outcome, observe=False)
        for i, value in zip(pending[: len(answer.answers)].tolist(), answer.answers):  # a failed node answered a prefix
            if accept(i, value):
                results[i] = value
                if served is not None:
                    served[i] = 0
        outcome.nodes_contacted = 1
        return outcome
    pending_units = None if units is None else np.asarray(units, dtype=np.uint64)[pending]
    # the nodes each key may try (`allowed`), and a few more ranked after them for failover
    ranks, allowed = read_order([route_keys[i] for i in pending.tolist()], view.seeds, replicas, fallback(), pending_units)
    latency = fanout.latency
    slow = np.zeros(n, dtype=bool)
    if latency.any_slow and (allowed > 1 or first is not None):
        slow = np.fromiter((latency.slow(node.address) for node in view.nodes), dtype=bool, count=n)
    if slow.any():  # slow nodes last among the nodes a key may try (stable otherwise)
        head = ranks[:, :allowed]
        ranks[:, :allowed] = np.take_along_axis(head, np.argsort(slow[head], axis=1, kind="stable"), axis=1)
    extra = None
    if first is not None:
        ranks, extra = _ask_first(ranks, first[pending], slow)
        first[pending[~extra]] = -1  # (not asked: known slow, or none)
    state = PendingKeys(pending, ranks, n, extra)

    def small(idx: np.ndarray) -> bool:  # a request of no value bytes to speak of (exists, a few small values)
        return int(costs(idx)[0].sum()) < SMALL_BYTES

    contacted = np.zeros(n, dtype=bool)
    hedging = hedge is not None and (allowed > 1 or (extra is not None and bool(extra.any())))
    while state.pending.size:
        candidate = state.next_candidates()
        if state.pending.size == 0:
            break
        node_ids = np.unique(candidate).tolist()
        contacted[node_ids] = True
        # one node, whose transport bounds its calls by the deadline: on this thread (no hop), but a call on this
        # thread cannot be hedged, so only where no hedge could help: a partitioned or slow owner of
        # keys that may try another node must not hold them (cutting its call short at a guessed delay instead failed
        # live nodes on a busy host, dropping their connections, and lost the keys only they held)
        lone = view.nodes[node_ids[0]] if len(node_ids) == 1 else None
        is_small = small(state.pending)
        here = lone is not None and lone.self_timed and (not hedging or (is_small and not state.tries_left(allowed)))
        # a small hedged read into the caller's buffers receives into buffers of its own, as a hedge does (copied
        # over once accepted): a hedge's value is then taken at once, never waiting for a slow or unreachable node's
        # request to be stopped first (one still connecting to a partitioned node cannot be stopped before the deadline)
        private = hedge is not None and hedge.needs_quiet and hedging and is_small and not here
        quiet = hedge is not None and hedge.needs_quiet and not private  # hedged values wait for the primary to stop
        shares = [
            _primary(
                fanout, view.nodes[j], j, state.pending[candidate == j], call, costs, deadline, here, hedge if private else None
            )
            for j in node_ids
        ]
        alt_pos = np.full(len(results), -1, dtype=np.int64)  # per key: the rank position its last hedge asked
        answered = np.zeros(len(results), dtype=bool)  # its primary answered it
        hedge_missed = np.zeros(len(results), dtype=np.int64)  # its hedges that answered it without an accepted value
        hedge_open = np.zeros(len(results), dtype=bool)  # a hedge asking for it has not answered yet
        hedge_empty = np.zeros(len(results), dtype=bool)  # a hedge asking for it ended without a value (missed, failed)
        accepted = np.zeros(len(results), dtype=bool)
        by_hedge: dict[int, tuple[Share, object]] = {}  # key -> (hedge share, answer), accepted, not adopted yet
        failed_now = np.zeros(n, dtype=bool)
        while True:
            for share in shares:
                if share.processed or not share.call.done():
                    continue
                share.processed = True
                done = share.call.wait(0)
                if done is None:  # (done: cannot happen)
                    continue
                answer = done
                got = share.call.idx[: len(answer.answers)]  # a node that failed midway answered a prefix of its keys
                if share.primary:
                    if answer.error is not None:
                        outcome.errors.append(answer.error)
                        failed_now[share.node_index] = True
                    answered[got] = True
                    check = share.accept or accept  # (a primary receiving into buffers of its own checks those)
                    for i, value in zip(got.tolist(), answer.answers):
                        if accepted[i] or not check(i, value):
                            continue
                        if share.adopt is None:
                            results[i] = value
                        else:
                            share.adopt(i, value)  # (its own buffers: copied into the caller's)
                        accepted[i] = True
                        by_hedge.pop(i, None)
                        if served is not None:
                            served[i] = share.node_index
                elif share.accept is not None:
                    hedge_open[share.call.idx] = False  # (a key it did not answer may be hedged on to the next node)
                    hedge_empty[share.call.idx] = True  # (its keys that get a value below are skipped by that value)
                    if answer.error is not None:  # a hedge's failure fails that node for the call, as any
                        failed_now[share.node_index] = True
                    for i, value in zip(got.tolist(), answer.answers):
                        if accepted[i] or i in by_hedge:
                            continue
                        if share.accept(i, value):
                            by_hedge[i] = (share, value)
                        else:
                            hedge_missed[i] += 1
            if hedge is not None and not quiet:  # nothing to stop first: take hedged values at once
                for i, (share, value) in list(by_hedge.items()):
                    assert share.adopt is not None
                    share.adopt(i, value)
                    accepted[i] = True
                    if served is not None:
                        served[i] = share.node_index
                del_keys = [i for i in by_hedge if accepted[i]]
                for i in del_keys:
                    by_hedge.pop(i)
            unresolved = [s for s in shares if s.primary and not s.processed and not _resolved(s, accepted, by_hedge)]
            if not unresolved or deadline.expired():
                break
            now = time.monotonic()
            next_at = deadline.at
            for share in unresolved:
                if not hedging:
                    continue
                at = share.call.started + fanout.latency.hedge_delay(share.call.nbytes)
                if at > now:
                    next_at = min(next_at, at)
                    continue
                # its keys without a value and without a hedge still asking for them (first the hedge, then, after a
                # hedge's miss or failure, the node after it)
                keys = [i for i in share.call.idx.tolist() if not accepted[i] and i not in by_hedge and not hedge_open[i]]
                if not keys or (share.hedged and not hedge_empty[keys].any()):  # only a hedge that ended empty
                    continue
                share.hedged = True
                assert hedge is not None
                shares += send_hedges(
                    fanout,
                    view,
                    share,
                    keys,
                    state,
                    alt_pos,
                    hedge_missed,
                    hedge_open,
                    failed_now,
                    allowed,
                    hedge,
                    costs,
                    deadline,
                    contacted,
                )
            futures = [s.call.future for s in shares if not s.processed and s.call.future is not None]
            if futures:
                concurrent.futures.wait(
                    futures, timeout=max(0.0, next_at - time.monotonic()), return_when=concurrent.futures.FIRST_COMPLETED
                )
        if by_hedge or any(s.primary and not s.processed for s in shares):  # (else a round has nothing to settle)
            settle(fanout, shares, accepted, by_hedge, outcome, deadline, quiet, served)
        state.advance(answered, accepted, hedge_missed, alt_pos, failed_now, allowed)
        if deadline.expired():
            break
    outcome.nodes_contacted = int(contacted.sum())
    return outcome


def _primary(
    fanout: FanOut,
    node: NodeClient,
    node_index: int,
    idx: np.ndarray,
    call: NodeRequest,
    costs: CostsOf,
    deadline: Deadline,
    here: bool,
    private: Hedge | None,
) -> Share:
    """Start a round's request to `node` (the view's `node_index`) for its keys `idx`: into the caller's buffers, or
    (`private`: the read's hedge) into buffers of its own, checked and adopted as a hedge's are."""
    if private is None:
        return Share(fanout.start(node, idx, call, costs, deadline, here), True, node_index=node_index)
    request, accept, adopt = private.prepare(idx)
    started = fanout.start(node, idx, request, costs, deadline, here)
    return Share(started, True, accept=accept, adopt=adopt, node_index=node_index)


def _ask_first(ranks: np.ndarray, first: np.ndarray, slow: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, extra): each key with a node to ask first (`first` >= 0, not known slow) gets it in front of its
    ranking, which keeps its depth (the node's own place in it, if any, dropped; else its last spare), and one try
    more (`extra`)."""
    extra = (first >= 0) & ~slow[np.maximum(first, 0)]
    if not extra.any():
        return ranks, extra
    moved = np.take_along_axis(ranks, np.argsort(ranks == first[:, None], axis=1, kind="stable"), axis=1)
    ahead = np.concatenate([first[:, None], moved[:, :-1]], axis=1)
    return np.ascontiguousarray(np.where(extra[:, None], ahead, ranks)), extra


def _resolved(share: Share, accepted: np.ndarray, by_hedge: dict) -> bool:
    """Every key of a primary share has a value (its own, or a hedge's)."""
    return all(accepted[i] or i in by_hedge for i in share.call.idx.tolist())


class PendingKeys:
    """The keys still wanted, each with its ranking, the rank position to ask next and the tries it used."""

    def __init__(self, pending: np.ndarray, ranks: np.ndarray, n: int, extra: np.ndarray | None = None) -> None:
        self.pending = pending
        self.ranks = ranks
        self.pos = np.zeros(pending.size, dtype=np.int64)
        # a key asking a node first (`_ask_first`) starts one try short: that node's miss does not use up one of its owners'
        self.tries = np.zeros(pending.size, dtype=np.int64) if extra is None else -extra.astype(np.int64)
        self.failed = np.zeros(n, dtype=bool)
        self.depth = ranks.shape[1]

    def _rows(self) -> np.ndarray:
        return np.arange(self.pending.size)

    def next_candidates(self) -> np.ndarray:
        """Each pending key's node to ask now (failed nodes skipped); keys with none left are dropped."""
        rows = self._rows()
        candidate = self.ranks[rows, np.minimum(self.pos, self.depth - 1)]
        while True:
            skip = self.failed[candidate] & (self.pos < self.depth)
            if not skip.any():
                break
            self.pos[skip] += 1
            candidate = self.ranks[rows, np.minimum(self.pos, self.depth - 1)]
        keep = self.pos < self.depth
        self._keep(keep)
        chosen: np.ndarray = candidate[keep]
        return chosen

    def _keep(self, keep: np.ndarray) -> None:
        self.pending, self.ranks = self.pending[keep], self.ranks[keep]
        self.pos, self.tries = self.pos[keep], self.tries[keep]

    def tries_left(self, allowed: int) -> bool:
        """Some pending key may try another node after the one it asks now."""
        return bool((self.tries + 1 < allowed).any())

    def alternates(
        self,
        keys: Sequence[int],
        slow_node: int,
        failed_now: np.ndarray,
        allowed: int,
        alt_pos: np.ndarray,
        hedge_missed: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """For the given keys (indices into the request): the ones that may try another node, and that node (the next
        in its ranking that has not failed, after the one asked now and after the last hedge's, `alt_pos`; a hedge's
        miss used a try, `hedge_missed`)."""
        where = {int(k): r for r, k in enumerate(self.pending.tolist())}
        chosen, alts = [], []
        for key in keys:
            r = where.get(key)
            if r is None or self.tries[r] + 1 + hedge_missed[key] >= allowed:
                continue
            p = max(int(self.pos[r]), int(alt_pos[key])) + 1
            while p < self.depth and (
                self.failed[self.ranks[r, p]] or failed_now[self.ranks[r, p]] or self.ranks[r, p] == slow_node
            ):
                p += 1
            if p < self.depth:
                chosen.append(key)
                alts.append(int(self.ranks[r, p]))
        return np.asarray(chosen, dtype=np.int64), np.asarray(alts, dtype=np.int64)

    def position_of(self, keys: np.ndarray, node: int) -> np.ndarray:
        """The rank position of `node` in each key's ranking."""
        where = {int(k): r for r, k in enumerate(self.pending.tolist())}
        rows = np.fromiter((where[int(k)] for k in keys.tolist()), dtype=np.int64, count=keys.size)
        positions: np.ndarray = np.argmax(self.ranks[rows] == node, axis=1)
        return positions

    def advance(
        self,
        answered: np.ndarray,
        accepted: np.ndarray,
        hedge_missed: np.ndarray,
        alt_pos: np.ndarray,
        failed_now: np.ndarray,
        allowed: int,
    ) -> None:
        """After a round: keys answered move on one node (one try used); a key whose hedges missed moves past the
        last hedge's node too (a try per miss); accepted keys and keys out of tries are done."""
        self.failed |= failed_now
        got = answered[self.pending]
        self.pos[got] += 1
        self.tries[got] += 1
        misses = hedge_missed[self.pending]
        missed = misses > 0
        self.pos[missed] = np.maximum(self.pos[missed], alt_pos[self.pending][missed] + 1)
        self.tries += misses
        keep = ~accepted[self.pending] & (self.tries < allowed) & (self.pos < self.depth)
        self._keep(keep)
