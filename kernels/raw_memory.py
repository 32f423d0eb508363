"""Views of raw device address ranges as uint8 tensors (V0 `KvBufferWrapper` ranges).

The caller vouches for the range: it must be `nbytes` bytes of live memory on `device` for as long as the view is
used. CPU ranges are plain host memory; CUDA ranges go through `__cuda_array_interface__`.
"""

from __future__ import annotations

import numpy as np
import torch


class _CudaRange:
    """The minimal object torch.as_tensor accepts for a raw CUDA range."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class _HostRange:
    """The minimal object numpy accepts for a raw host range (constant cost: a ctypes array type per size is not)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def raw_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 `[nbytes]` tensor aliasing `nbytes` bytes at address `ptr` on `device` (no copy)."""
    if device.type == "cpu":
        return torch.from_numpy(np.asarray(_HostRange(ptr, nbytes)))
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.as_tensor(_CudaRange(ptr, nbytes), device=device)
    raise NotImplementedError(f"raw address ranges on {device.type} need the Triton backend")
