"""Key → node routing by rendezvous (highest-random-weight) hashing.

Each key goes to the node with the highest score `mix(hash(route_key) ^ seed(node))`. There is no master to fail,
every client computes the same owner from the same node list (order does not matter), and adding or removing one
of N nodes moves only the ~1/N of keys that node wins or held. Scores are computed vectorised in numpy.

Replication (`ranked_owners`): a key's k owners are its k highest-scoring nodes, best first. Rank 0 is exactly
`owners`, and when a node leaves, each key whose owners included it gains the next node of its own ranking, so the
other k-1 copies stay where they are.

Placement units (locality; `units` given, one u64 per key: `ems.datapath.keys.chain_keys`). A unit's group is its
`UNIT_WIDTH` highest-scoring nodes by the unit's hash (O(N) scores and a partial sort per unit, not per key); a
key's ranking is its group ordered by the key's own score (its routing key's hash), then the nodes after the group in
the unit's order. So a unit's keys spread over its group's nodes, replicas land on distinct members of it, a call of
many units touches about `UNIT_WIDTH` nodes per unit, and a join or loss moves ~1/N of the values (a unit's group
changes with probability ~W/N, and then only the keys on the member that changed move). Keys without units are
their own unit: the ranking is exactly the per-key rendezvous ranking above. With as many nodes as `UNIT_WIDTH` or
fewer, the group is every node and units change nothing.

Reads while the pool rebalances (`read_order`): after f joins, a unit's group may have lost up to f members to the
joined nodes (now first after the group) and a key's other old owners are at most f ranks further inside the group;
so a read tries the first min(W, replicas + f) of the group and then those f displaced nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

UNIT_WIDTH = 4  # nodes per placement unit's group
FAILOVER_SPARE = 8  # nodes a read ranks past the ones it may try, to skip the ones that fail during the call

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-spread 64-bit mix (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def node_seeds(node_ids: Sequence[str]) -> np.ndarray:
    """u64 `[nodes]`: one seed per node identity (its "host:port")."""
    return np.array([xxhash.xxh3_64_intdigest(n.encode()) for n in node_ids], dtype=np.uint64)


def route_hashes(route_keys: Sequence[bytes]) -> np.ndarray:
    """u64 `[keys]`: each routing key's hash (its rendezvous scores mix it with the node seeds)."""
    return np.fromiter((xxhash.xxh3_64_intdigest(k) for k in route_keys), dtype=np.uint64, count=len(route_keys))


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """int64 `[rows, k]`: each row's k highest-scoring columns, highest first (a partial sort: O(columns) a row)."""
    n = scores.shape[1]
    if k >= n:
        top = np.argsort(scores, axis=1, kind="stable")[:, ::-1]
    else:
        part = np.argpartition(scores, n - k, axis=1)[:, n - k :]
        order = np.argsort(np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")[:, ::-1]
        top = np.take_along_axis(part, order, axis=1)
    return np.ascontiguousarray(top).astype(np.int64, copy=False)


def _scores(route_keys: Sequence[bytes], seeds: np.ndarray) -> np.ndarray:
    return _mix64(route_hashes(route_keys)[:, None] ^ seeds[None, :])


def owners(route_keys: Sequence[bytes], seeds: np.ndarray, units: np.ndarray | None = None) -> np.ndarray:
    """int64 `[keys]`: the index of each key's owning node."""
    if len(seeds) == 1:
        return np.zeros(len(route_keys), dtype=np.int64)
    if units is not None:
        return ranked_owners(route_keys, seeds, 1, units)[:, 0]
    best: np.ndarray = np.argmax(_scores(route_keys, seeds), axis=1).astype(np.int64)
    return best


def ranked_owners(
    route_keys: Sequence[bytes], seeds: np.ndarray, k: int, units: np.ndarray | None = None, width: int = UNIT_WIDTH
) -> np.ndarray:
    """int64 `[keys, min(k, nodes)]`: each key's k first nodes in its ranking (column 0 is `owners`); with `units`
    (u64 per key), placed by units over groups of `width` nodes (see the module docstring)."""
    return ranked_by_hash(route_hashes(route_keys), seeds, k, units, width)


def ranked_by_hash(
    hashes: np.ndarray,
    seeds: np.ndarray,
    k: int,
    units: np.ndarray | None = None,
    width: int = UNIT_WIDTH,
    copy: np.ndarray | None = None,
) -> np.ndarray:
    """`ranked_owners` of keys given by their routing keys' hashes (`route_hashes`). `copy` (with `units`; int per
    key, 0: the unit's own group): rank key i inside its unit's copy group `copy[i]` instead, the `width` nodes after
    the first `copy[i] * width` of the unit's order (a hot unit's extra read copies, `ems.cluster.hot`; k <= width)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(seeds)
    k = min(k, n)
    if n == 1:
        return np.zeros((len(hashes), 1), dtype=np.int64)
    if units is None:
        return _top(_mix64(hashes[:, None] ^ seeds[None, :]), k)
    units = np.asarray(units, dtype=np.uint64)
    if units.shape != (len(hashes),):
        raise ValueError(f"units: {units.shape} for {len(hashes)} keys")
    w = min(width, n)
    uniq, inverse = np.unique(units, return_inverse=True)
    if copy is not None and copy.any():
        if k > w:
            raise ValueError(f"a copy group ranks at most its {w} nodes, asked for {k}")
        groups = n // w
        copy = np.asarray(copy, dtype=np.int64) % max(1, groups)  # (never more copy groups than the pool holds)
        top = _top(_mix64(uniq[:, None] ^ seeds[None, :]), int(copy.max() + 1) * w)[inverse.reshape(-1)]
        group = np.take_along_axis(top, copy[:, None] * w + np.arange(w)[None, :], axis=1)
        own = _mix64(hashes[:, None] ^ seeds[group])
        if k == 1:  # (a reader's copy node: the group member its own hash ranks first, no sort)
            return np.take_along_axis(group, np.argmax(own, axis=1)[:, None], axis=1)
        ranked = np.take_along_axis(group, np.argsort(own, axis=1, kind="stable")[:, ::-1], axis=1)
        return np.ascontiguousarray(ranked[:, :k])
    depth = max(k, w)
    unit_top = _top(_mix64(uniq[:, None] ^ seeds[None, :]), depth)[inverse.reshape(-1)]
    group = unit_top[:, :w]
    own = _mix64(hashes[:, None] ^ seeds[group])
    head = np.take_along_axis(group, np.argsort(own, axis=1, kind="stable")[:, ::-1], axis=1)
    if depth == w:
        return np.ascontiguousarray(head[:, :k])
    return np.ascontiguousarray(np.concatenate([head, unit_top[:, w:]], axis=1)[:, :k])


def read_order(
    route_keys: Sequence[bytes],
    seeds: np.ndarray,
    replicas: int,
    fallback: int = 0,
    units: np.ndarray | None = None,
    width: int = UNIT_WIDTH,
    spare: int = FAILOVER_SPARE,
) -> tuple[np.ndarray, int]:
    """(ranks `[keys, depth]`, tries): the nodes a read asks for each key in order, of which it may use the first
    `tries` (nodes that fail are skipped without using one: `spare` more are ranked for them), with `fallback` nodes
    joined recently (see the module docstring)."""
    n = len(seeds)
    if units is None or n <= width or fallback == 0:
        tries = min(n, replicas + fallback)
        return ranked_owners(route_keys, seeds, min(n, tries + spare), units, width), tries
    head = min(width, replicas + fallback)
    tries = min(n, head + fallback)
    ranks = ranked_owners(route_keys, seeds, min(n, width + fallback + spare), units, width)
    depth = ranks.shape[1]
    displaced = list(range(width, min(depth, width + fallback)))
    columns = list(range(head)) + displaced + list(range(head, width)) + list(range(width + len(displaced), depth))
    return np.ascontiguousarray(ranks[:, columns]), tries
