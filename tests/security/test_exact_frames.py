"""Issue 42: every frame's length is verified exactly, on both sides of the wire, whatever a short frame contains.

A raw client (`raw_ucx`) sends each kind of frame a request can have, of every op, cut short by every length from 1
byte to all but one of its bytes (frames of a few kilobytes: every cut up to 48 bytes and a stride through the rest),
each on a fresh connection, and expects the node to close that connection every time: no probability involved,
since a short frame never writes its last byte, which the protocol states before the frame arrives. A scripted node
does the same to the client (`UcxNode`), which must fail every such call. Then every op with every flag bit: a flag
the op does not define closes the connection, one it defines is served.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pool_testlib import client_of_scripted_node, joined, make_values
from raw_ucx import CLOSED, RawSession, Reply, header

from ems.transport import metas, protocol
from ems.transport.base import TransportError
from ems.transport.exists_holds import Hold, encode_exists_meta
from ems.transport.shm import wire
from ems.transport.shm.client import encode_ranged
from ems.transport.ucx import frames as ucx_frames
from ems.transport.ucx.frames import recv_head, recv_header_frame, recv_meta, send_all

pytestmark = pytest.mark.slow
INLINE = protocol.Flags.INLINE
PARALLEL = 8  # raw connections tried at once


def cuts(n: int) -> list[int]:
    """How many bytes to cut off a frame of `n` bytes: every cut up to 48, then a stride through the rest (and n - 1,
    the frame of one byte)."""
    small = list(range(1, min(n, 49)))
    return sorted(set(small + list(range(49, n, 211)) + [n - 1])) if n > 1 else []


def _head(op: int, request_id: int, meta: bytes = b"", data: bytes = b"", count: int = 1, flags: int = 0) -> np.ndarray:
    """An inline head announcing `data` (which it carries where `ucx_frames.head_layout` puts it inline)."""
    h = header(op, meta, count=count, data_len=len(data), flags=INLINE | flags, request_id=request_id)
    return ucx_frames.pack_head(h, meta, [data] if data else [])


def _put(keys: list[bytes], values: list[bytes], inline: bool, request_id: int = 5) -> list[tuple[np.ndarray, int | None]]:
    """A PUT's frames as (frame, tag): one data frame per value (values under SEGMENT_BYTES each, one segment)."""
    lens = np.array([len(v) for v in values])
    packed = b"".join(values)
    meta = metas.encode_put_meta(keys, lens, np.array([len(packed)]), protocol.end_bytes([packed]))
    if not inline:
        h = header(protocol.Op.PUT, meta, count=len(keys), data_len=len(packed))
        return [(h, None), (np.frombuffer(meta, np.uint8), None), (np.frombuffer(packed, np.uint8), None)]
    layout = ucx_frames.head_layout(len(meta), len(packed))
    frames: list[tuple[np.ndarray, int | None]] = [(_head(protocol.Op.PUT, request_id, meta, packed, count=len(keys)), None)]
    if not layout.meta_inline:
        frames.append((np.frombuffer(meta, np.uint8), request_id))
    if not layout.data_inline:
        frames.append((np.frombuffer(packed, np.uint8), request_id))
    return frames


def _classic(op: int, meta: bytes, count: int = 1) -> list[tuple[np.ndarray, int | None]]:
    return [(header(op, meta, count=count), None), (np.frombuffer(meta, np.uint8), None)]


VALUE = joined(make_values(1, 60, seed=4)[0])  # 100 bytes, a well-formed value
BIG_VALUE = joined(make_values(1, 9_000, seed=5)[0])  # its data frame travels after the head
BIG_KEYS = [bytes([65 + i]) * 4000 for i in range(3)]  # their meta travels after the head
LEASE = encode_exists_meta(metas.encode_keys_meta([b"k1", b"k22"]), Hold.lease(500))

