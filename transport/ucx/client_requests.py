"""A UCX client's requests (`ucx.client.UcxNode` runs each under its rules): each request's frames sent and its
reply received on one call's `ucx.direct.Exchange`, in the inline framing (`ucx.frames`), and the handshake's
frames on a new connection.

Contract:
* `request(ex, rid, op, ...)` posts the reply's receive (on the request's own tag `rid`), the head (on the base tag)
  and the request's other frames (on `rid`) at once, then waits for the reply's head: the reply header (status OK,
  the expected op and id) and its inline bytes, or its meta frame when that did not fit inline. A node's error
  status raises `Refused` (with the node's message), a malformed or mislabelled reply `ProtocolError`; UCX's own
  errors and `WaitTimeout` propagate. `ping`, `put`, `exists` and `get` are the requests of the calls.
* `get` receives values straight into caller-provided buffers where they are given (a value alone in its segment is
  received in place, length-verified; small packed values are copied out of their segment), so a load allocates
  nothing; it posts every segment's receive at once as soon as the reply's head is in: its bytes never wait for the
  calling thread. A value of another length than its buffer is a miss.
* `build_put` cuts a PUT's values into data frames: a value big enough to be its own segment goes out part by part
  without a copy; small values are packed into one buffer per segment (`transport.metas`).
* Every frame received has its length verified (`ucx.frames`: `recv_frames`, `recv_meta`, `recv_header`).
* `handshake` proves `access_key` with HMAC-SHA256 over the node's nonce; the key never travels.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from ems.buffers import Buffer, byte_view, copy_bytes
from ems.transport import metas, protocol
from ems.transport.scratch import RECEIVE_SCRATCH
from ems.transport.ucx.direct import Exchange, WaitTimeout
from ems.transport.ucx.frames import (
    HEAD_BYTES,
    check_frame,
    check_header_frame,
    frame_error,
    head_layout,
    new_head_buffer,
    new_header_frame,
    new_meta_frame,
    pack_head,
    parse_head,
    prepare_frame,
)


class Reply(enum.Enum):
    """What a request's reply is, which decides what its timeout costs the connection (`ucx.client`)."""

    ONE_MESSAGE = "one message"  # an inline head only, its receive posted up front: a timeout keeps the connection
    FRAMES = "frames"  # may bring frames received after the head: a timeout aborts the connection


class Refused(Exception):
    """The node answered with an error status (its message is in args[0])."""


def request(
    ex: Exchange,
    rid: int,
    op: int,
    *,
    count: int = 0,
    meta: bytes = b"",
    data: Sequence[Any] = (),
    data_len: int = 0,
    flags: int = 0,
) -> tuple[protocol.Header, memoryview]:
    """Send one inline request (head on the base tag, the rest on tag `rid`) and receive its reply's head (on tag
    `rid`): the reply header (status OK, the expected op) and its inline bytes; the reply's meta frame, when it did
    not fit inline, is received too and returned in place of the inline bytes."""
    header = protocol.pack_header(
        op,
        count=count,
        meta_len=len(meta),
        data_len=data_len,
        flags=protocol.Flags.INLINE | flags,
        request_id=rid,
        meta_end=protocol.end_byte(meta),
    )
    layout = head_layout(len(meta), data_len)
    head = pack_head(header, meta, data)
    frames = ([] if layout.meta_inline else [meta]) + ([] if layout.data_inline else list(data))
    # the reply's receive, the head and the rest of the request are all posted at once (different tags, so their
    # order does not matter); the reply is awaited while the rest goes out: a node that refuses the request before
    # receiving its data (too large for its in-flight budget) answers at once, and that answer must not wait
    # behind unsent data
    buf, canary = new_head_buffer()
    reply_recv = ex.recv(buf, rid)
    sends = [ex.send(head)] + [ex.send(f, rid) for f in frames if len(f)]
    try:
        ex.wait([reply_recv])
    except WaitTimeout:
        raise
    except Exception as error:
        raise frame_error(error, f"{HEAD_BYTES} bytes where a head was expected") from None
    reply, body = parse_head(buf, canary)
    if reply.status != protocol.Status.OK:
        text = bytes(body[: reply.meta_len]) if head_layout(reply.meta_len, 0).meta_inline else b""
        raise Refused(text.decode("utf-8", "replace") or f"node answered status {reply.status}")
    if reply.op != op | protocol.REPLY or not reply.inline or reply.request_id != rid:
        raise protocol.ProtocolError(
            f"expected op {op | protocol.REPLY:#x} for request {rid}, got {reply.op:#x} ({reply.request_id})"
        )
    if not head_layout(reply.meta_len, reply.data_len).meta_inline:
        body = memoryview(recv_meta(ex, reply, rid))
    ex.wait(sends)
    return reply, body


