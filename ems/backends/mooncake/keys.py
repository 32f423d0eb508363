"""Mooncake keys of this package's storage keys: `KEY_PREFIX` + the storage key in hex (Mooncake keys are strings).

The storage key already holds the namespace (tenant, model, ranks, layout signature), so tenants and models stay
apart exactly as on `ems` nodes, and no key of another Mooncake user that lacks the prefix can collide with ours.
Namespace records (`ems.store.ns_records`) are such keys too: `ems/` + the hex of a record key, whose digest holds
the tenant and the model, stored and read by `MooncakePool` like any value.
"""

from __future__ import annotations

KEY_PREFIX = "ems/"
HEALTH_KEY = KEY_PREFIX + "health"  # what the health probe asks about (never written)


def mooncake_key(key: bytes) -> str:
    """The Mooncake key of a storage key."""
    return KEY_PREFIX + key.hex()
