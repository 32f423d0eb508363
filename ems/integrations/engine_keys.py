"""An engine block's pool keys (`ems.integrations.block_transfer` moves the blocks under them; no engine imports).

Contract:
* `block_keys(hashes, tp_rank, tp_size, shared)` folds the tensor-parallel rank into each block hash
  (`hash128 << 16 | tp_size << 8 | tp_rank`; MLA's `shared` tag `0xFFFF` is one key for all ranks), so one process
  (an engine's scheduler) can ask for every rank's blocks in a single `exists` call (`lookup_keys`: block 0 of ranks
  0..tp-1, then block 1, ...). Engine hashes may be bytes (vLLM's sha256 block hashes: the first 16 bytes are used)
  or ints. With an `epoch` (the namespace's epoch, `ems.integrations.epoch`: random bytes) a block's 128 bits are
  BLAKE2b keyed by the epoch, so the keys of one epoch are never the keys of another, whatever the engine's hashes
  (a reset moves to a new random epoch).
* KV cache groups (a hybrid model: full and sliding-window attention): `group_hashes(hashes, group)` tags each
  engine hash with its group (a 16-byte BLAKE2b of the hash's 128 bits, personalised by the group index), so the
  blocks of one position in two groups are two keys and never collide; a model with one group uses its hashes
  untagged (its keys as before).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

EngineHash = bytes | int

SHARED_TAG = 0xFFFF
MAX_TP = 255


def _hash128(h: EngineHash) -> int:
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(bytes(h[:16]), "little")
    if isinstance(h, int):
        return h & ((1 << 128) - 1)
    raise TypeError(f"block hash must be bytes or int, got {type(h).__name__}")


def _epoch_hash(h: EngineHash, epoch: bytes) -> int:
    if not epoch:
        return _hash128(h)
    digest = hashlib.blake2b(_hash128(h).to_bytes(16, "little"), key=epoch, digest_size=16).digest()
    return int.from_bytes(digest, "little")


def group_hashes(hashes: Sequence[EngineHash], group: int) -> list[bytes]:
    """`hashes` tagged with KV cache group `group` (see the module contract)."""
    if not 0 <= group < 1 << 16:
        raise ValueError(f"KV cache group {group} out of range")
    salt = group.to_bytes(2, "little")
    return [
        hashlib.blake2b(_hash128(h).to_bytes(16, "little"), digest_size=16, person=b"ems-kv-group", salt=salt).digest()
        for h in hashes
    ]


def rank_tag(tp_rank: int, tp_size: int, shared: bool) -> int:
    if shared:
        return SHARED_TAG
    if not 0 <= tp_rank < tp_size <= MAX_TP:
        raise ValueError(f"tp_rank {tp_rank} / tp_size {tp_size} out of range (tp_size <= {MAX_TP})")
    return (tp_size << 8) | tp_rank


def block_keys(hashes: Sequence[EngineHash], tp_rank: int, tp_size: int, shared: bool, epoch: bytes = b"") -> list[int]:
    """The pool keys of one rank's blocks (in `epoch`)."""
    tag = rank_tag(tp_rank, tp_size, shared)
    return [(_epoch_hash(h, epoch) << 16) | tag for h in hashes]


def lookup_keys(hashes: Sequence[EngineHash], tp_size: int, shared: bool, epoch: bytes = b"") -> list[int]:
    """Every rank's keys, block by block (block 0 of ranks 0..tp-1, then block 1, ...)."""
    if shared:
        return block_keys(hashes, 0, 1, True, epoch)
    tags = [rank_tag(r, tp_size, False) for r in range(tp_size)]
    return [(_epoch_hash(h, epoch) << 16) | tag for h in hashes for tag in tags]
