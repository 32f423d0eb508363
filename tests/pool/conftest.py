"""Fixtures for tests against real pool-node processes (defined in pool_testlib and cluster_testlib)."""

from cluster_testlib import etcd  # noqa: F401
from disk_testlib import disk_nodes  # noqa: F401
from pool_testlib import node_clients, pool_nodes, shared_node  # noqa: F401
