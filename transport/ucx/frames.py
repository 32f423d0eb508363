"""The pool-node protocol on UCX (`transport.protocol` has its messages): how its frames travel (two framings, tags,
request ids, the inline head's layout: `head_layout`, `pack_head`, `pack_meta_reply`), and receiving and sending them
on a ucxx endpoint with every received length verified exactly.

Contract:
* Two framings. **Classic** (flags without INLINE; the handshake is always classic): the header, the meta and each
  data frame are separate messages on the connection's base tag, and the reply comes back the same way; a node
  serves classic requests of one connection one after the other.
  **Inline** (flags INLINE, what `UcxNode` sends): one **head** message on the base tag carries the header, then the
  meta when `head_layout` says it fits, then all the data when that fits too, zero-padded to a multiple of 8 bytes
  (HEAD_BYTES at most). Every other frame of the request travels on the request's own tag, and so does the whole
  reply, which is inline the same way. Several inline requests may be in flight on one connection; the node serves
  them concurrently (within its in-flight budget) and each reply finds its caller by its tag, so replies may come
  back in any order.
* Tags: each side of a connection receives on a 64-bit base tag it chose (exchanged when UCX connects); a request's
  own tag is that base tag with its low 32 bits XORed with `request_id` (`protocol.request_tag`), so every tag
  of one connection shares the base tag's high 32 bits. A node gives each live connection distinct high bits and
  discards every message it has not received on a connection's tags when that connection ends, as well as messages
  on tags of no connection at all, so unread messages never pile up past their connection. It does so while they
  arrive (`ucx.connections.ConnectionTable.sweep_front`), so the memory UCX takes for them (it goes back into UCX's
  buffer pools, which keep their largest size) stays bounded by what arrives between two sweeps (measured: 12,000
  frames of 4 KiB on request tags before and after the handshake and on tags of no connection, +7 to +12 MiB 10 s
  after five rounds, flat; +62 to +64 MiB when they were swept only by the watchdog). Before the handshake completes, only
  the base tag may carry messages: a message on another tag of the connection closes it; after it, a message on the
  tag of a request id not in flight, with no head waiting, closes it too (a client sends a request's head first).
* Request ids: an inline request's id is 1..MAX_REQUEST_ID (0 is the base tag) and unique among the connection's
  requests in flight. An id is in flight from its head until the node starts its reply; a client may reuse it as
  soon as it has received that reply in full (the node never refuses such a reuse). A head naming an id still in
  flight is malformed (the connection is closed).
* `recv_header(ep)` returns the parsed header of a frame of exactly `HEADER_SIZE` bytes; `recv_meta(ep, header)` the
  header's meta frame; `recv_into(ep, view, end)` fills `view` with one frame of exactly `len(view)` bytes whose
  last byte is `end` (`recv_all_into` a frame into each of several views, posted at once). A frame of another
  length raises `ProtocolError` (the caller closes that connection), and a buffer that received a short frame is
  never handed on.
* `send_all(ep, frames)` posts every frame at once (UCX keeps their order on the endpoint) and waits for all.
* Every send and receive goes through `ucx.progress` (UCX progressed on the event loop thread).
* `recv_head(ep)` receives the head message of a request or reply (classic: a 32-byte header; inline:
  `head_layout`) and returns `(header, body)`, the body being the head's inline bytes, verified too.
* Every function takes `tag`: None for the connection's base tag, else a request id (the request's own tag).

Why this design. ucxx 0.52 completes a tagged receive of a message *shorter* than the buffer without an error and
does not report how many bytes arrived (its Python `Request` exposes no receive info, and its C++ request drops
UCX's); a longer message does fail ("Message truncated"). A short frame therefore leaves the buffer's tail as it
was, and a pool node receives values into buffers recycled from other tenants' evicted values. So the protocol
states every frame's last byte before the frame arrives (protocol docstring, "end bytes"), and the receiver sets
that byte of its buffer to another value first: a frame short by any number of bytes never writes its last byte,
so it is refused every time, whatever it contains. One byte written before and one compared after each receive: no
pass over the data (which zero-filling every recycled buffer would cost), zero-copy receives included.
* Header frames: the buffer is filled with 0xFF; a valid header's last byte is data_len's top byte, always 0.
* Meta and data frames: the byte stated (`meta_end` in the header; `frame_ends` / `segment_ends` in the meta),
  XOR 0xFF, is written to the buffer's last byte first.
* Heads (up to HEAD_BYTES, of a length known only once the header is read) are received into a fresh buffer whose
  header part is 0xFF and whose rest is a secret random canary repeated every 8 bytes, its every eighth byte 0xFF.
  An inline head's length is a multiple of 8 ending with HEAD_END (0), so a short head leaves 0xFF there and is
  refused (exact). A head *longer* than its header announces, within HEAD_BYTES, is refused when the 8 bytes after
  the announced length no longer hold the canary: its extra bytes are never read, and a sender that does not know
  the canary passes that check only by writing exactly its bytes (2**-8 per extra byte, up to 8). Longer than
  HEAD_BYTES, UCX refuses it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import numpy as np

from ems.transport import protocol
from ems.transport.ucx import progress as ucx_progress

HEAD_BYTES = 8 << 10  # the largest head message of the inline framing (header + meta + small data + padding)
HEAD_END = 0  # the last byte of every inline head (its last pad byte)
CANARY_BYTES = 8
_INLINE = int(protocol.Flags.INLINE)  # (a plain int on the per-request path)
_HEADER_FILL = 0xFF


class HeadLayout(NamedTuple):
    """Where the parts of an inline request or reply travel: in the head message or as frames of their own."""

    meta_inline: bool
    data_inline: bool
    length: int  # bytes of the head message (a multiple of 8)


def head_layout(meta_len: int, data_len: int) -> HeadLayout:
    """The head of an inline message (both sides compute the same): the meta goes inline when it fits in
    HEAD_BYTES, the data too when meta and data together fit; the head is then zero-padded to a multiple of 8 bytes
    with at least one pad byte, so its last byte is always HEAD_END (the receiver's length check,
    `ucx.frames.parse_head`)."""
    room = HEAD_BYTES - protocol.HEADER_SIZE - 1
    meta_inline = meta_len <= room
    data_inline = meta_inline and meta_len + data_len <= room
    body = (meta_len if meta_inline else 0) + (data_len if data_inline else 0)
    return HeadLayout(meta_inline, data_inline, protocol.HEADER_SIZE + ((body + 8) & ~7))


def pack_head(header: np.ndarray, meta: bytes | memoryview, data: Sequence[protocol.Buffer_] = ()) -> np.ndarray:
    """An inline head: `header` (from `pack_header`, with flags INLINE), then `meta` and `data` where
    `head_layout` puts them inline (the caller sends the rest as frames of their own), zero-padded."""
    raw = memoryview(cast(Any, header)).cast("B")
    fields = protocol.HEADER_STRUCT.unpack_from(raw)
    layout = head_layout(fields[7], fields[9])
    head = bytearray(layout.length)
    head[: protocol.HEADER_SIZE] = raw
    at = protocol.HEADER_SIZE
    if layout.meta_inline and len(meta):
        head[at : at + len(meta)] = meta
        at += len(meta)
    if layout.data_inline:
        for part in data:
            view = memoryview(part).cast("B")
            head[at : at + view.nbytes] = view
            at += view.nbytes
    return np.frombuffer(head, dtype=np.uint8)


def pack_meta_reply(op: int, request_id: int, meta: bytes = b"", count: int = 0) -> bytearray:
    """An inline reply (status OK) that carries only `meta`, in its head: the same bytes as `pack_head` of its
    header, without building the header twice (the reply of an EXISTS or PING). ValueError when `meta` does not fit."""
    layout = head_layout(len(meta), 0)
    if not layout.meta_inline:
        raise ValueError(f"a reply meta of {len(meta)} bytes does not fit in a head")
    head = bytearray(layout.length)
    protocol.HEADER_STRUCT.pack_into(
        head,
        0,
        protocol.MAGIC,
        protocol.VERSION,
        op | protocol.REPLY,
        0,
        _INLINE,
        protocol.end_byte(meta),
        count,
        len(meta),
        request_id,
        0,
    )
    head[protocol.HEADER_SIZE : protocol.HEADER_SIZE + len(meta)] = meta
    return head


def _wrong_size(error: BaseException) -> bool:
    text = repr(error).lower()
    return "truncat" in text or "mismatch" in text


def prepare_frame(view: memoryview, end: int) -> None:
    """Make `view` ready to receive one frame of exactly `view.nbytes` bytes whose last byte is `end`."""
    view[view.nbytes - 1] = end ^ 0xFF


def check_frame(view: memoryview, end: int) -> None:
    """ProtocolError when the frame received into `view` (after `prepare_frame`) was short."""
    if view[view.nbytes - 1] != end:
        raise protocol.ProtocolError(f"a frame shorter than the {view.nbytes} bytes announced (or not ending as stated)")


def frame_error(error: BaseException, what: str) -> BaseException:
    """The error to raise for a failed receive: ProtocolError when UCX says the message was longer than `what`."""
    if _wrong_size(error):
        return protocol.ProtocolError(f"a frame longer than {what}")
    return error


async def recv_into(ep: Any, view: memoryview, end: int, tag: Any = None) -> None:
    """Receive one frame of exactly `view.nbytes` bytes, ending with byte `end`, into `view` (writable, format "B")."""
    n = view.nbytes
    if n == 0:
        return
    prepare_frame(view, end)
    try:
        await ucx_progress.recv(ep, view, tag)
    except Exception as error:
        raise frame_error(error, f"the {n} bytes announced") from None
    check_frame(view, end)


async def recv_all_into(
    ep: Any, views: Sequence[memoryview], ends: bytes, tag: Any = None, on_frame: Callable[[], None] | None = None
) -> None:
    """`recv_into` of one frame into each of `views` (ending with the byte of `ends` beside it), all posted at once
    (no task per frame); `on_frame()` runs as each completes. Returns once every receive has ended; raises the first
    failure (ProtocolError for a frame of another length than its view)."""
    if len(ends) != len(views):
        raise protocol.ProtocolError(f"{len(ends)} end bytes for {len(views)} frames")
    posted: list[tuple[memoryview, int, asyncio.Future]] = []
    for view, end in zip(views, ends):
        if view.nbytes == 0:
            continue
        prepare_frame(view, end)
        future = ucx_progress.recv(ep, view, tag)
        if on_frame is not None:
            future.add_done_callback(lambda _: on_frame())
        posted.append((view, end, future))
    outcomes = await asyncio.gather(*(f for _, _, f in posted), return_exceptions=True)
    for (view, end, _), outcome in zip(posted, outcomes):
        if isinstance(outcome, BaseException):
            raise frame_error(outcome, f"the {view.nbytes} bytes announced") from None
        check_frame(view, end)


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


_HEAD_REPEAT = HEAD_BYTES // CANARY_BYTES
_HEADER_FILLED = bytes([_HEADER_FILL]) * protocol.HEADER_SIZE
if HEAD_END == _HEADER_FILL:
    raise ImportError("a head's end byte must differ from the fill of its receive buffer")


def new_head_buffer() -> tuple[bytearray, bytes]:
    """A buffer for one head message and its canary (see the module docstring); a bytearray: its checks cost less
    than a numpy array's."""
    canary = os.urandom(CANARY_BYTES - 1) + bytes([_HEADER_FILL])  # every 8th byte 0xFF: never a head's end byte
    buf = bytearray(canary * _HEAD_REPEAT)
    buf[: protocol.HEADER_SIZE] = _HEADER_FILLED
    return buf, canary


