"""Receiving and sending protocol frames on a ucxx endpoint, with every received length verified.

Contract:
* `recv_header(ep)` returns the parsed header of a frame of exactly `HEADER_SIZE` bytes; `recv_meta(ep, n)` the
  `n` bytes of a meta frame; `recv_into(ep, view, canary)` fills `view` with one frame of exactly `len(view)`
  bytes (`recv_all_into` a frame into each of several views, posted at once). A frame of another length raises
  `ProtocolError` (the caller closes that connection), and a buffer that received a short frame is never handed on.
* `send_all(ep, frames)` posts every frame at once (UCX keeps their order on the endpoint) and waits for all.
* Every send and receive goes through `ucx_progress` (UCX progressed on the event loop thread).
* `recv_head(ep)` receives the head message of a request or reply (classic: a 32-byte header; inline:
  `protocol.head_layout`) and returns `(header, body)`, the body being the head's inline bytes, verified too.
* Every function takes `tag`: None for the connection's base tag, else a request id (the request's own tag).

Why this design. ucxx 0.52 completes a tagged receive of a message *shorter* than the buffer without an error and
does not report how many bytes arrived (its Python `Request` exposes no receive info; a longer message does fail,
"Message truncated"). A short frame therefore leaves the buffer's tail as it was, and a pool node receives values
into buffers recycled from other tenants' evicted values. Asking UCX for the length first (`tag_probe`) needs the
message to be there already, i.e. polling, and active messages would give up receiving into recycled buffers; so
the length is verified from the buffer itself, at the cost of writing 8 bytes before and comparing 8 bytes after
each receive (no extra pass over the data, which zero-filling every recycled buffer would cost):
* Header frames: the buffer is filled with 0xFF first. A valid header's last byte is the top byte of `data_len`,
  always 0 (`data_len` <= MAX_DATA_BYTES < 2**56), so a frame of fewer than 32 bytes leaves 0xFF there and is
  refused, whatever it contains: the check is exact.
* Meta and data frames of n >= 8 bytes: the last 8 bytes are set to a secret random canary (fresh per request,
  `new_canary()`); when they still hold it after the receive, fewer than n - 7 bytes arrived and the frame is
  refused. A genuine frame ends with the canary with probability 2**-64, and a sender cannot aim for it without
  knowing it. A frame short by 1-7 bytes is not detected, but then the bytes it did not write are the canary's,
  never what the buffer held before, so no byte of another tenant is exposed (and a value so damaged fails its
  checksum, since the sender cannot know those bytes).
* Frames under 8 bytes are zero-filled before the receive: nothing stale can remain in them.
* Head messages (up to HEAD_BYTES, of a length known only once the header is read) are received into a fresh
  buffer whose header part is 0xFF and whose rest is the canary repeated every 8 bytes. The header check above is
  exact; an inline head's length is a multiple of 8 (`head_layout`), so its last 8 bytes are the aligned canary
  when fewer than length - 7 bytes arrived (refused), and the 8 bytes after it are still the canary unless the
  message was longer than announced (refused too). The buffer is fresh, so nothing stale can be in it either way.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ems.transport import protocol, ucx_progress

CANARY_BYTES = 8
_HEADER_FILL = 0xFF


def new_canary() -> bytes:
    """A fresh secret canary for the receives of one request."""
    return os.urandom(CANARY_BYTES)


def _wrong_size(error: BaseException) -> bool:
    text = repr(error).lower()
    return "truncat" in text or "mismatch" in text


def prepare_frame(view: memoryview, canary: bytes) -> None:
    """Make `view` ready to receive one frame of exactly `view.nbytes` bytes (its length is verified after)."""
    n = view.nbytes
    if n >= CANARY_BYTES:
        view[n - CANARY_BYTES :] = canary
    else:
        view[:] = bytes(n)


def check_frame(view: memoryview, canary: bytes) -> None:
    """ProtocolError when the frame received into `view` (after `prepare_frame`) was short."""
    n = view.nbytes
    if n >= CANARY_BYTES and view[n - CANARY_BYTES :] == canary:
        raise protocol.ProtocolError(f"a frame shorter than the {n} bytes announced")


def frame_error(error: BaseException, what: str) -> BaseException:
    """The error to raise for a failed receive: ProtocolError when UCX says the message was longer than `what`."""
    if _wrong_size(error):
        return protocol.ProtocolError(f"a frame longer than {what}")
    return error


async def recv_into(ep: Any, view: memoryview, canary: bytes, tag: Any = None) -> None:
    """Receive one frame of exactly `view.nbytes` bytes into `view` (writable, format "B"); see the docstring."""
    n = view.nbytes
    if n == 0:
        return
    prepare_frame(view, canary)
    try:
        await ucx_progress.recv(ep, view, tag)
    except Exception as error:
        raise frame_error(error, f"the {n} bytes announced") from None
    check_frame(view, canary)


async def recv_all_into(
    ep: Any, views: Sequence[memoryview], canary: bytes, tag: Any = None, on_frame: Callable[[], None] | None = None
) -> None:
    """`recv_into` of one frame into each of `views`, all posted at once (no task per frame); `on_frame()` runs as
    each completes. Returns once every receive has ended; raises the first failure (ProtocolError for a frame of
    another length than its view)."""
    posted: list[tuple[memoryview, asyncio.Future]] = []
    for view in views:
        if view.nbytes == 0:
            continue
        prepare_frame(view, canary)
        future = ucx_progress.recv(ep, view, tag)
        if on_frame is not None:
            future.add_done_callback(lambda _: on_frame())
        posted.append((view, future))
    outcomes = await asyncio.gather(*(f for _, f in posted), return_exceptions=True)
    for (view, _), outcome in zip(posted, outcomes):
        if isinstance(outcome, BaseException):
            raise frame_error(outcome, f"the {view.nbytes} bytes announced") from None
        check_frame(view, canary)


def new_header_frame() -> np.ndarray:
    """A buffer for one header frame (see the module docstring)."""
    return np.full(protocol.HEADER_SIZE, _HEADER_FILL, dtype=np.uint8)


def check_header_frame(frame: np.ndarray) -> None:
    """ProtocolError when the header frame received into `frame` (from `new_header_frame`) was short."""
    if frame[-1] == _HEADER_FILL:
        raise protocol.ProtocolError(f"a frame shorter than {protocol.HEADER_SIZE} bytes where a header was expected")


async def recv_header_frame(ep: Any, tag: Any = None) -> np.ndarray:
    """The raw 32 bytes of a header frame; ProtocolError when the frame had another length."""
    frame = new_header_frame()
    try:
        await ucx_progress.recv(ep, frame, tag)
    except Exception as error:
        raise frame_error(error, f"{protocol.HEADER_SIZE} bytes where a header was expected") from None
    check_header_frame(frame)
    return frame


_HEAD_REPEAT = protocol.HEAD_BYTES // CANARY_BYTES
_HEADER_FILLED = bytes([_HEADER_FILL]) * protocol.HEADER_SIZE


def new_head_buffer() -> tuple[bytearray, bytes]:
    """A buffer for one head message and its canary (see the module docstring); a bytearray: its checks cost less
    than a numpy array's."""
    canary = new_canary()
    buf = bytearray(canary * _HEAD_REPEAT)
    buf[: protocol.HEADER_SIZE] = _HEADER_FILLED
    return buf, canary


