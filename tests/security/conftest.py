"""tests/security shares the pool-node fixtures of tests/pool."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pool"))

from pool_testlib import node_clients, pool_nodes, shared_node  # noqa: F401
