"""The lookup job: how many of a call's keys, from the first, the pool holds (`exists`, beside the save and load jobs).

Contract: `run_lookup(pool, call, v0_namespace, v1_namespace)` takes a checked `ExistsCall` (`ems.datapath.calls`:
V1 hashes need a registered layout, `v1_namespace` None until then, refused the same way) and answers
`CcResult(consecutive hits from the first, len(keys))`. What the pool is to keep of what it finds travels with the
call (`ExistsCall.hold`: `lease_ms=N` or `pin=True`, `ems.store.index.Holds`); only keys it keeps count as held. A failing
or unreachable pool never raises: its keys count as misses (a pool that raised reports 0 hits, `LookupOutcome.pool_raised`),
logged once per call (a warning; an info line when other replicas answered for every key of the nodes that failed,
so nothing was missed). Every pool answers through `PoolBackend.exists` (the embedded pool's is its store's index).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ems.backends.base import PoolBackend, PoolCall, PoolOutcome
from ems.datapath.calls import ExistsCall, consecutive_prefix
from ems.datapath.keys import chain_keys, v0_keys, v1_keys
from ems.errors import invalid_argument
from ems.types import CcResult

logger = logging.getLogger("ems")


@dataclass(frozen=True)
class LookupOutcome:
    """A lookup's answer, and whether the pool raised (then the answer is 0 hits and no pool answered)."""

    result: CcResult
    pool_raised: bool = False


def run_lookup(pool: PoolBackend, call: ExistsCall, v0_namespace: bytes, v1_namespace: bytes | None) -> LookupOutcome:
    """How many of `call`'s keys, from the first, `pool` holds (the module's contract)."""
    units = None
    if call.is_v0:
        keys, route_keys = v0_keys(v0_namespace, call.items)  # type: ignore[arg-type]
    else:
        if v1_namespace is None:
            raise invalid_argument("exists(): V1 hashes need register_kvcache() first")
        if call.chain_prefix is None:
            keys, route_keys = v1_keys(v1_namespace, call.items)  # type: ignore[arg-type]
        else:  # looked up under their placement unit, as a save given the same prefix stored them
            keys, route_keys, units = chain_keys(v1_namespace, call.items, call.chain_prefix)  # type: ignore[arg-type]
    try:
        outcome = pool.exists(PoolCall(route_keys, keys, call.option, units=units), call.hold)
    except Exception as exc:  # the contract: a failing pool is a miss, not an exception
        logger.warning("exists: pool failure reported as 0 hits: %s", exc)
        return LookupOutcome(CcResult(0, len(keys)), pool_raised=True)
    if outcome.errors:  # said once per call, so that misses caused by a failing node are not silent
        _log_failed_nodes(outcome)
    unreachable = bool(outcome.errors) and outcome.unreachable  # (errors first: no property call on the usual path)
    return LookupOutcome(CcResult(0 if unreachable else consecutive_prefix(outcome.results), len(keys)))


def _log_failed_nodes(outcome: PoolOutcome[bool]) -> None:
    """Say that nodes failed during an exists. Every key found: other nodes (replicas) answered for the failed
    ones' keys and nothing was lost, which is worth an info line, not a warning. Otherwise the keys not found include
    any that no other node answered for, which count as misses (with one replica: all of the failed nodes' keys)."""
    error = outcome.first_error()
    reason = error.message() if error is not None else ""
    found, total = sum(map(bool, outcome.results)), len(outcome.results)
    if found == total:
        logger.info(
            "exists: %d of %d pool node(s) failed; other nodes (replicas) answered for their keys, all %d found: %s",
            len(outcome.errors),
            outcome.nodes_contacted,
            total,
            reason,
        )
        return
    logger.warning(
        "exists: %d of %d pool node(s) failed; those of their keys no other node (replica) answered for count as misses "
        "(%d of %d keys found): %s",
        len(outcome.errors),
        outcome.nodes_contacted,
        found,
        total,
        reason,
    )
