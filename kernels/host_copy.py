"""The CPU copy path's compiled moves (`host_copy.c`), built on first use with the host's C compiler.

Contract:
* `host_copy()` is the process's `HostCopy`, or None where it cannot be had (no C compiler, a failed build,
  `EMS_HOST_COPY=off`): callers then use their numpy / torch path. The library is built once per source and
  compiler into `EMS_CACHE_DIR` (default `$XDG_CACHE_HOME/ems`, else `~/.cache/ems`), written under a temporary
  name and renamed into place, so concurrent processes (an engine and its node) never load half a file.
* `HostCopy.move_pieces` / `move_segments` / `hash_many` run one C loop over every piece, segment or value (see
  `host_copy.c` for the layouts); `verify_scatter_pieces` is a load's verify and scatter in one loop, value by
  value (each value's bytes read once, while in cache), stopping at the first value whose digest is wrong. They
  trust their arguments: the caller has validated every address and length.
* The GIL: a call that moves less than `GIL_HELD_BELOW` bytes keeps it (`ctypes.PyDLL`), a larger one releases it
  for the call (`ctypes.CDLL`). Why: beside a thread that keeps the GIL (an engine's busy Python loop) every
  release costs a wait of up to a switch interval (5 ms) to get it back, which a small move must not pay; a large
  move pays it once and lets the other threads run while it copies, where numpy or torch ops would hold the GIL
  per op and give it away between them (perf/RESULTS.md, "Which ops give the GIL away").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from ems.kernels.raw_memory import address_of

log = logging.getLogger("ems.kernels")

GIL_HELD_BELOW = 1 << 20  # bytes: below this a move keeps the GIL (well under a switch interval at memcpy speed)
_SOURCE = Path(__file__).with_name("host_copy.c")
_FLAGS = ["-O2", "-fPIC", "-shared"]
_BUILD_TIMEOUT_S = 120.0
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_SIGNATURES: dict[str, list] = {
    "ems_move_pieces": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int32],
    "ems_move_segments": [_PTR, _PTR, _I64, _I64, ctypes.c_int32],
    "ems_hash_many": [_PTR, _PTR, _PTR, _PTR, _I64],
    "ems_verify_scatter_pieces": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
}
_RETURNS_COUNT = {"ems_verify_scatter_pieces"}  # these return an int64; the others nothing


class HostCopy:
    """The loaded library: each function twice, keeping the GIL (`_held`) and releasing it (`_free`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        held, free = ctypes.PyDLL(str(path)), ctypes.CDLL(str(path))
        for library in (held, free):
            for name, argtypes in _SIGNATURES.items():
                function = getattr(library, name)
                function.argtypes = argtypes
                function.restype = _I64 if name in _RETURNS_COUNT else None
        self._held, self._free = held, free

    def _library(self, nbytes: int) -> ctypes.CDLL:
        return self._held if nbytes < GIL_HELD_BELOW else self._free

    def move_pieces(
        self,
        table: np.ndarray,
        layout: PlaneAddresses,
        flat: int,
        gather: bool,
        nbytes: int,
    ) -> None:
        """Every piece of `table` (int64 `[5, M]`, rows contiguous) of every plane of `layout`, between the planes
        and staging at address `flat`; `nbytes` is what the call moves (it decides the GIL, nothing else)."""
        if table.strides[1] != 8:
            raise ValueError("a piece table's rows must be contiguous")
        self._library(nbytes).ems_move_pieces(
            address_of(table),
            table.shape[1],
            table.strides[0] // 8,
            *layout.arguments,
            flat,
            int(gather),
        )

    def verify_scatter_pieces(
        self,
        hash_function: int,
        payload_ptrs: np.ndarray,
        payload_lens: np.ndarray,
        expected: np.ndarray,
        piece_end: np.ndarray,
        table: np.ndarray,
        layout: PlaneAddresses,
        flat: int,
    ) -> int:
        """How many values, from the first, hash to `expected` (uint64 `[V]`); each of them scattered as soon as
        it is verified (its pieces: `table` columns `piece_end[v - 1] .. piece_end[v] - 1`), nothing of the first
        that does not match or after it. payload_ptrs, payload_lens, piece_end: int64 `[V]`; table as in
        `move_pieces`. Reads and writes the payloads' bytes once each, so it keeps the GIL below `GIL_HELD_BELOW`
        like a move of as many bytes."""
        if table.strides[1] != 8:
            raise ValueError("a piece table's rows must be contiguous")
        n = payload_ptrs.size
        if not (payload_lens.size == expected.size == piece_end.size == n):
            raise ValueError("payload_ptrs, payload_lens, expected and piece_end must be [V] alike")
        nbytes = GIL_HELD_BELOW if n >= 500 else sum(payload_lens.tolist())
        verified: int = self._library(nbytes).ems_verify_scatter_pieces(
            hash_function,
            address_of(payload_ptrs),
            address_of(payload_lens),
            address_of(expected),
            address_of(piece_end),
            n,
            address_of(table),
            table.strides[0] // 8,
            *layout.arguments,
            flat,
        )
        return verified

    def move_segments(self, ptrs: np.ndarray, lengths: np.ndarray, flat: int, gather: bool, nbytes: int) -> None:
        """flat[sum(lengths[:i]) : ... + lengths[i]] to (gather: from) the bytes at ptrs[i] (int64 `[S]` each)."""
        self._library(nbytes).ems_move_segments(address_of(ptrs), address_of(lengths), ptrs.size, flat, int(gather))

    def hash_many(self, hash_function: int, ptrs: np.ndarray, lengths: np.ndarray, nbytes: int) -> np.ndarray:
        """uint64 `[N]`: `hash_function(ptrs[i], lengths[i])`, a C function `uint64_t (const void *, size_t)`."""
        out = np.empty(ptrs.size, dtype=np.uint64)
        self._library(nbytes).ems_hash_many(hash_function, address_of(ptrs), address_of(lengths), address_of(out), ptrs.size)
        return out


class PlaneAddresses:
    """A PlaneSet's per-plane numbers as int64 arrays, with their addresses (kept alive together)."""

    def __init__(self, addrs: list[int], bstr: list[int], sstr: list[int], poffs: list[int], rbytes: list[int], block_size: int):
        self.arrays = [np.array(v, dtype=np.int64) for v in (addrs, bstr, sstr, poffs, rbytes)]
        # what every piece move of host_copy.c takes after its table: plane_addr, block_stride, slot_stride,
        # plane_offset, row_bytes (addresses of the arrays above), planes, block_size
        self.arguments = (*(address_of(a) for a in self.arrays), len(addrs), block_size)


def _compiler() -> list[str]:
    configured = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(str(configured))


def _cache_dir() -> Path:
    configured = os.environ.get("EMS_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ems"


def _build() -> Path:
    """The library for this source and compiler, compiled now unless the cache already has it."""
    compiler = _compiler()
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + repr((compiler, _FLAGS)).encode()).hexdigest()[:16]
    directory = _cache_dir()
    target = directory / f"host_copy-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", dir=directory)
    os.close(fd)
    try:
        subprocess.run(
            [*compiler, *_FLAGS, "-o", partial, str(_SOURCE)],
            check=True,
            capture_output=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def host_copy() -> HostCopy | None:
    """The process's compiled moves, or None (the reason is logged once)."""
    if os.environ.get("EMS_HOST_COPY", "auto").lower() in ("0", "off", "false", "no"):
        return None
    try:
        return HostCopy(_build())
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        log.warning(
            "ems.kernels: the compiled host copy is not available (%r%s): CPU copies use torch and numpy ops",
            error,
            f": {detail.decode(errors='replace').strip()[:500]}" if detail else "",
        )
        return None
