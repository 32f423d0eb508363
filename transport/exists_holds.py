"""Holds: what an EXISTS may ask a pool node to keep of the keys it finds (wire protocol version 6).

Contract:
* `Hold.lease(lease_ms)`: a lease on each key found, until the key is next read (the load the lookup promised) or
  `lease_ms` has passed (at most `MAX_LEASE_MS`); `Hold.pin()`: a pin, until the key's value is replaced or deleted.
  What a node does with them: `ems.store.index.Holds`.
* On the wire: an EXISTS with `Flags.LEASE` carries the lease's milliseconds as a u32 before its keys meta
  (`encode_exists_meta` / `decode_exists_meta`); one with `Flags.PIN` carries nothing more. The reply flags say, per
  key, that the node holds it *and* keeps it as asked (a key it could not keep, its budget used up, is reported as
  not held: a lookup never promises what the node will not keep). Both flags at once are malformed.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ems.transport import protocol

MAX_LEASE_MS = 60_000
_LEASE_MS = struct.Struct("<I")


class HoldKind(enum.Enum):
    LEASE = "lease"
    PIN = "pin"


@dataclass(frozen=True)
class Hold:
    """What a lookup asks the pool to keep of the keys it finds: a lease of `lease_ms`, or a pin."""

    kind: HoldKind
    lease_ms: int = 0

    @classmethod
    def lease(cls, lease_ms: int) -> Hold:
        if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or not 0 < lease_ms <= MAX_LEASE_MS:
            raise ValueError(f"lease_ms must be an int in 1..{MAX_LEASE_MS}, got {lease_ms!r}")
        return cls(HoldKind.LEASE, lease_ms)

    @classmethod
    def pin(cls) -> Hold:
        return cls(HoldKind.PIN)

    @property
    def flags(self) -> int:
        return int(protocol.Flags.LEASE if self.kind is HoldKind.LEASE else protocol.Flags.PIN)


def encode_exists_meta(keys_meta: bytes, hold: Hold | None) -> bytes:
    """An EXISTS's meta: `keys_meta` (`metas.encode_keys_meta`), after the lease's milliseconds for a lease."""
    if hold is None or hold.kind is HoldKind.PIN:
        return keys_meta
    return _LEASE_MS.pack(hold.lease_ms) + keys_meta


def decode_exists_meta(flags: int, meta: memoryview | bytes) -> tuple[Hold | None, memoryview | bytes]:
    """(the hold an EXISTS asks for, its keys meta); ProtocolError when malformed."""
    lease, pin = flags & protocol.Flags.LEASE, flags & protocol.Flags.PIN
    if lease and pin:
        raise protocol.ProtocolError("an EXISTS asks for a lease and a pin at once")
    if pin:
        return Hold.pin(), meta
    if not lease:
        return None, meta
    if len(meta) < _LEASE_MS.size:
        raise protocol.ProtocolError("EXISTS meta shorter than its lease")
    (lease_ms,) = _LEASE_MS.unpack_from(meta)
    if not 0 < lease_ms <= MAX_LEASE_MS:
        raise protocol.ProtocolError(f"a lease of {lease_ms} ms, limit {MAX_LEASE_MS}")
    return Hold(HoldKind.LEASE, lease_ms), memoryview(meta)[_LEASE_MS.size :]
