"""`exists`: how many of an engine's blocks, from the first, the pool holds (the lookup behind `ContextCaching.exists`).

Contract: `hashes` (V1 block hashes, or V0 keys: `PrimaryKey` or str) is checked by `requests.bind_exists` (bad input
raises `EmsException(EMS_INVALID_ARGUMENT)`); V1 hashes need a registered layout (`v1_namespace` is None until then:
refused the same way). This package's additions: `lease_ms=N` or `pin=True` in `kwargs` asks the pool to keep what it
reports (`ems.store.holds`); only keys it keeps count as held; `chain_prefix=...` (V1) looks the blocks up under
their placement unit, as a save given the same prefix stored them. The answer is `CcResult(consecutive hits from the
first, len(hashes))`. A failing or unreachable pool never raises: its keys count as misses (a pool that raised reports
0 hits), logged once per call (a warning; an info line when other replicas answered for every key of the nodes that
failed, so nothing was missed). Every pool answers through `PoolBackend.exists` (the embedded pool's is its store's
index). Each answered call is added to the metrics' exists counters once (a pool that raised is not counted, as before
this module existed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ems.backends.base import PoolBackend, PoolOutcome, PoolRequest
from ems.client.metrics import CcMetrics
from ems.datapath.keys import chain_keys, v0_keys, v1_keys
from ems.datapath.requests import bind_exists
from ems.errors import EmsErrorCode, EmsException
from ems.types import CcKvOption, CcResult, PrimaryKey

logger = logging.getLogger("ems")


def consecutive_prefix(flags: Sequence[bool]) -> int:
    """How many leading entries are true."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def count_held(
    pool: PoolBackend,
    metrics: CcMetrics,
    hashes: Any,
    option: CcKvOption | None,
    kwargs: dict[str, Any],
    v0_namespace: bytes,
    v1_namespace: bytes | None,
) -> CcResult:
    """How many of `hashes`, from the first, `pool` holds (the module's contract). `v1_namespace` is the registered
    layout's key namespace, None before `register_kvcache`."""
    bound = bind_exists(hashes, option, kwargs)
    items, units = bound.items, None
    if isinstance(items[0], (PrimaryKey, str)):
        keys, route_keys = v0_keys(v0_namespace, items)
    else:
        if v1_namespace is None:
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "exists(): V1 hashes need register_kvcache() first")
        if bound.chain_prefix is None:
            keys, route_keys = v1_keys(v1_namespace, items)
        else:
            keys, route_keys, units = chain_keys(v1_namespace, items, bound.chain_prefix)
    try:
        outcome = pool.exists(PoolRequest(route_keys, keys, bound.option, units=units), bound.hold)
    except Exception as exc:  # the contract: a failing pool is a miss, not an exception
        logger.warning("exists: pool failure reported as 0 hits: %s", exc)
        return CcResult(0, len(keys))
    if outcome.errors:  # said once per call, so that misses caused by a failing node are not silent
        _log_failed_nodes(outcome)
    unreachable = bool(outcome.errors) and outcome.unreachable  # (errors first: no property call on the usual path)
    result = CcResult(0 if unreachable else consecutive_prefix(outcome.results), len(keys))
    metrics.record_exists(result.success, result.total)
    return result


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
