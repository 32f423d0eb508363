"""Mooncake Store as the pool (`pool_backend="mooncake"`, docs/guides/mooncake.md): `MooncakePool` (`pool`), a `PoolBackend`
over Mooncake's Python client, and its parts, each with its own contract: `keys` (Mooncake keys of storage keys),
`workers` (the threads the client's calls run on, each bounded by its caller's deadline), `connection` (set-up
attempts, health, the store handle) and `memory` (registered staging and bounce buffers, where a call's bytes go).
"""

from ems.backends.mooncake.keys import KEY_PREFIX, mooncake_key
from ems.backends.mooncake.pool import MooncakePool

__all__ = ["KEY_PREFIX", "MooncakePool", "mooncake_key"]
