"""One request's channel on a pool node's UCX connection (`transport.ucx.server`): where its frames are received and
its reply sent; the `transport.handler.RequestChannel` the handlers see.

Contract:
* A classic request travels on its connection's base tag, in order; an inline one on its own tag (its request id),
  concurrently with others (protocol docstring, "Tags"). Its id is in flight (`Connection.receiving`) from its head
  until its reply starts or its receives have ended (`done_receiving`).
* Every frame of a request, in either direction, must complete within `stall_timeout_s` of the previous one: each
  completed frame sets the request's deadline (`Connection.requests`, which the watchdog reads) again.
* Every received frame has its length verified (`transport.ucx.frames`); a failed receive aborts the connection and
  returns only once every receive of the request has ended (so its buffers can be recycled).
* Replies go out inline on the request's tag (the data in the head when it fits, else frames) or classic on the
  base tag, the data in windows of SEND_WINDOW_BYTES (UCX holds per-send state for each posted frame).
* Runs on the node's event loop only (no lock).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from ems.transport import protocol
from ems.transport.ucx.connections import Connection, abort
from ems.transport.ucx.frames import head_layout, pack_head, recv_all_into, recv_meta, send_all

T = TypeVar("T")  # what an awaited frame step gives

# a GET reply's data frames are posted this many bytes at a time (UCX holds per-send state for each posted frame)
SEND_WINDOW_BYTES = 32 << 20


class Channel:
    """Where one request's frames and reply travel: classic (base tag, in order) or inline (its own tag); the
    `transport.handler.RequestChannel` the handlers see."""

    __slots__ = ("body", "conn", "header", "key", "stall_s", "tag")

    def __init__(self, conn: Connection, header: protocol.Header, body: memoryview, key: int, stall_s: float) -> None:
        self.conn = conn
        self.header = header
        self.body = body  # the head's inline bytes
        self.tag = header.request_id if header.inline else None
        self.key = key
        self.stall_s = stall_s

    def done_receiving(self) -> None:
        """Every receive of this request has ended: its id is free for the client to reuse (protocol docstring)."""
        if self.tag is not None:
            self.conn.receiving.discard(self.tag)

    async def timed(self, step: Awaitable[T]) -> T:
        """One frame: when it completes, the next frame of this request has `stall_timeout_s` again."""
        result = await step
        self.conn.requests[self.key] = time.monotonic() + self.stall_s
        return result

    async def receive_frames(self, views: Sequence[memoryview], ends: bytes) -> None:
        """Receive the request's data frames into `views` (each ending with the byte of `ends` beside it), lengths
        verified; once every receive has ended (each frame that arrives gives the next `stall_timeout_s` again). On a
        failure the connection is aborted and the first error raised."""
        try:
            await recv_all_into(self.conn.ep, views, ends, self.tag, self._frame_done)
        except BaseException:
            if not self.conn.aborted:
                self.conn.aborted = True
                abort(self.conn.ep)
            raise

    def _frame_done(self) -> None:
        self.conn.requests[self.key] = time.monotonic() + self.stall_s

    async def meta(self) -> bytes:
        h = self.header
        if h.inline and head_layout(h.meta_len, h.data_len).meta_inline:
            return bytes(self.body[: h.meta_len])
        return await self.timed(recv_meta(self.conn.ep, h, self.tag))

    def inline_data(self) -> memoryview | None:
        """The request's data when it came inline in the head, else None (it comes as frames)."""
        h = self.header
        if h.inline and head_layout(h.meta_len, h.data_len).data_inline:
            return self.body[h.meta_len : h.meta_len + h.data_len]
        return None

    async def reply(
        self,
        op: int,
        *,
        count: int = 0,
        meta: bytes = b"",
        data: Sequence[Any] = (),
        data_len: int = 0,
        status: protocol.Status = protocol.Status.OK,
    ) -> None:
        """Send the reply: inline on the request's tag (the data in the head when it fits, else frames in windows
        of SEND_WINDOW_BYTES), or classic on the base tag."""
        ep = self.conn.ep
        inline = self.header.inline
        self.done_receiving()
        header = protocol.pack_header(
            op | protocol.REPLY,
            count=count,
            meta_len=len(meta),
            data_len=data_len,
            status=status,
            flags=protocol.Flags.INLINE if inline else 0,
            request_id=self.header.request_id,
            meta_end=protocol.end_byte(meta),
        )
        windows = send_windows(list(data), SEND_WINDOW_BYTES)
        if inline:
            layout = head_layout(len(meta), data_len)
            head = pack_head(header, meta, data)
            first = [head] if layout.meta_inline else [head, meta]
            if layout.data_inline:
                windows = []
            elif windows:  # the head goes out with the first window of data (one wait less)
                first += windows.pop(0)
            await self.timed(send_all(ep, first, self.tag))
        else:
            await self.timed(send_all(ep, [header, meta]))
        for window in windows:
            await self.timed(send_all(ep, window, self.tag))


def send_windows(frames: list, window_bytes: int) -> list[list]:
    """Consecutive groups of `frames` of at most `window_bytes` each (a larger frame alone)."""
    groups: list[list] = []
    current: list = []
    size = 0
    for frame in frames:
        nbytes = memoryview(frame).nbytes
        if current and size + nbytes > window_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(frame)
        size += nbytes
    if current:
        groups.append(current)
    return groups
