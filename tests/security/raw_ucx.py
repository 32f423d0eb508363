"""A raw UCX client for attacking a pool node: sends any frames, in any order, and reports what the node did.

Every method runs its coroutine on the process-wide UCX loop (`UcxRuntime`) and waits for it from the test thread.
Receive buffers that were still posted when a wait timed out are kept until `close()` aborts the endpoint, so UCX
never writes into freed memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
from ucx_loop import UcxRuntime

from ems.transport import metas, protocol
from ems.transport.ucx import progress as ucx_progress
from ems.transport.ucx.endpoint import create_endpoint

CLOSED = "closed"
SILENT = "silent"


def run(coro: Any, timeout_s: float = 30.0) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, UcxRuntime.get().loop).result(timeout_s)


def as_frame(data: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.view(np.uint8).reshape(-1)
    return np.frombuffer(bytes(data), dtype=np.uint8).copy()


class RawSession:
    """One raw connection to a node."""

    def __init__(self, port: int, connect_timeout_s: float = 5.0) -> None:
        self.ep = run(create_endpoint("127.0.0.1", port, connect_timeout_s))
        self._kept: list = []
        self.nonce = b""

    # ---- frames ----

    async def _send(self, frames: Sequence[Any]) -> None:
        for frame in frames:
            frame = as_frame(frame)
            if frame.size:
                self._kept.append(frame)
                await self.ep.send(frame)

    def send(self, *frames: Any, timeout_s: float = 10.0) -> str:
        """Send frames in order; "sent", or CLOSED when the node dropped the connection first."""
        try:
            run(asyncio.wait_for(self._send(frames), timeout_s), timeout_s + 5)
            return "sent"
        except Exception:  # connection reset, endpoint closed or stuck
            return CLOSED

    def post_sends(self, *frames: Any, tags: Sequence[int | None] | None = None, raw_tags: bool = False) -> None:
        """Post frames without waiting for them to be taken (the node may never receive them). `tags`: per frame,
        a request id (None: the base tag), or with `raw_tags` the 64-bit wire tag itself."""

        async def post() -> None:
            for i, frame in enumerate(frames):
                frame = as_frame(frame)
                self._kept.append(frame)
                tag = None if tags is None else tags[i]
                if raw_tags:
                    sent = asyncio.ensure_future(self.ep.send(frame, tag=tag, force_tag=True))
                else:
                    sent = asyncio.ensure_future(ucx_progress.send(self.ep, frame, tag))
                sent.add_done_callback(lambda t: t.cancelled() or t.exception())
                self._kept.append(sent)

        run(post())

    def recv_tagged(self, nbytes: int, request_id: int, timeout_s: float = 5.0) -> Any:
        """`nbytes` received on request `request_id`'s tag, or CLOSED / SILENT."""

        async def receive() -> Any:
            buf = np.zeros(nbytes, np.uint8)
            self._kept.append(buf)
            try:
                await asyncio.wait_for(asyncio.shield(ucx_progress.recv(self.ep, buf, request_id)), timeout_s)
            except asyncio.TimeoutError:
                return SILENT
            except Exception:  # the node closed the connection
                return CLOSED
            return buf

        return run(receive(), timeout_s + 10)

    @property
    def node_base_tag(self) -> int:
        """The tag the node receives this connection's heads on (the client's send tag)."""
        return int(self.ep._tags["msg_send"])

    async def _recv(self, nbytes: int, timeout_s: float) -> Any:
        buf = np.zeros(nbytes, np.uint8)
        self._kept.append(buf)
        try:
            await asyncio.wait_for(asyncio.shield(self.ep.recv(buf)), timeout_s)
        except asyncio.TimeoutError:
            return SILENT
        except Exception:  # the node closed the connection
            return CLOSED
        return buf

    def recv(self, nbytes: int, timeout_s: float = 5.0) -> Any:
        """`nbytes` received, or CLOSED / SILENT (nothing within `timeout_s`)."""
        return run(self._recv(nbytes, timeout_s), timeout_s + 10)

    def reply(self, timeout_s: float = 5.0) -> Any:
        """The node's next header (with its meta as `.meta`), or CLOSED / SILENT."""
        raw = self.recv(protocol.HEADER_SIZE, timeout_s)
        if isinstance(raw, str):
            return raw
        header = protocol.unpack_header(raw)
        meta = b""
        if header.meta_len:
            got = self.recv(header.meta_len, timeout_s)
            if isinstance(got, str):
                return got
            meta = got.tobytes()
        return Reply(header, meta)

    # ---- protocol steps ----

    def hello(self, access_id: str = "") -> Any:
        ident = access_id.encode()
        self.send(header(protocol.Op.HELLO, ident), ident)
        challenge = self.reply()
        if isinstance(challenge, Reply):
            self.nonce = challenge.meta
        return challenge

    def auth(self, mac: bytes) -> Any:
        self.send(header(protocol.Op.AUTH, mac), mac)
        return self.reply()

    def login(self, access_id: str = "", access_key: str | None = None) -> None:
        """Complete the handshake; AssertionError if the node does not accept it."""
        challenge = self.hello(access_id)
        assert isinstance(challenge, Reply) and challenge.header.op == protocol.Op.CHALLENGE, challenge
        mac = protocol.auth_mac(access_key, self.nonce, access_id) if access_key is not None else b""
        answer = self.auth(mac)
        assert isinstance(answer, Reply) and answer.header.status == protocol.Status.OK, answer

    def put_frames(self, key: bytes, announced: int, data: Sequence[bytes], end: int = 0) -> list:
        """A PUT of one value announced as `announced` bytes in one data frame ending with byte `end`, with `data` as
        the frames sent."""
        meta = metas.encode_put_meta([key], np.array([announced]), np.array([announced]), bytes([end]))
        return [header(protocol.Op.PUT, meta, count=1, data_len=announced), meta, *data]

    def get(self, keys: Sequence[bytes], timeout_s: float = 5.0) -> Any:
        """The node's values for `keys` (None where missing), or CLOSED / SILENT."""
        meta = metas.encode_keys_meta(keys)
        if self.send(header(protocol.Op.GET, meta, count=len(keys)), meta) == CLOSED:
            return CLOSED
        reply = self.reply(timeout_s)
        if not isinstance(reply, Reply):
            return reply
        if reply.header.status != protocol.Status.OK:
            return reply
        lens, _, plan, _ = metas.decode_get_reply(len(keys), reply.header.data_len, reply.meta)
        present = lens[lens >= 0]
        offsets, sizes = metas.segment_bounds(present, plan)
        segments = []
        for size in sizes.tolist():
            got = self.recv(int(size), timeout_s)
            if isinstance(got, str):
                return got
            segments.append(got.tobytes())
        out: list = [None] * len(keys)
        j = 0
        for i, n in enumerate(lens.tolist()):
            if n >= 0:
                seg, off = int(plan[j]), int(offsets[j])
                out[i] = segments[seg][off : off + n]
                j += 1
        return out

    def close(self) -> None:
        try:
            self.ep.abort(period=10**8)
        except Exception:  # already closed
            pass
        # keep the buffers a moment longer: the abort cancels their requests on the UCX loop
        kept, self._kept = self._kept, []
        run(asyncio.sleep(0.01))
        del kept

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def header(op: int, meta: bytes = b"", **fields: Any) -> np.ndarray:
    """`protocol.pack_header` of a frame carrying `meta`: its length and end byte filled in."""
    return protocol.pack_header(op, meta_len=len(meta), meta_end=protocol.end_byte(meta), **fields)


class Reply:
    def __init__(self, header: protocol.Header, meta: bytes) -> None:
        self.header = header
        self.meta = meta

    @property
    def message(self) -> str:
        return self.meta.decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"Reply({self.header}, {self.meta[:80]!r})"
