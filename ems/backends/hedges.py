"""Hedging a read around slow nodes (`ems.backends.reads.read`'s rounds): what a hedge is, sending hedges, and ending a
round that had them.

Contract (`read` calls these; nothing here runs on a round without a hedge nor a request left unanswered):
* `Hedge` (given by the caller, `ems.backends.node_router`): how a read asks a second node for keys.
* `Share`: one node's request of a round (a primary, or a hedge backing one up), with its node's index in the view.
* `send_hedges` (`hedge` given, and a key has another node it may try): when a node has not answered its share within
  `NodeLatency.hedge_delay` of its expected bytes, the keys of that share still without a value are also asked of
  their next node; whichever answers first with an accepted value wins. A hedge that misses a key (or whose node
  fails) sends it on to the node after, as long as the key has tries left, while the slow request keeps running:
  the slow node is never given up on before the deadline unless another node has the value (a busy host's slow
  answer is still a hit; a partitioned owner costs a hedge delay per node asked, not the call).
* `settle`: for a read into the caller's buffers (`Hedge.needs_quiet`) the hedge receives into buffers of its own,
  and its values are copied into the caller's only once the slow node's request can no longer write there: it ends
  by itself within `NodeLatency.abort_delay`, or is then aborted (`FanOut.abandon`) and waited for (a key whose slow
  request could not be stopped by the deadline is a miss, with an error). An abort is reported in the outcome
  (`errors`), so the caller retires its buffers. A primary request still running without a value for each of its
  keys at the round's end did not answer in time (an error in the outcome).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ems.backends.base import PoolOutcome
from ems.backends.fanout import CostsOf, FanOut, NodeRequest, NodeShare
from ems.cluster.placement import View
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport.base import TransportError

if TYPE_CHECKING:
    from ems.backends.reads import PendingKeys

Accept = Callable[[int, object], bool]


@dataclasses.dataclass
class Hedge:
    """How a read asks a second node for keys: `prepare(idx)` gives the request (into buffers of its own where the
    read fills the caller's) and how to check and keep each of its answers: `accept(i, answer)` (is it the value
    wanted), `adopt(i, answer)` (make it the key's result)."""

    prepare: Callable[[np.ndarray], tuple[NodeRequest, Accept, Callable[[int, object], None]]]
    needs_quiet: bool  # the primary request writes into the caller's buffers: adopt only once it is stopped


@dataclasses.dataclass
class Share:
    """One node's share of a round: its call, and the hedge calls made for it."""

    call: NodeShare
    primary: bool
    hedge_of: Share | None = None  # for a hedge: the share it backs up
    accept: Accept | None = None  # a hedge's own (or a primary's receiving into buffers of its own)
    adopt: Callable[[int, object], None] | None = None
    hedged: bool = False  # (a primary) a hedge was sent for it
    processed: bool = False
    node_index: int = -1  # its node's index in the view


def send_hedges(
    fanout: FanOut,
    view: View,
    share: Share,
    keys: Sequence[int],
    state: PendingKeys,
    alt_pos: np.ndarray,
    hedge_missed: np.ndarray,
    hedge_open: np.ndarray,
    failed_now: np.ndarray,
    allowed: int,
    hedge: Hedge,
    costs: CostsOf,
    deadline: Deadline,
    contacted: np.ndarray,
) -> list[Share]:
    """Ask each of `keys` (of the slow primary `share`) of its next node after the last one asked (see the module
    docstring; the next node per key: `PendingKeys.alternates`); marks the keys asked (`hedge_open`) and the nodes
    (`contacted`)."""
    slow_node = share.node_index
    rows, alts = state.alternates(keys, slow_node, failed_now, allowed, alt_pos, hedge_missed)
    out = []
    for j in np.unique(alts).tolist():
        idx = rows[alts == j]
        request, accept, adopt = hedge.prepare(idx)
        alt_pos[idx] = state.position_of(idx, j)
        hedge_open[idx] = True
        contacted[j] = True
        started = fanout.start(view.nodes[j], idx, request, costs, deadline)
        out.append(Share(started, False, share, accept, adopt, node_index=j))
    return out


def settle(
    fanout: FanOut,
    shares: list[Share],
    accepted: np.ndarray,
    by_hedge: dict,
    outcome: PoolOutcome,
    deadline: Deadline,
    needs_quiet: bool,
    served: np.ndarray | None,
) -> None:
    """End a round: adopt the hedged values whose slow request is stopped (aborting it first when it still runs);
    a primary request still running without a value for each of its keys did not answer in time."""
    for share in shares:
        if not share.primary or share.processed:
            continue
        mine = [i for i in share.call.idx.tolist() if i in by_hedge and not accepted[i]]
        if not mine:
            if not needs_quiet and all(accepted[i] for i in share.call.idx.tolist()):
                # its keys were read elsewhere; its late answer touches nothing of the caller's (a failure that
                # has come in by now is still reported, so that the node's trouble is not silent)
                if share.call.done():
                    answer = share.call.wait(0)
                    share.processed = True
                    if answer is not None and answer.error is not None:
                        outcome.errors.append(answer.error)
                continue
            outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{share.call.node.address}: no answer in time"))
            continue
        # the hedge has its values: give the slow request until its abort delay to end by itself (a busy host's
        # hiccup), then stop it
        wait_until = min(deadline.at, share.call.started + fanout.latency.abort_delay(share.call.nbytes))
        answer = share.call.wait(wait_until - time.monotonic())
        if answer is not None:
            share.processed = True
            if answer.error is not None:
                outcome.errors.append(answer.error)
            continue
        answer = fanout.abandon(share.call, deadline, "slow: its keys were read from the next owner")
        if answer is None:
            outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{share.call.node.address}: no answer in time"))
            continue  # it may still write into the caller's buffers: its keys stay misses
        if answer.error is not None:
            outcome.errors.append(answer.error)
        share.processed = True  # (an answer that came in as it was stopped is not used: the hedge's values are)
    for share in shares:
        if not share.primary or not share.processed:
            continue
        answer = share.call.wait(0)
        if answer is None or not answer.quiet:
            continue
        for i in share.call.idx.tolist():
            if i in by_hedge and not accepted[i]:
                hedge_share, value = by_hedge.pop(i)
                assert hedge_share.adopt is not None
                hedge_share.adopt(i, value)
                accepted[i] = True
                if served is not None:
                    served[i] = hedge_share.node_index
    by_hedge.clear()