def parse_head(buf: bytearray, canary: bytes) -> tuple[protocol.Header, memoryview]:
    """The header and inline bytes of the head received into `buf` (from `new_head_buffer`); ProtocolError when it
    had another length than its header announces."""
    if buf[protocol.HEADER_SIZE - 1] == _HEADER_FILL:
        raise protocol.ProtocolError(f"a frame shorter than {protocol.HEADER_SIZE} bytes where a head was expected")
    view = memoryview(buf)
    header = protocol.unpack_header(view[: protocol.HEADER_SIZE])
    layout = head_layout(header.meta_len, header.data_len) if header.inline else None
    length = protocol.HEADER_SIZE if layout is None else layout.length
    if layout is not None and buf[length - 1] != HEAD_END:
        raise protocol.ProtocolError(f"a head shorter than the {length} bytes announced (or not ending as stated)")
    if length + CANARY_BYTES <= HEAD_BYTES and buf[length : length + CANARY_BYTES] != canary:
        raise protocol.ProtocolError(f"a head longer than the {length} bytes announced")
    body = view[protocol.HEADER_SIZE : length]
    if layout is not None and layout.meta_inline:
        protocol.check_meta_end(header, body[: header.meta_len])
    return header, body


_REQUEST_ID_AT = protocol.HEADER_DTYPE.fields["request_id"][1]  # type: ignore[index]  # (a structured dtype has fields)


