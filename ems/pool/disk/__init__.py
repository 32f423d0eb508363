"""A pool node's disk tier: values evicted from DRAM kept on a local disk, one file per value (docs/guides/disk-tier.md).

`DiskTier` (`tier`) is the tier the node's `TieredStore` uses; the rest are its parts, each with its own contract:
`records` (the record file's bytes and name), `files` (the directory: restore from names, reads, the I/O mode),
`ring` (the write queue in shared memory), `index` (what is on the disk: LRU order, capacity, spare files),
`state` (what the callers' side and the writer thread share, and the one lock that guards it), `writer` (the writer
thread) and `helper` (the process that writes the files).
"""

from ems.pool.disk.state import DiskTierStats, TierState
from ems.pool.disk.tier import DiskTier

__all__ = ["DiskTier", "DiskTierStats", "TierState"]