# frame kind -> (log in first, the request's frames as (frame, tag), which frame is cut)
KINDS: dict[str, tuple[bool, list[tuple[np.ndarray, int | None]], int]] = {
    "hello-header": (False, _classic(protocol.Op.HELLO, b"tenant-abc", count=0), 0),
    "hello-meta": (False, _classic(protocol.Op.HELLO, b"tenant-abc", count=0), 1),
    "classic-ping-header": (True, [(header(protocol.Op.PING), None)], 0),
    "classic-get-meta": (True, _classic(protocol.Op.GET, metas.encode_keys_meta([b"key-1", b"key-22"]), 2), 1),
    "classic-exists-meta": (True, _classic(protocol.Op.EXISTS, metas.encode_keys_meta([b"key-3"])), 1),
    "classic-put-meta": (True, _put([b"v"], [VALUE], inline=False), 1),
    "classic-put-data": (True, _put([b"v"], [VALUE], inline=False), 2),
    "ping-head": (True, [(_head(protocol.Op.PING, 3, count=0), None)], 0),
    "exists-lease-head": (True, [(_head(protocol.Op.EXISTS, 4, LEASE, count=2, flags=protocol.Flags.LEASE), None)], 0),
    "get-head": (True, [(_head(protocol.Op.GET, 6, metas.encode_keys_meta([b"key-1"])), None)], 0),
    "put-head-with-data": (True, _put([b"v"], [VALUE], inline=True), 0),
    "put-data-frame": (True, _put([b"w"], [BIG_VALUE], inline=True), 1),
    "put-meta-frame": (True, _put(BIG_KEYS, [VALUE] * 3, inline=True), 1),
    "get-meta-frame": (True, [(_head(protocol.Op.GET, 8, count=3), None)], 0),  # replaced below
    "shm-open-head": (True, [(_head(protocol.Op.SHM_OPEN, 9, wire.encode_open(0, 1), count=0), None)], 0),
}
_get_meta = metas.encode_keys_meta(BIG_KEYS)
KINDS["get-meta-frame"] = (
    True,
    [(_head(protocol.Op.GET, 8, _get_meta, count=3), None), (np.frombuffer(_get_meta, np.uint8), 8)],
    1,
)
CASES = [(kind, cut) for kind, (_, frames, at) in KINDS.items() for cut in cuts(frames[at][0].size)]


def _attempt(port: int, kind: str, cut: int) -> str:
    """One try: the frames of `kind`, the one to cut `cut` bytes short; what the node did."""
    login, frames, at = KINDS[kind]
    with RawSession(port) as raw:
        if login:
            raw.login()
        sent = [(f if i != at else f[: f.size - cut], tag) for i, (f, tag) in enumerate(frames[: at + 1])]
        raw.post_sends(*[f for f, _ in sent], tags=[t for _, t in sent])
        outcome = raw.recv(ucx_frames.HEAD_BYTES, timeout_s=3.0)
    return outcome if isinstance(outcome, str) else f"answered {bytes(outcome[:32]).hex()}"


def test_every_frame_kind_is_whole_when_not_cut(shared_node):
    """The frames of each kind, whole, are served (so each refusal below is the cut's doing)."""
    for kind, (_login, frames, _) in KINDS.items():
        if kind.startswith("hello"):
            continue  # (a whole handshake: every login below)
        with RawSession(shared_node.port) as raw:
            raw.login()
            raw.post_sends(*[f for f, _ in frames], tags=[t for _, t in frames])
            request_id = frames[0][0][20:24].view("<u4")[0] if frames[0][0].size > 32 else 0
            got = raw.recv_tagged(ucx_frames.HEAD_BYTES, int(request_id), timeout_s=5.0) if request_id else raw.reply()
            assert not isinstance(got, str), (kind, got)
            answer = got.header if isinstance(got, Reply) else protocol.unpack_header(got[:32])
            assert answer.status == protocol.Status.OK or kind == "shm-open-head", (kind, answer)


def test_every_short_frame_of_every_kind_is_refused(shared_node, node_clients):
    """Every cut of every frame kind: the node closes the connection, every time."""
    with ThreadPoolExecutor(PARALLEL) as pool:
        outcomes = list(pool.map(lambda case: _attempt(shared_node.port, *case), CASES))
    served = [(kind, cut, got) for (kind, cut), got in zip(CASES, outcomes) if got != CLOSED]
    assert not served, f"{len(served)} of {len(CASES)} short frames not refused: {served[:10]}"
    assert len(CASES) > 600
    assert node_clients(shared_node.address).ping(2.0)


# ---- the client's side: a scripted node that cuts one frame of its answers ----