def head_request_id(buf: bytearray) -> int | None:
    """The request id in the header of a head received into `buf` (from `new_head_buffer`), or None while nothing
    has arrived there (the fill is still in the header's last byte, a received header's is 0)."""
    if buf[protocol.HEADER_SIZE - 1] == _HEADER_FILL:
        return None
    return int.from_bytes(buf[_REQUEST_ID_AT : _REQUEST_ID_AT + 4], "little")


async def recv_head(
    ep: Any, tag: Any = None, buffer: tuple[bytearray, bytes] | None = None
) -> tuple[protocol.Header, memoryview]:
    """A head message: its parsed header and its inline bytes (empty for a classic header); see the docstring.
    ProtocolError when it had another length than its header announces. `buffer`: the one to receive it into (from
    `new_head_buffer`), when the caller looks at it meanwhile."""
    buf, canary = new_head_buffer() if buffer is None else buffer
    try:
        await ucx_progress.recv(ep, buf, tag)
    except Exception as error:
        if _wrong_size(error):
            raise protocol.ProtocolError(f"a message longer than {HEAD_BYTES} bytes where a head was expected") from None
        raise
    return parse_head(buf, canary)


def new_meta_frame(header: protocol.Header) -> bytearray | None:
    """A buffer for the meta frame of `header` (None: it has none); ProtocolError past the protocol's limit."""
    if header.meta_len > protocol.MAX_META_BYTES:
        raise protocol.ProtocolError(f"meta frame of {header.meta_len} bytes, limit {protocol.MAX_META_BYTES}")
    return bytearray(header.meta_len) if header.meta_len else None


async def recv_meta(ep: Any, header: protocol.Header, tag: Any = None) -> bytes:
    """The meta frame of `header`: exactly `meta_len` bytes ending with `meta_end` (the limit checked first)."""
    frame = new_meta_frame(header)
    if frame is None:
        return b""
    await recv_into(ep, memoryview(frame), header.meta_end, tag)
    return bytes(frame)


async def send_all(ep: Any, frames: list, tag: Any = None) -> None:
    """Post every frame at once (UCX keeps their order on the endpoint) and wait for all."""
    frames = [f for f in frames if len(f)]
    if len(frames) == 1:
        await ucx_progress.send(ep, frames[0], tag)
    else:
        await asyncio.gather(*(ucx_progress.send(ep, f, tag) for f in frames))
