"""The pool-node server's old import path: the server now lives beside its client in `ems.transport.ucx_server`
(see that module for the contract); the names the node assembly and tests use are re-exported here."""

from __future__ import annotations

from ems.transport.ucx_server import (  # noqa: F401 - re-exports
    MIN_INFLIGHT_BYTES,
    WILDCARD_HOSTS,
    ByteBudget,
    NodeLimits,
    NodeStore,
    PoolServer,
    tenant_prefix,
)
