"""Raw host memory and the compiled moves over plain buffers (`host_copy.c`, built on first use with the host's C
compiler: `ems.kernels.host_build`); the moves between a PlaneSet and staging, over the same library, are the host
backend's (`ems.kernels.host_backend`). Torch-free: a pool node's store uses it without loading torch.

Contract:
* `host_copy()` is the process's `HostCopy`, or None where it cannot be had (no C compiler, a failed build,
  `EMS_HOST_COPY=off`): callers then use their numpy / torch path (the build, once per source and compiler:
  `ems.kernels.host_build`).
* `HostCopy` is the loaded library: `for_bytes(nbytes)` gives its C functions for a move of `nbytes` (the GIL rule
  below; the host backend calls its piece moves there). `move_segments` / `hash_many` / `encode_values` /
  `copy_many` run one C loop over every segment, value or buffer (see `host_copy.c` for the layouts; `copy_many`'s
  large copies use streaming stores on x86); `chain_digests` one over the blocks of a token sequence (the token
  form's keys); `copy_hash_many` hashes each copy step by step right after copying it. They trust their arguments:
  the caller has validated every address and length (`copy_buffers` and `copy_lengths` check a batch of copies).
* The GIL: a call that moves less than `GIL_HELD_BELOW` bytes keeps it (`ctypes.PyDLL`), a larger one releases it
  for the call (`ctypes.CDLL`). Why: beside a thread that keeps the GIL (an engine's busy Python loop) every
  release costs a wait of up to a switch interval (5 ms) to get it back, which a small move must not pay; a large
  move pays it once and lets the other threads run while it copies, where numpy or torch ops would hold the GIL
  per op and give it away between them (perf/RESULTS.md, "Which ops give the GIL away").
* Raw memory, what the moves take: `address_of` a numpy array, `buffer_addresses` of buffers, `raw_tensor` (a view
  of a raw device address range as a uint8 tensor: V0 `KvBufferWrapper` ranges, a stored value's span) and
  `host_array` (a CPU tensor's memory as a numpy array of its shape and strides, without `Tensor.numpy()`, which
  gives the GIL away). The caller vouches for a range: `nbytes` bytes of live memory on `device` (CPU: plain host
  memory; CUDA: through `__cuda_array_interface__`) for as long as the view is used, a tensor kept alive while its
  array is.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ems.kernels.host_build import build_library

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ems.kernels")

GIL_HELD_BELOW = 1 << 20  # bytes: below this a move keeps the GIL (well under a switch interval at memcpy speed)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_I32 = ctypes.c_int32
_SIGNATURES: dict[str, list] = {
    "ems_move_pieces": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32],
    "ems_move_segments": [_PTR, _PTR, _I64, _I64, _I32],
    "ems_hash_many": [_PTR, _PTR, _PTR, _PTR, _I64],
    "ems_encode_values": [_PTR, _PTR, _PTR, _PTR, _I64],
    "ems_gather_encode_pieces": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "ems_verify_scatter_pieces": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "ems_copy_many": [_PTR, _PTR, _PTR, _I64, _I64, _I64],
    "ems_verify_scatter_as_placed": [_PTR, _I64, _I32, _I64, *4 * [_PTR], _I64, _PTR, _PTR, _I64, *5 * [_PTR], _I64, _I64, _I64],
    "ems_copy_hash_many": [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64],
    "ems_chain_digests": [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR],
}
_RETURNS_COUNT = {
    "ems_verify_scatter_pieces",
    "ems_copy_hash_many",
    "ems_verify_scatter_as_placed",
}  # these return an int64; the others nothing


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


class HostCopy:
    """The loaded library: each function twice, keeping the GIL (`keeping_gil`) and releasing it (`releasing_gil`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        held, free = ctypes.PyDLL(str(path)), ctypes.CDLL(str(path))
        for library in (held, free):
            for name, argtypes in _SIGNATURES.items():
                function = getattr(library, name)
                function.argtypes = argtypes
                function.restype = _I64 if name in _RETURNS_COUNT else None
        self.keeping_gil, self.releasing_gil = held, free

    def for_bytes(self, nbytes: int) -> ctypes.CDLL:
        """The functions for a move of `nbytes` bytes: keeping the GIL below `GIL_HELD_BELOW`, else releasing it."""
        return self.keeping_gil if nbytes < GIL_HELD_BELOW else self.releasing_gil

    def move_segments(self, ptrs: np.ndarray, lengths: np.ndarray, flat: int, gather: bool, nbytes: int) -> None:
        """flat[sum(lengths[:i]) : ... + lengths[i]] to (gather: from) the bytes at ptrs[i] (int64 `[S]` each)."""
        self.for_bytes(nbytes).ems_move_segments(address_of(ptrs), address_of(lengths), ptrs.size, flat, int(gather))

    def copy_many(self, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, progress: int = 0, signalled: int = 0) -> None:
        """`lengths[i]` bytes from address `src[i]` to address `dst[i]` (int64 `[N]` each, contiguous), in one call.
        `progress`: 0, or the address of a 4-byte aligned u32 outside every destination, where `i + 1` is published
        after copy i for each i < `signalled` (release order, waiters woken: `HostBackend.scatter_pieces_as_placed`)."""
        if not (dst.size == src.size == lengths.size):
            raise ValueError("dst, src and lengths must be [N] alike")
        if progress % 4 or not 0 <= signalled <= dst.size:
            raise ValueError("progress must be a 4-byte aligned address, and signalled within the batch")
        self.for_bytes(batch_bytes(lengths)).ems_copy_many(
            address_of(dst), address_of(src), address_of(lengths), dst.size, progress, signalled
        )

    def copy_hash_many(self, hasher: np.ndarray, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, skip: int) -> np.ndarray:
        """`copy_many`, and uint64 `[N]`: the XXH3-64 of each copy's bytes from `skip` on, hashed step by step right
        after each step is copied, while in cache (every `lengths[i] >= skip`). `hasher`: int64 `[5]`, the addresses
        of XXH3's createState, freeState, 64bits_reset, 64bits_update and 64bits_digest (`host_copy.c`)."""
        if not (dst.size == src.size == lengths.size):
            raise ValueError("dst, src and lengths must be [N] alike")
        if hasher.dtype != np.int64 or hasher.size != 5:
            raise ValueError("hasher must be the int64 [5] table of XXH3's streaming functions")
        if dst.size and int(lengths.min()) < skip:
            raise ValueError(f"every length must be at least skip ({skip})")
        out = np.empty(dst.size, dtype=np.uint64)
        failed = self.for_bytes(batch_bytes(lengths)).ems_copy_hash_many(
            address_of(hasher), address_of(dst), address_of(src), address_of(lengths), skip, address_of(out), dst.size
        )
        if failed:
            raise MemoryError("no memory for an XXH3 hash state")
        return out

    def encode_values(
        self, hash_function: int, heads: np.ndarray, value_addrs: np.ndarray, payload_lens: np.ndarray, nbytes: int
    ) -> None:
        """A save's encode: value v at address `value_addrs[v]` gets the header bytes `heads[v]` (uint8 `[V, 32]`:
        magic .. payload length) and then the `hash_function` digest of its payload (`payload_lens[v]` bytes after
        its 40-byte header). value_addrs, payload_lens: int64 `[V]`; `nbytes` decides the GIL."""
        n = _value_count(heads, value_addrs, payload_lens)
        self.for_bytes(nbytes).ems_encode_values(
            hash_function, address_of(heads), address_of(value_addrs), address_of(payload_lens), n
        )

    def chain_digests(self, hash_function: int, seed: bytes, tokens: np.ndarray, block: int) -> np.ndarray:
        """uint8 `[ceil(n / block), 16]`: the chained XXH3-128 digests of `tokens` (int64 `[n]`, contiguous) cut into
        blocks of `block` (the last may be shorter), digest j = `hash_function(digest j-1 + bytes of block j)`,
        digest -1 = `seed` (16 bytes), each in canonical (big-endian) form (`host_copy.c` `ems_chain_digests`).
        `hash_function`: the address of XXH3_128bits."""
        if tokens.dtype != np.int64 or tokens.ndim != 1 or not tokens.flags.c_contiguous or len(seed) != 16 or block < 1:
            raise ValueError("tokens must be int64 [n] contiguous, seed 16 bytes and block >= 1")
        out = np.empty((-(-tokens.size // block), 16), dtype=np.uint8)
        scratch = np.empty(16 + 8 * block, dtype=np.uint8)
        seed_array = np.frombuffer(seed, dtype=np.uint8)
        self.for_bytes(tokens.nbytes).ems_chain_digests(
            hash_function, address_of(seed_array), address_of(tokens), tokens.size, block, address_of(scratch), address_of(out)
        )
        return out

    def hash_many(self, hash_function: int, ptrs: np.ndarray, lengths: np.ndarray, nbytes: int) -> np.ndarray:
        """uint64 `[N]`: `hash_function(ptrs[i], lengths[i])`, a C function `uint64_t (const void *, size_t)`."""
        out = np.empty(ptrs.size, dtype=np.uint64)
        self.for_bytes(nbytes).ems_hash_many(hash_function, address_of(ptrs), address_of(lengths), address_of(out), ptrs.size)
        return out


def _value_count(heads: np.ndarray, *per_value: np.ndarray) -> int:
    """V, once every per-value array is `[V]` and `heads` (each value's header bytes before its checksum) uint8
    `[V, 32]`, contiguous: what the loops over whole values read."""
    n = per_value[0].size
    if any(array.size != n for array in per_value) or heads.shape != (n, 32) or not heads.flags.c_contiguous:
        raise ValueError("every per-value array must be [V] and heads uint8 [V, 32], contiguous")
    return n


def batch_bytes(lengths: np.ndarray) -> int:
    """The bytes of a batch (it decides the GIL): a long batch counts as large without summing it."""
    return GIL_HELD_BELOW if lengths.size >= 500 else int(lengths.sum())


def copy_lengths(dsts: Sequence[Any], srcs: Sequence[Any]) -> np.ndarray:
    """int64 `[N]`: each source's length, once every destination is checked to be a writable contiguous buffer of
    its source's length (what a batch of copies trusts; raises ValueError)."""
    if len(dsts) != len(srcs):
        raise ValueError("dsts and srcs must be as many")
    lengths = np.fromiter((memoryview(s).nbytes for s in srcs), dtype=np.int64, count=len(srcs))
    for dst, n in zip(dsts, lengths.tolist()):
        view = memoryview(dst)
        if view.readonly or view.nbytes != n or not view.c_contiguous:
            raise ValueError("every destination must be writable, contiguous and of its source's length")
    return lengths


def copy_buffers(dsts: Sequence[Any], srcs: Sequence[Any], progress: int = 0, signalled: int = 0) -> None:
    """Copy each contiguous buffer of `srcs` into the one of `dsts` beside it (same lengths, checked): one C call
    for the batch (one GIL hand-over for a large one) where the library is available, else one numpy copy each.
    `progress`, `signalled`: as `HostCopy.copy_many`'s (published only by the C call: without the library a
    reader of the progress word sees nothing until the end, and waits for the reply)."""
    lengths = copy_lengths(dsts, srcs)
    library = host_copy() if len(srcs) > 1 or progress else None
    if library is None:
        for dst, src in zip(dsts, srcs):
            np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(src, dtype=np.uint8)
        return
    # (the lists keep the buffers alive)
    library.copy_many(buffer_addresses(dsts), buffer_addresses(srcs), lengths, progress, signalled)


@functools.cache
def host_copy() -> HostCopy | None:
    """The process's compiled moves, or None (the reason is logged once)."""
    from ems.settings import host_copy_settings

    if not host_copy_settings().enabled:
        return None
    try:
        return HostCopy(build_library())
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        log.warning(
            "ems.kernels: the compiled host copy is not available (%r%s): CPU copies use torch and numpy ops",
            error,
            f": {detail.decode(errors='replace').strip()[:500]}" if detail else "",
        )
        return None