class _Script:
    """What the scripted node cuts in each connection's answers: (frame kind, cut), one per connection."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.plan: list[tuple[str, int]] = []

    def next(self) -> tuple[str, int]:
        with self.lock:
            return self.plan.pop(0)


REPLY_VALUE = joined(make_values(1, 9_000, seed=6)[0])  # a GET reply whose value travels as a frame of its own
CLIENT_KINDS = {"challenge-header": 32, "challenge-meta": protocol.NONCE_BYTES, "auth-header": 32}
CLIENT_KINDS |= {"ping-reply-head": ucx_frames.head_layout(0, 0).length}
CLIENT_KINDS |= {"get-reply-data": len(REPLY_VALUE), "get-reply-meta": 8 * 1100}


def _scripted(script: _Script) -> Callable:
    async def serve(ep) -> None:
        kind, cut = script.next()

        def cut_if(name: str, frame: np.ndarray) -> np.ndarray:
            return frame[: frame.size - cut] if name == kind else frame

        try:
            hello = protocol.unpack_header(await recv_header_frame(ep))
            await recv_meta(ep, hello)
            nonce = np.frombuffer(bytes(range(protocol.NONCE_BYTES)), np.uint8)
            challenge = header(protocol.Op.CHALLENGE, nonce.tobytes())
            await send_all(ep, [cut_if("challenge-header", challenge), cut_if("challenge-meta", nonce)])
            auth = protocol.unpack_header(await recv_header_frame(ep))
            await recv_meta(ep, auth)
            await send_all(ep, [cut_if("auth-header", protocol.pack_header(protocol.Op.AUTH | protocol.REPLY))])
            request, _body = await recv_head(ep)
            rid = request.request_id
            if not ucx_frames.head_layout(request.meta_len, request.data_len).meta_inline:
                await recv_meta(ep, request, rid)
            if request.op == protocol.Op.PING:
                reply = np.frombuffer(ucx_frames.pack_meta_reply(protocol.Op.PING, rid), np.uint8)
                await send_all(ep, [cut_if("ping-reply-head", reply)], rid)
            elif request.count == 1:  # GET of one key: its value in a frame after the head
                value = np.frombuffer(REPLY_VALUE, np.uint8)
                meta = metas.encode_get_reply(np.array([value.size]), [value])
                h = header(protocol.Op.GET | protocol.REPLY, meta, count=1, data_len=value.size, flags=INLINE, request_id=rid)
                await send_all(ep, [ucx_frames.pack_head(h, meta), cut_if("get-reply-data", value)], rid)
            else:  # GET of 1,100 keys, all misses: the reply meta travels after the head
                meta = metas.encode_get_reply(np.full(request.count, -1), [])
                h = header(protocol.Op.GET | protocol.REPLY, meta, count=request.count, flags=INLINE, request_id=rid)
                await send_all(ep, [ucx_frames.pack_head(h, meta), cut_if("get-reply-meta", np.frombuffer(meta, np.uint8))], rid)
            await asyncio.wait_for(ep.recv(np.empty(1, np.uint8)), 3.0)  # until the client leaves
        except Exception:  # the client hung up
            pass

    return serve


def _client_call(node, kind: str) -> object:
    if kind.startswith("get-reply-meta"):
        return node.get([b"m%d" % i for i in range(1100)], 5.0)
    if kind.startswith("get-reply"):
        return node.get([b"k"], 5.0)
    return node.ping(5.0) or "ping failed"


def test_the_client_refuses_every_short_frame_of_every_kind():
    from ems.transport.ucx.client import UcxNode

    script = _Script()
    cases = [(kind, cut) for kind, n in CLIENT_KINDS.items() for cut in cuts(n)]
    script.plan = [("none", 0)] * len(CLIENT_KINDS) + list(cases)
    with client_of_scripted_node(_scripted(script)) as node:
        whole = [_client_call(UcxNode(node.address), kind) for kind in CLIENT_KINDS]  # uncut: answered
        assert whole[:3] == [True] * 3 and whole[4][0] is not None and whole[5] == [None] * 1100, whole
        accepted = []
        for kind, cut in cases:
            client = UcxNode(node.address)
            try:
                got = _client_call(client, kind)
                if got is not False and got != "ping failed":
                    accepted.append((kind, cut, str(got)[:60]))
            except TransportError:
                pass  # refused: what every cut must give
            finally:
                client.close()
    assert not accepted, f"{len(accepted)} of {len(cases)} short frames accepted: {accepted[:10]}"


# ---- flags: every op with every flag bit ----


_HANDSHAKE_OPS = (protocol.Op.HELLO, protocol.Op.AUTH, protocol.Op.CHALLENGE)


def _request_with_flags(op: int, flag: int) -> list[tuple[np.ndarray, int | None]]:
    """A well-formed request of `op` (inline when `flag` is INLINE, else classic) whose header carries `flag`."""
    keys = metas.encode_keys_meta([b"flag-key"])
    if op == protocol.Op.PUT:
        frames = _put([b"flag-key"], [VALUE], inline=flag == INLINE, request_id=11)
    else:
        meta = {
            protocol.Op.HELLO: b"tenant",
            protocol.Op.AUTH: b"",
            protocol.Op.CHALLENGE: b"",
            protocol.Op.GET: keys,
            protocol.Op.EXISTS: encode_exists_meta(keys, Hold.lease(100)) if flag == protocol.Flags.LEASE else keys,
            protocol.Op.PING: b"",
            protocol.Op.SHM_OPEN: wire.encode_open(0, 1),
            protocol.Op.SHM_PUT: encode_ranged([b"k"], [0], [8]),
            protocol.Op.SHM_GET: encode_ranged([b"k"], [0], [8]),
        }[op]
        count = 1 if op in (protocol.Op.GET, protocol.Op.EXISTS, protocol.Op.SHM_PUT, protocol.Op.SHM_GET) else 0
        if flag == INLINE and op not in _HANDSHAKE_OPS:  # (the handshake is always classic)
            frames = [(_head(op, 11, meta, count=count), None)]
        else:
            frames = [(header(op, meta, count=count), None)] + ([(np.frombuffer(meta, np.uint8), None)] if meta else [])
    first = frames[0][0].copy()
    first[10] |= flag  # the header's flags byte
    return [(first, frames[0][1]), *frames[1:]]


FLAG_OPS = [protocol.Op.HELLO, protocol.Op.AUTH, protocol.Op.CHALLENGE, protocol.Op.PUT, protocol.Op.GET]
FLAG_OPS += [protocol.Op.EXISTS, protocol.Op.PING, protocol.Op.SHM_OPEN, protocol.Op.SHM_PUT, protocol.Op.SHM_GET]
_SERVED_WITHOUT_A_REGION = {protocol.Op.HELLO, protocol.Op.AUTH, protocol.Op.PUT, protocol.Op.GET, protocol.Op.EXISTS}
_SERVED_WITHOUT_A_REGION |= {protocol.Op.PING}


@pytest.mark.parametrize("op", FLAG_OPS, ids=lambda op: op.name)
def test_every_op_with_every_flag_bit(pool_nodes, node_clients, op):
    """Each flag bit on each op a client can send: a flag the op does not define (`protocol.ALLOWED_FLAGS`) closes
    the connection, saying so in the node's log; one it defines never does (and the request is served, where it can
    be without a shared-memory region; a client's CHALLENGE is refused whatever its flags)."""
    node = pool_nodes("8MiB")
    wrong = []
    for bit in range(8):
        flag = 1 << bit
        defined = bool(protocol.ALLOWED_FLAGS[int(op)] & flag)
        frames = _request_with_flags(op, flag)
        with RawSession(node.port) as raw:
            if op == protocol.Op.AUTH:
                raw.hello()
            elif op not in (protocol.Op.HELLO, protocol.Op.CHALLENGE):
                raw.login()
            raw.post_sends(*[f for f, _ in frames], tags=[t for _, t in frames])
            if flag == INLINE and op not in _HANDSHAKE_OPS:
                got = raw.recv_tagged(ucx_frames.HEAD_BYTES, 11, timeout_s=3.0)
            else:
                got = raw.recv(ucx_frames.HEAD_BYTES, timeout_s=3.0)
        named = f"flags {flag:#x} on op {int(op):#x}" in node.log_text()
        if defined and named:
            wrong.append((bit, "refused as undefined"))
        elif defined and op in _SERVED_WITHOUT_A_REGION and isinstance(got, str):
            wrong.append((bit, f"not served: {got}"))
        elif not defined and op != protocol.Op.CHALLENGE and not (got == CLOSED and named):
            wrong.append((bit, f"served: {got if isinstance(got, str) else 'answered'}, named in the log: {named}"))
    assert not wrong, f"op {op.name}: {wrong}"
    assert node_clients(node.address).ping(2.0)
