"""Bytes-like types shared by the client side (`ems/`) and the transport (`ems.transport`): one definition that
both import.

A leaf module: it imports nothing of `ems`, so the transport can use it without importing the store or any other
client module (tests/transport/test_layering.py checks the transport's imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import numpy as np

#: bytes-like values as they cross a transport and live in the pool: stored values, their parts, callers' receive
#: buffers (numpy arrays included: the store keeps values in them)
Buffer = Union[bytes, bytearray, memoryview, "np.ndarray"]


def copy_bytes(dst: Any, src: Any) -> None:
    """Copy the bytes of `src` into `dst` (writable, same length), holding the GIL: a memoryview copy. numpy's copy
    of a large array releases the GIL, and beside a busy Python thread each such copy then waits up to the
    interpreter's switch interval to get it back (perf/RESULTS.md, "Issue 16: the client's progress model")."""
    memoryview(dst).cast("B")[:] = memoryview(src).cast("B")
