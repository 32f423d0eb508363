"""Key → node routing by rendezvous (highest-random-weight) hashing.

Each key goes to the node with the highest score `mix(hash(route_key) ^ seed(node))`. There is no master to fail,
every client computes the same owner from the same node list (order does not matter), and adding or removing one
of N nodes moves only the ~1/N of keys that node wins or held. Scores are computed vectorised in numpy.

Replication (`ranked_owners`): a key's k owners are its k highest-scoring nodes, best first. Rank 0 is exactly
`owners`, and when a node leaves, each key whose owners included it gains the next node of its own ranking, so the
other k-1 copies stay where they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

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


def _scores(route_keys: Sequence[bytes], seeds: np.ndarray) -> np.ndarray:
    key_hashes = np.fromiter((xxhash.xxh3_64_intdigest(k) for k in route_keys), dtype=np.uint64, count=len(route_keys))
    return _mix64(key_hashes[:, None] ^ seeds[None, :])


def owners(route_keys: Sequence[bytes], seeds: np.ndarray) -> np.ndarray:
    """int64 `[keys]`: the index of each key's owning node."""
    if len(seeds) == 1:
        return np.zeros(len(route_keys), dtype=np.int64)
    best: np.ndarray = np.argmax(_scores(route_keys, seeds), axis=1).astype(np.int64)
    return best


def ranked_owners(route_keys: Sequence[bytes], seeds: np.ndarray, k: int) -> np.ndarray:
    """int64 `[keys, min(k, nodes)]`: each key's k owning nodes, highest score first (column 0 is `owners`)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = min(k, len(seeds))
    if k == 1:
        return owners(route_keys, seeds)[:, None]
    order = np.argsort(_scores(route_keys, seeds), axis=1, kind="stable")[:, ::-1]
    return np.ascontiguousarray(order[:, :k]).astype(np.int64)
