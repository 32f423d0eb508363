"""Storage keys and routing keys, deterministic across processes and machines (never Python's `hash()`).

A storage key is `namespace (16 bytes) | form byte | the caller's key`. The namespace is a BLAKE2b digest of
everything a stored value depends on besides the caller's key: tenant, model, tensor- and pipeline-parallel rank
(dropped for MLA, where every TP rank holds the same KV, so ranks share keys), and for V1 the registered layout's
signature. Routing keys are what the DESIGN routes by: the block hash (V1), `distribute_key` (V0 `PrimaryKey`),
or the whole key (V0 plain `str`, the SDK's older form: such a key routes by itself). Each form has its own form
byte, so a `str` key never collides with a `PrimaryKey` or a block hash, and a block of the token form (keyed by the
chained digest of its tokens, `ems.datapath.tokens`) never with a block hash an engine gives. `route_key_of` reads
the routing key back out of a storage key (a pool node placing the keys it holds, `ems.pool.repair`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ems.config import CcConfig
from ems.types import V0Key

FORM_V0 = b"\x00"
FORM_V1 = b"\x01"
FORM_V0_STR = b"\x02"
FORM_TOKENS = b"\x03"  # V1 blocks of the token form: their hash is derived from their tokens, not given


def namespace(tenant: str | None, cc_config: CcConfig, layout_signature: int | None) -> bytes:
    parts = [
        f"tenant={tenant or ''}",
        f"model={cc_config.model_id}",
        f"tp={'shared' if cc_config.shares_kv_across_tp else f'{cc_config.tp_rank}/{cc_config.tp_world_size}'}",
        f"pp={cc_config.pp_rank}/{cc_config.pp_world_size}",
        f"layout={layout_signature if layout_signature is not None else 'raw'}",
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
    if form in (FORM_V1, FORM_TOKENS, FORM_V0_STR):
        return key[ns + 1 :]
    if form == FORM_V0 and len(key) >= ns + 3:
        n = int.from_bytes(key[ns + 1 : ns + 3], "little")
        if ns + 3 + n <= len(key):
            return key[ns + 3 : ns + 3 + n]
    return key
