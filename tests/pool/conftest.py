"""Fixtures for tests against real pool-node processes (defined in pool_testlib, cluster_testlib, disk_testlib and
hosts_testlib: hosts made of network namespaces)."""

from cluster_testlib import etcd  # noqa: F401
from disk_testlib import disk_nodes  # noqa: F401
from hosts_testlib import hosts  # noqa: F401
from pool_testlib import node_clients, pool_nodes, shared_node  # noqa: F401