def ping(ex: Exchange, rid: int) -> None:
    request(ex, rid, protocol.Op.PING)


def put(ex: Exchange, rid: int, meta: bytes, frames: list, data_len: int, count: int) -> list[bool]:
    reply, body = request(ex, rid, protocol.Op.PUT, count=count, meta=meta, data=frames, data_len=data_len)
    return protocol.decode_flags(count, body[: reply.meta_len])


def exists(ex: Exchange, rid: int, meta: bytes, count: int, flags: int = 0) -> list[bool]:
    reply, body = request(ex, rid, protocol.Op.EXISTS, count=count, meta=meta, flags=flags)
    return protocol.decode_flags(count, body[: reply.meta_len])


def recv_frames(ex: Exchange, views: Sequence[memoryview], ends: bytes, rid: int | None) -> None:
    """Receive one frame into each of `views` (all posted at once, one wait), each ending with the byte of `ends`
    beside it, each length-verified (ucx.frames)."""
    if len(ends) != len(views):
        raise protocol.ProtocolError(f"{len(ends)} end bytes for {len(views)} frames")
    posted = []
    for view, end in zip(views, ends):
        if view.nbytes:
            prepare_frame(view, end)
            posted.append(ex.recv(view, rid))
    try:
        ex.wait(posted)
    except WaitTimeout:
        raise
    except Exception as error:
        raise frame_error(error, "the bytes announced") from None
    for view, end in zip(views, ends):
        if view.nbytes:
            check_frame(view, end)


def get(ex: Exchange, rid: int, meta: bytes, count: int, outs: list[memoryview] | None) -> list:
    """GET: the values (`outs` None: read-only views of fresh segments), or, with `outs`, whether each value was
    placed in its caller buffer (a value of another length than its buffer counts as a miss)."""
    reply, body = request(ex, rid, protocol.Op.GET, count=count, meta=meta)
    lens, present, plan, ends = metas.decode_get_reply(count, reply.data_len, body[: reply.meta_len])
    inline = head_layout(reply.meta_len, reply.data_len).data_inline
    if outs is not None and count == 1 and not inline and 0 < int(lens[0]) == outs[0].nbytes:
        # the common 1-block load: one value, alone in its segment, received straight into its buffer
        recv_frames(ex, outs, ends, rid)
        return [True]
    present_lens = lens[present]
    offsets, sizes = metas.segment_bounds(present_lens, plan)
    fits = (  # per present value: its caller buffer has its size (none without caller buffers)
        np.zeros(0, dtype=bool)
        if outs is None
        else np.fromiter((outs[i].nbytes for i in present.tolist()), dtype=np.int64, count=present.size) == present_lens
    )
    segments: list = []
    receiving: list[memoryview] = []
    receiving_ends = bytearray()
    scratch: list[np.ndarray] = []  # reusable receive buffers, given back once their values are copied out
    seg_start = 0
    counts = np.bincount(plan, minlength=sizes.size) if plan.size else np.zeros(0, np.int64)
    first = np.cumsum(counts) - counts
    for seg, size in enumerate(sizes.tolist()):
        if inline:
            segments.append(body[reply.meta_len + seg_start : reply.meta_len + seg_start + size])
        elif outs is not None and counts[seg] == 1 and fits[first[seg]] and size:
            target = outs[int(present[first[seg]])]
            segments.append(target)  # received in place
            receiving.append(target)
            receiving_ends.append(ends[seg])
        else:
            # a packed segment (values copied out below) in a reused buffer: a fresh one faults in page by page
            array = RECEIVE_SCRATCH.take(size) if outs is not None else np.empty(size, dtype=np.uint8)
            buf = memoryview(array)
            segments.append(buf)
            receiving.append(buf)
            receiving_ends.append(ends[seg])
            if outs is not None:
                scratch.append(array)
        seg_start += size
    if receiving:
        # every segment's receive posted at once: the transfer wakes this thread once, when it ends
        recv_frames(ex, receiving, bytes(receiving_ends), rid)
    if outs is None:
        views = [s if isinstance(s, memoryview) and s.readonly else memoryview(s).toreadonly() for s in segments]
        out: list = [None] * count
        for i, seg, off, n in zip(present.tolist(), plan.tolist(), offsets.tolist(), present_lens.tolist()):
            out[i] = views[seg][off : off + n]
        return out
    placed = [False] * count
    for j, (i, seg, off, n) in enumerate(zip(present.tolist(), plan.tolist(), offsets.tolist(), present_lens.tolist())):
        if not fits[j]:
            continue
        if segments[seg] is not outs[i]:
            outs[i][:] = segments[seg][off : off + n]
        placed[i] = True
    RECEIVE_SCRATCH.give(scratch)  # only here: after a failure UCX may still write into them (kept with the request)
    return placed


