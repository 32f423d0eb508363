"""Backend selection: which `CopyBackend` serves a device.

`auto`: the vectorised torch path on CPU (Triton kernels arrive for cuda/npu with the kernels work). A forced
choice comes from `EmsConfig(kernel_backend=...)` or `EMS_KERNEL_BACKEND`.
"""

from __future__ import annotations

import functools

import torch

from ems.kernels.base import CopyBackend, KernelBackend
from ems.kernels.torch_backend import TorchBackend


@functools.lru_cache(maxsize=None)
def get_backend(device: torch.device, requested: KernelBackend = KernelBackend.AUTO) -> CopyBackend:
    """The backend for `device` (cached per device and request)."""
    return TorchBackend()