def parse_head(buf: bytearray, canary: bytes) -> tuple[protocol.Header, memoryview]:
    """The header and inline bytes of the head received into `buf` (from `new_head_buffer`); ProtocolError when it
    had another length than its header announces."""
    if buf[protocol.HEADER_SIZE - 1] == _HEADER_FILL:
        raise protocol.ProtocolError(f"a frame shorter than {protocol.HEADER_SIZE} bytes where a header was expected")
    view = memoryview(buf)
    header = protocol.unpack_header(view[: protocol.HEADER_SIZE])
    length = protocol.head_layout(header.meta_len, header.data_len).length if header.inline else protocol.HEADER_SIZE
    if length > protocol.HEADER_SIZE and buf[length - CANARY_BYTES : length] == canary:
        raise protocol.ProtocolError(f"a head shorter than the {length} bytes announced")
    if length + CANARY_BYTES <= protocol.HEAD_BYTES and buf[length : length + CANARY_BYTES] != canary:
        raise protocol.ProtocolError(f"a head longer than the {length} bytes announced")
    return header, view[protocol.HEADER_SIZE : length]


async def recv_head(ep: Any, tag: Any = None) -> tuple[protocol.Header, memoryview]:
    """A head message: its parsed header and its inline bytes (empty for a classic header); see the docstring.
    ProtocolError when it had another length than its header announces."""
    buf, canary = new_head_buffer()
    try:
        await ucx_progress.recv(ep, buf, tag)
    except Exception as error:
        if _wrong_size(error):
            raise protocol.ProtocolError(f"a message longer than {protocol.HEAD_BYTES} bytes where a head was expected") from None
        raise
    return parse_head(buf, canary)


async def recv_meta(ep: Any, meta_len: int, tag: Any = None) -> bytes:
    """A meta frame of exactly `meta_len` bytes (checked against the protocol limit first)."""
    if meta_len > protocol.MAX_META_BYTES:
        raise protocol.ProtocolError(f"meta frame of {meta_len} bytes, limit {protocol.MAX_META_BYTES}")
    if meta_len == 0:
        return b""
    frame = bytearray(meta_len)
    await recv_into(ep, memoryview(frame), new_canary(), tag)
    return bytes(frame)


async def send_all(ep: Any, frames: list, tag: Any = None) -> None:
    """Post every frame at once (UCX keeps their order on the endpoint) and wait for all."""
    frames = [f for f in frames if len(f)]
    if len(frames) == 1:
        await ucx_progress.send(ep, frames[0], tag)
    else:
        await asyncio.gather(*(ucx_progress.send(ep, f, tag) for f in frames))