def build_put(keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> tuple[bytes, list, int]:
    """The PUT meta, its data frames and their byte count: a value big enough to be its own segment goes out part by
    part without a copy; small values are packed into one buffer per segment."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    parts = [[byte_view(p) for p in parts] for parts in values]
    lens = np.fromiter((sum(p.nbytes for p in ps) for ps in parts), dtype=np.int64, count=len(parts))
    plan = metas.segment_plan(lens)
    offsets, sizes = metas.segment_bounds(lens, plan)
    frames: list = []
    frame_lens: list[int] = []
    packed = np.empty(0, dtype=np.uint8)  # replaced at each new segment, before any value is packed into it
    current = -1
    for i, seg in enumerate(plan.tolist()):
        if int(sizes[seg]) == int(lens[i]) and int(lens[i]) >= protocol.SEGMENT_BYTES:
            for p in parts[i]:
                if p.nbytes:
                    frames.append(p)
                    frame_lens.append(p.nbytes)
            continue
        if seg != current:
            current = seg
            packed = np.empty(int(sizes[seg]), dtype=np.uint8)
            if packed.size:
                frames.append(packed)
                frame_lens.append(packed.size)
        at = int(offsets[i])
        for p in parts[i]:
            copy_bytes(packed[at : at + p.nbytes], p)
            at += p.nbytes
    meta = metas.encode_put_meta(keys, lens, np.asarray(frame_lens, dtype=np.int64), protocol.end_bytes(frames))
    return meta, frames, int(lens.sum())


def handshake(ex: Exchange, address: str, access_id: str, access_key: str | None) -> None:
    """The handshake on a new connection (classic framing, on the base tag): HELLO with `access_id`, the node's
    CHALLENGE, AUTH with the HMAC of `access_key` over its nonce (empty without a key), the node's answer. `Refused`
    when the node refuses (or requires a key this client lacks), ProtocolError for a malformed frame."""
    raw_id = access_id.encode("ascii")
    hello_header = protocol.pack_header(protocol.Op.HELLO, meta_len=len(raw_id), meta_end=protocol.end_byte(raw_id))
    ex.wait([ex.send(f) for f in [hello_header] + ([raw_id] if raw_id else [])])
    challenge = recv_header(ex, protocol.Op.CHALLENGE)
    nonce = recv_meta(ex, challenge)
    if len(nonce) != protocol.NONCE_BYTES:
        raise protocol.ProtocolError("bad challenge")
    if challenge.flags & protocol.Flags.AUTH_REQUIRED and access_key is None:
        raise Refused(f"{address}: authentication failed: the node requires access_id and access_key")
    mac = protocol.auth_mac(access_key, nonce, access_id) if access_key is not None else b""
    auth_header = protocol.pack_header(protocol.Op.AUTH, meta_len=len(mac), meta_end=protocol.end_byte(mac))
    auth: list[Any] = [auth_header] + ([mac] if mac else [])
    ex.wait([ex.send(f) for f in auth])
    recv_header(ex, protocol.Op.AUTH | protocol.REPLY)


def recv_header(ex: Exchange, expected_op: int) -> protocol.Header:
    frame = new_header_frame()
    try:
        ex.wait([ex.recv(frame)])
    except WaitTimeout:
        raise
    except Exception as error:
        raise frame_error(error, f"{protocol.HEADER_SIZE} bytes where a header was expected") from None
    check_header_frame(frame)
    header = protocol.unpack_header(frame)
    if header.status != protocol.Status.OK:
        message = recv_meta(ex, header).decode("utf-8", "replace") if header.meta_len else ""
        raise Refused(message or f"node answered status {header.status}")
    if header.op != expected_op:
        raise protocol.ProtocolError(f"expected op {expected_op:#x}, got {header.op:#x}")
    return header


def recv_meta(ex: Exchange, header: protocol.Header, rid: int | None = None) -> bytes:
    """The meta frame of `header`: exactly `meta_len` bytes ending with `meta_end` (the limit checked first)."""
    frame = new_meta_frame(header)
    if frame is None:
        return b""
    recv_frames(ex, [memoryview(frame)], bytes([header.meta_end]), rid)
    return bytes(frame)
