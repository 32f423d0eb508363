"""Fixtures for tests against real pool-node processes (defined in pool_testlib)."""

from pool_testlib import node_clients, pool_nodes, shared_node  # noqa: F401
