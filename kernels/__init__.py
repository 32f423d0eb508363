"""Gather/scatter of KV-cache token rows between the registered paged cache and contiguous staging buffers.

`get_backend(device, requested)` returns the `CopyBackend` that serves a device; see `base.py` for the contract
every backend keeps. Backends: `TorchBackend` (vectorised torch, the CPU production path), `MemcpyBackend` (one
copy per block and plane, for comparison), and `ems.kernels.triton_backend.TritonBackend` (Triton kernels on
cuda/npu, the interpreter on CPU), imported lazily so that `import ems` never imports triton.
"""

from ems.kernels.base import CopyBackend, KernelBackend, PlaneSet
from ems.kernels.memcpy_backend import MemcpyBackend
from ems.kernels.select import get_backend
from ems.kernels.torch_backend import TorchBackend

__all__ = ["CopyBackend", "KernelBackend", "MemcpyBackend", "PlaneSet", "TorchBackend", "get_backend"]
