"""Storage keys and routing keys, deterministic across processes and machines (never Python's `hash()`).

A storage key is `namespace (16 bytes) | form byte | the caller's key`. The namespace is a BLAKE2b digest of
everything a stored value depends on besides the caller's key: tenant, model, tensor- and pipeline-parallel rank
(dropped for MLA, where every TP rank holds the same KV, so ranks share keys), and for V1 the registered layout's
signature. Routing keys are what the DESIGN routes by: the block hash (V1), `distribute_key` (V0 `PrimaryKey`),
or the whole key (V0 plain `str`, the SDK's older form: such a key routes by itself). Each form has its own form
byte, so a `str` key never collides with a `PrimaryKey` or a block hash, and a block of the token form (keyed by the
chained digest of its tokens, `ems.datapath.tokens`) never with a block hash an engine gives. `route_key_of` reads
the routing key back out of a storage key (a pool node placing the keys it holds, `ems.pool.repair`). A namespace
record's key (`ems.store.ns_records`: the reserved namespace, `FORM_RECORD`, the model's digest, a slot) routes by
the model's digest, so every slot of a model's records sits on the same owners: an engine's registration reads and
writes them on `pool_replicas` nodes, whatever the pool's size.

Placement units (locality, `ems.cluster.rendezvous`). A prefix chain is cut into units of `UNIT_BLOCKS` consecutive
blocks at absolute chain positions: block p belongs to unit p // UNIT_BLOCKS, identified by the hash of its first
block (the anchor) as `unit_id` (8 bytes, a BLAKE2b digest of the anchor's `encode_hash`). A block whose chain
position is known is stored as `namespace | FORM_CHAIN | unit id | encode_hash(block hash)` (`chain_keys`; the token
form's blocks under `FORM_TOKENS_CHAIN`, so the two forms still never meet) and placed by its unit: its routing key
is everything after the form byte, and `units` gives each key's unit as a u64 (`unit_of` reads it back from a stored
key). V1 hash-form calls without `chain_prefix` keep `FORM_V1` and are placed per key, V0 by `distribute_key`.
The placement (unit size and the routing's group width) is a namespace part (`PLACEMENT`): values stored under
another placement are misses, never placed on the wrong nodes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ems.cluster.rendezvous import UNIT_WIDTH
from ems.config import CcConfig
from ems.store.ns_records import FORM_RECORD, RECORD_KEY_BYTES
from ems.types import V0Key

FORM_V0 = b"\x00"
FORM_V1 = b"\x01"
FORM_V0_STR = b"\x02"
FORM_TOKENS = b"\x03"  # V1 blocks of the token form placed per key (before placement units; read back only)
FORM_CHAIN = b"\x04"  # V1 blocks an engine gives with their chain position: placed by their unit
FORM_TOKENS_CHAIN = b"\x05"  # V1 blocks of the token form (hash derived from their tokens), placed by their unit
_UNIT_FORMS = (FORM_CHAIN, FORM_TOKENS_CHAIN)

UNIT_BLOCKS = 256  # consecutive chain blocks per placement unit
UNIT_ID_BYTES = 8
#: the placement a namespace is for: unit size and group width (a change of either makes old values misses)
PLACEMENT = f"units-{UNIT_BLOCKS}x{UNIT_WIDTH}"


def namespace(tenant: str | None, cc_config: CcConfig, layout_signature: int | None) -> bytes:
    parts = [
        f"tenant={tenant or ''}",
        f"model={cc_config.model_id}",
        f"tp={'shared' if cc_config.shares_kv_across_tp else f'{cc_config.tp_rank}/{cc_config.tp_world_size}'}",
        f"pp={cc_config.pp_rank}/{cc_config.pp_world_size}",
        f"layout={layout_signature if layout_signature is not None else 'raw'}",
        f"placement={PLACEMENT}",
    ]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).digest()


def encode_hash(block_hash: int) -> bytes:
    """A block hash as minimal signed little-endian bytes: at most 33 for the accepted range -2**255 .. 2**256 - 1
    (`requests` refuses wider ints; this encoding itself is injective over every int)."""
    return block_hash.to_bytes((block_hash.bit_length() + 8) // 8, "little", signed=True)


def v1_keys(ns: bytes, hashes: Sequence[int], form: bytes = FORM_V1) -> tuple[list[bytes], list[bytes]]:
    """(storage keys, routing keys) of V1 block hashes (`form`: FORM_V1 for hashes an engine gives, FORM_TOKENS for
    the token form's derived ones)."""
    routes = [encode_hash(h) for h in hashes]
    prefix = ns + form
    return [prefix + r for r in routes], routes


def unit_id(anchor: int) -> bytes:
    """The id of the placement unit whose first block has hash `anchor` (8 bytes)."""
    return hashlib.blake2b(encode_hash(anchor), digest_size=UNIT_ID_BYTES).digest()


def chain_keys(
    ns: bytes, hashes: Sequence[int], chain_prefix: Sequence[int], form: bytes = FORM_CHAIN
) -> tuple[list[bytes], list[bytes], np.ndarray]:
    """(storage keys, routing keys, units) of V1 block hashes whose chain position is known: `hashes[i]` is block
    `len(chain_prefix) + i` of a chain whose earlier blocks are `chain_prefix` (from its first block). `units` (u64
    `[keys]`) is each key's unit id as an int (`ems.cluster.rendezvous` places by it). One digest per unit, not per block."""
    if form not in _UNIT_FORMS:
        raise ValueError(f"not a unit key form: {form!r}")
    start = len(chain_prefix)
    n = len(hashes)
    first_unit, last_unit = start // UNIT_BLOCKS, (start + n - 1) // UNIT_BLOCKS
    ids = []
    for u in range(first_unit, last_unit + 1):
        p = u * UNIT_BLOCKS
        ids.append(unit_id(chain_prefix[p] if p < start else hashes[p - start]))
    prefix = ns + form
    storage, routes = [], []
    unit_of_block = (np.arange(start, start + n) // UNIT_BLOCKS - first_unit).tolist()
    for h, u in zip(hashes, unit_of_block):
        route = ids[u] + encode_hash(h)
        routes.append(route)
        storage.append(prefix + route)
    ints = np.array([int.from_bytes(i, "little") for i in ids], dtype=np.uint64)
    return storage, routes, ints[np.asarray(unit_of_block, dtype=np.int64)]


def v0_keys(ns: bytes, key_list: Sequence[V0Key]) -> tuple[list[bytes], list[bytes]]:
    """(storage keys, routing keys) of V0 keys (already checked): a PrimaryKey routes by `distribute_key` only, a
    plain `str` key by itself."""
    prefix = ns + FORM_V0
    str_prefix = ns + FORM_V0_STR
    storage, routes = [], []
    for key in key_list:
        if isinstance(key, str):
            raw = key.encode("utf-8")
            routes.append(raw)
            storage.append(str_prefix + raw)
            continue
        dk = key.distribute_key.encode()
        ak = key.attribute_key.encode()
        routes.append(dk)
        storage.append(prefix + len(dk).to_bytes(2, "little") + dk + ak)
    return storage, routes


def route_key_of(key: bytes) -> bytes:
    """The routing key of storage key `key` (`v1_keys`, `v0_keys`): the inverse of their layout. A key of no known
    form (too short, an unknown form byte, a length past its end) routes by itself, as any client key that is not
    this package's would."""
    ns = 16
    if len(key) <= ns:
        return key
    form = key[ns : ns + 1]
    if form in (FORM_V1, FORM_TOKENS, FORM_V0_STR) or (form in _UNIT_FORMS and len(key) > ns + 1 + UNIT_ID_BYTES):
        return key[ns + 1 :]
    if form == FORM_RECORD and len(key) == RECORD_KEY_BYTES:
        return key[ns + 1 : -1]  # the model's digest, without the slot
    if form == FORM_V0 and len(key) >= ns + 3:
        n = int.from_bytes(key[ns + 1 : ns + 3], "little")
        if ns + 3 + n <= len(key):
            return key[ns + 3 : ns + 3 + n]
    return key


def unit_of(key: bytes) -> int | None:
    """The placement unit (as `chain_keys`' `units` gives it) of storage key `key`, None for a key placed by its
    routing key alone (every form but the unit forms, and any key of no known form)."""
    ns = 16
    if len(key) > ns + 1 + UNIT_ID_BYTES and key[ns : ns + 1] in _UNIT_FORMS:
        return int.from_bytes(key[ns + 1 : ns + 1 + UNIT_ID_BYTES], "little")
    return None
