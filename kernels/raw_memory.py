"""Views of raw device address ranges as uint8 tensors (V0 `KvBufferWrapper` ranges), and CPU tensors as numpy
arrays without `Tensor.numpy()`.

The caller vouches for the range: it must be `nbytes` bytes of live memory on `device` for as long as the view is
used. CPU ranges are plain host memory; CUDA ranges go through `__cuda_array_interface__`. `host_array(t)` is the
memory of the CPU tensor `t` (which the caller keeps alive while the array is used) as a numpy array of its shape
and strides: `Tensor.numpy()` gives the GIL away, which beside a busy Python thread may cost a switch interval
(perf/RESULTS.md, "Which ops give the GIL away").
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
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

    def __init__(self, ptr: int, shape: tuple, typestr: str = "|u1", strides: tuple | None = None) -> None:
        self.__array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


@functools.cache
def _typestr() -> dict[Any, str]:
    """numpy's type string of each tensor dtype `host_array` views (built on first use: `address_of` and
    `buffer_addresses` serve a pool node's store, which never imports torch)."""
    import torch

    return {torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8"}


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """The CPU tensor's memory as a numpy array of its shape and strides (byte and int dtypes); see the docstring."""
    typestr = _typestr().get(tensor.dtype)
    if typestr is None or tensor.device.type != "cpu":
        raise ValueError(f"host_array takes a CPU tensor of a byte or int dtype, got {tensor.dtype} on {tensor.device}")
    shape = tuple(tensor.shape)
    if 0 in shape:  # nothing to alias (its address may be 0, which numpy before 2.4 refuses)
        return np.empty(shape, dtype=np.dtype(typestr))
    if tensor.is_contiguous():  # numpy's default strides (the common case: a staging buffer, a stored value)
        return np.asarray(_HostRange(tensor.data_ptr(), shape, typestr))
    size = tensor.element_size()
    strides = tuple(s * size for s in tensor.stride())
    return np.asarray(_HostRange(tensor.data_ptr(), shape, typestr, strides))


def address_of(array: np.ndarray) -> int:
    """The address of a numpy array's first element. A ctypes view of a writable one is about 3x cheaper than
    `ndarray.ctypes.data` (a small call reads a few)."""
    if array.flags.writeable and array.flags.c_contiguous and array.size:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    return int(array.ctypes.data)


def buffer_addresses(values: Sequence[Any]) -> np.ndarray:
    """int64 `[n]`: the address of each contiguous buffer's first byte (numpy arrays, memoryviews of whole ones, or
    anything numpy can view as bytes)."""
    addresses = []
    for value in values:
        owner = value.obj if isinstance(value, memoryview) else value
        if isinstance(owner, np.ndarray) and owner.nbytes == len(value):
            addresses.append(address_of(owner))
        else:
            addresses.append(address_of(np.frombuffer(value, dtype=np.uint8)))
    return np.array(addresses, dtype=np.int64)


def raw_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 `[nbytes]` tensor aliasing `nbytes` bytes at address `ptr` on `device` (no copy)."""
    import torch

    if device.type == "cpu":
        return torch.from_numpy(np.asarray(_HostRange(ptr, (nbytes,))))
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.as_tensor(_CudaRange(ptr, nbytes), device=device)
    raise NotImplementedError(f"raw address ranges on {device.type} need the Triton backend")
