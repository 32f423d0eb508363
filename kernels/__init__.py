"""Gather/scatter of KV-cache token rows between the registered paged cache and contiguous staging buffers.

`get_backend(device, requested)` returns the `CopyBackend` that serves a device; see `base.py` for the contract
every backend keeps.
"""

from ems.kernels.base import CopyBackend, KernelBackend, PlaneSet
from ems.kernels.select import get_backend

__all__ = ["CopyBackend", "KernelBackend", "PlaneSet", "get_backend"]
