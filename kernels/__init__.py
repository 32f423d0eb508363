"""Gather/scatter of KV-cache token rows between the registered paged cache and contiguous staging buffers.

`get_backend(device, requested)` returns the `CopyBackend` that serves a device; see `base.py` for the contract
every backend keeps. Backends: `TorchBackend` (vectorised torch, the CPU production path), `MemcpyBackend` (one
copy per block and plane, for comparison), and `ems.kernels.triton_backend.TritonBackend` (Triton kernels on
cuda/npu, the interpreter on CPU), imported lazily so that `import ems` never imports triton.

The names below are imported on first use (PEP 562), as `ems`'s own: the torch-free modules of this package
(`host_copy`: the copies and addresses a pool node's store uses) can be imported without torch, so a
pool node never loads it (tests/pool/test_pool_node.py checks).
"""

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CopyBackend": "ems.kernels.base",
    "KernelBackend": "ems.kernels.base",
    "PlaneSet": "ems.kernels.planes",
    "MemcpyBackend": "ems.kernels.memcpy_backend",
    "get_backend": "ems.kernels.select",
    "TorchBackend": "ems.kernels.torch_backend",
}

__all__ = ["CopyBackend", "KernelBackend", "MemcpyBackend", "PlaneSet", "TorchBackend", "get_backend"]

if TYPE_CHECKING:
    from ems.kernels.base import CopyBackend, KernelBackend
    from ems.kernels.memcpy_backend import MemcpyBackend
    from ems.kernels.planes import PlaneSet
    from ems.kernels.select import get_backend
    from ems.kernels.torch_backend import TorchBackend


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ems.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
