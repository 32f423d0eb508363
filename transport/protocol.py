"""The pool-node wire protocol, version 7 (`VERSION`): the header, ops and flags, the limits and request limits, end
bytes, and the metas of keys and flags (pure functions, no I/O). The metas of PUT, GET and EXISTS requests and of
GET replies, and the data segments: `transport.metas`; how frames travel on UCX: `ucx.frames`.

Contract:
* Every exchange starts with one fixed 32-byte little-endian **header**:

      magic u32 'EMSP' | version u16 | op u16 | status u16 | flags u8 | meta_end u8 | count u32 | meta_len u32 |
      request_id u32 | data_len u64

  followed by the **meta** (`meta_len` bytes, absent when 0), then the **data** (`data_len` bytes in all). On UCX,
  frames are tagged messages in one of two framings (classic, or inline: a head carrying what fits: `ucx.frames`).
  Each side of a connection receives on a 64-bit base tag it chose; a request's frames after its head, and its
  reply, travel on its own tag: the base tag with its low 32 bits XORed with its id (`request_tag`), unique among
  the connection's requests in flight, so every tag of one connection shares the base tag's high 32 bits.
* **Every frame's last byte is known to its receiver before the frame arrives** ("end bytes"), which is how a
  receiver knows a frame's length exactly although UCX does not report it (`ucx.frames`): the receiver sets that
  byte to another value before the receive and refuses the frame when it still holds it afterwards (a frame short
  by any number of bytes never writes its last byte); a frame longer than its buffer fails in UCX itself. Where
  each frame's end byte is stated: a header's last byte is data_len's top byte, always 0; an inline head's is its
  end byte, always 0 (`ucx.frames.head_layout`: at least one zero pad byte); a meta frame's is the header's `meta_end` (the
  meta's last byte, 0 when there is no meta); a PUT's data frames' are in its meta (`frame_ends`), a GET reply's
  segments' in its meta (`segment_ends`).
* **Flags** are defined per op (`ALLOWED_FLAGS`): a header with a flag its op does not define is malformed.
* Versions: a node answers a HELLO of another version with a header of its own version, status BAD_REQUEST and a
  message, then closes; a client refuses a reply of another version. No frame of another version is ever read.
* Handshake (once per connection): client HELLO (meta: access_id, may be empty) → node CHALLENGE (meta: 32-byte
  nonce; flags: AUTH_REQUIRED) → client AUTH (meta: HMAC-SHA256(key, nonce ‖ access_id) or empty) → node AUTH reply
  (status OK, or AUTH_FAILED with a UTF-8 message in meta, then the node closes). The key never crosses the wire.
* The metas of PUT, GET and EXISTS requests, of GET replies, and the data segments: `transport.metas`. PUT and
  EXISTS replies' meta: u8[count] (1 = stored / held, and kept as asked: `encode_flags`). SHM_OPEN, SHM_PUT, SHM_GET: see
  `transport.shm.wire` (values in a region of shared memory, never in data frames). LOOKUP_OPEN and the lookup
  channel it opens (EXISTS on a TCP socket of its own): `transport.tcp.wire`.
* Every length is checked against the limits below before anything is allocated; a frame that breaks a rule raises
  `ProtocolError`, and the receiver closes that connection (never the server). Every frame must arrive with exactly
  its announced length; receivers verify it by its end byte (above), since UCX does not report a short message.
* A node may refuse a request it will not receive (too large for its in-flight budget, or busy): it answers the
  request's reply op with status BAD_REQUEST and a UTF-8 message as meta, then closes the connection, whose
  remaining frames it never read.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ems.transport.auth import MAC_BYTES, NONCE_BYTES, auth_mac, check_mac  # noqa: F401 - part of the protocol

MAGIC = 0x50534D45  # b"EMSP" read as little-endian u32
# 7 (this round's one version; LOOKUP_OPEN came within it): every frame's last byte is stated before it arrives
# (flags u8 + meta_end u8 in the header, a zero end byte
# closing every inline head, frame_ends in a PUT's meta, segment_ends in a GET reply's meta), flags defined per op;
# 6: an EXISTS may ask for a lease or a pin on the keys it finds (transport/exists_holds.py); 5: a same-host GET may name a
# progress word (`transport.shm`); 4: request tags are the base tag XOR the request
# id (3 hashed them); 3: version 2 plus the shared-memory ops
VERSION = 7
HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("op", "<u2"),
        ("status", "<u2"),
        ("flags", "u1"),
        ("meta_end", "u1"),
        ("count", "<u4"),
        ("meta_len", "<u4"),
        ("request_id", "<u4"),
        ("data_len", "<u8"),
    ]
)
HEADER_SIZE = HEADER_DTYPE.itemsize  # 32
HEADER_STRUCT = struct.Struct("<IHHHBBIIIQ")  # the same layout as HEADER_DTYPE (struct: a few times faster per header)
if HEADER_STRUCT.size != HEADER_SIZE:
    raise ImportError("protocol header layouts disagree")
Buffer_ = Any  # anything exposing the buffer protocol (bytes, memoryview, a numpy array)

# Frame limits: a peer announcing more is malformed, and its connection is closed.
MAX_KEYS = 1 << 16  # keys per request
MAX_KEY_BYTES = 4096  # one key
MAX_META_BYTES = 64 << 20  # one meta frame
MAX_VALUE_BYTES = 1 << 30  # one value
MAX_DATA_BYTES = 4 << 30  # all data frames of one request or reply
MAX_DATA_FRAMES = 4 * MAX_KEYS  # data frames of one PUT
MAX_ID_BYTES = 512  # access_id

# What each key of a request costs of its meta frame (the layouts below): a PUT's value length u64 and key length
# u32 (and a u64 per data frame), a GET's or EXISTS's key length u32; plus the key's bytes.
PUT_META_PER_KEY = 12
PUT_META_PER_FRAME = 9  # its length u64 and its end byte u8
KEY_META_PER_KEY = 4

SEGMENT_BYTES = 1 << 20  # values this large travel alone; smaller ones are packed up to about this size
MAX_REQUEST_ID = (1 << 32) - 1
CONNECTION_TAG_MASK = 0xFFFF_FFFF_0000_0000  # the bits every tag of one connection shares (`request_tag`)
REQUEST_ID_MASK = 0xFFFF_FFFF


class Op(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    PUT = 4
    GET = 5
    EXISTS = 6
    PING = 7
    SHM_OPEN = 8  # same-host shared memory (`transport.shm`): open this connection's region
    SHM_PUT = 9  # a PUT whose values are in the region
    SHM_GET = 10  # a GET whose values are placed in the region
    LOOKUP_OPEN = 11  # a lookup channel of this connection's on TCP (`transport.tcp`): its token and port


REPLY = 0x8000  # op | REPLY in a node's answer to a request


class Status(enum.IntEnum):
    OK = 0
    AUTH_FAILED = 1
    BAD_REQUEST = 2
    SERVER_ERROR = 3


class Flags(enum.IntFlag):
    NONE = 0
    AUTH_REQUIRED = 1  # CHALLENGE: the node only serves clients that prove a configured key
    INLINE = 2  # a request (and its reply) in the inline framing, on the request's own tag
    LEASE = 4  # EXISTS: lease the keys found (transport/exists_holds.py)
    PIN = 8  # EXISTS: pin the keys found


ALL_FLAGS = Flags.AUTH_REQUIRED | Flags.INLINE | Flags.LEASE | Flags.PIN
_INLINE = int(Flags.INLINE)  # plain ints on the per-request path (IntFlag arithmetic is slow)


def _allowed_flags() -> dict[int, int]:
    """op (a reply: op | REPLY) -> the flags it may carry; any other flag is malformed."""
    allowed = {int(op): 0 for op in Op} | {int(op) | REPLY: 0 for op in Op}
    for op in (Op.PUT, Op.GET, Op.PING, Op.SHM_OPEN, Op.SHM_PUT, Op.SHM_GET, Op.LOOKUP_OPEN):  # the requests that travel inline
        allowed[int(op)] = allowed[int(op) | REPLY] = _INLINE
    allowed[int(Op.EXISTS)] = int(Flags.INLINE | Flags.LEASE | Flags.PIN)
    allowed[int(Op.EXISTS) | REPLY] = _INLINE
    allowed[int(Op.CHALLENGE)] = int(Flags.AUTH_REQUIRED)
    return allowed


ALLOWED_FLAGS: dict[int, int] = _allowed_flags()  # HELLO, AUTH and their replies: none


class ProtocolError(Exception):
    """A frame broke the protocol: the connection it came from must be closed."""


class VersionMismatch(ProtocolError):
    """A well-formed header of another protocol version (`version`): refused, never read further."""

    def __init__(self, version: int) -> None:
        super().__init__(f"the peer speaks protocol version {version}, this side speaks {VERSION}")
        self.version = version


def pack_header(
    op: int,
    *,
    count: int = 0,
    meta_len: int = 0,
    data_len: int = 0,
    status: Status = Status.OK,
    flags: int = 0,
    request_id: int = 0,
    meta_end: int = 0,
) -> np.ndarray:
    """A header frame as a 32-byte uint8 array (ready to send; writable). `meta_end`: the meta's last byte
    (`end_byte(meta)`), which the receiver of a meta frame checks its length by."""
    raw = bytearray(HEADER_SIZE)
    HEADER_STRUCT.pack_into(raw, 0, MAGIC, VERSION, op, int(status), flags, meta_end, count, meta_len, request_id, data_len)
    return np.frombuffer(raw, dtype=np.uint8)


def end_byte(frame: Buffer_) -> int:
    """The last byte of a frame (0 for an empty one): what its sender states for it (module docstring)."""
    view = memoryview(frame)
    if view.nbytes == 0:
        return 0
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return int(view[-1])


def end_bytes(frames: Sequence[Buffer_]) -> bytes:
    """`end_byte` of each frame, as the u8 array a meta carries."""
    return bytes(end_byte(f) for f in frames)


def check_meta_end(header: Header, meta: Buffer_) -> None:
    """ProtocolError when `meta` (received whole: inline in a head, or over a stream) does not end with the byte its
    header states."""
    if end_byte(meta) != header.meta_end:
        raise ProtocolError("the meta does not end with the byte its header states")


def request_tag(base: int, request_id: int | None) -> int:
    """The tag of request `request_id`'s frames on a connection whose base tag is `base` (None: the base tag)."""
    return base if request_id is None else base ^ (request_id & REQUEST_ID_MASK)


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed header (slots: one is made per message, on the hot path)."""

    op: int
    status: int
    flags: int
    count: int
    meta_len: int
    data_len: int
    request_id: int = 0
    meta_end: int = 0

    @property
    def inline(self) -> bool:
        return bool(self.flags & _INLINE)


def unpack_header(frame: np.ndarray | bytes | memoryview) -> Header:
    """Parse and check a header frame against the limits; ProtocolError if it is not one."""
    view = memoryview(cast(Any, frame))
    if view.nbytes != HEADER_SIZE:
        raise ProtocolError(f"header frame of {view.nbytes} bytes, expected {HEADER_SIZE}")
    magic, version, op, status, flags, meta_end, count, meta_len, request_id, data_len = HEADER_STRUCT.unpack_from(view.cast("B"))
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic:#x}")
    if version != VERSION:
        raise VersionMismatch(version)
    allowed = ALLOWED_FLAGS.get(op)
    if allowed is None:
        raise ProtocolError(f"unknown op {op}")
    if flags & ~allowed:
        raise ProtocolError(f"flags {flags:#x} on op {op:#x}, which defines {allowed:#x}")
    if count > MAX_KEYS:
        raise ProtocolError(f"{count} keys in one request, limit {MAX_KEYS}")
    if meta_len > MAX_META_BYTES:
        raise ProtocolError(f"meta frame of {meta_len} bytes, limit {MAX_META_BYTES}")
    if meta_len == 0 and meta_end:
        raise ProtocolError("an end byte for an empty meta")
    if data_len > MAX_DATA_BYTES:
        raise ProtocolError(f"{data_len} data bytes in one request, limit {MAX_DATA_BYTES}")
    return Header(op, status, flags, count, meta_len, data_len, request_id, meta_end)


# ---- request limits ----

Costs = tuple[np.ndarray, np.ndarray, np.ndarray]  # per key: data bytes, meta bytes, data frames (int64 each)


@dataclass(frozen=True)
class RequestLimits:
    """The most one request to one node may carry, and what each key costs of it: the one place request limits are
    decided. The pool client cuts a call's keys into requests with `batches`, the jobs cut a request into chunks
    with the same (`capped` to their chunk size), and the costs are the wire's meta layout (`put_costs`,
    `key_costs`), so no layer above the protocol knows it. `WIRE_LIMITS` is this protocol's; a backend with other
    limits (Mooncake) makes its own."""

    max_keys: int = MAX_KEYS
    max_data_bytes: int = MAX_DATA_BYTES
    max_meta_bytes: int = MAX_META_BYTES
    max_data_frames: int = MAX_DATA_FRAMES

    def capped(self, max_data_bytes: int) -> RequestLimits:
        """These limits with at most `max_data_bytes` of data per request."""
        return RequestLimits(self.max_keys, min(self.max_data_bytes, max_data_bytes), self.max_meta_bytes, self.max_data_frames)

    @staticmethod
    def put_costs(key_lens: np.ndarray, value_bytes: np.ndarray, frames: np.ndarray) -> Costs:
        """Per key of a PUT: its value's bytes, its meta bytes and its data frames (`frames`: the value's parts)."""
        frames = np.asarray(frames, dtype=np.int64)
        meta = np.asarray(key_lens, dtype=np.int64) + PUT_META_PER_KEY + PUT_META_PER_FRAME * frames
        return np.asarray(value_bytes, dtype=np.int64), meta, frames

    @staticmethod
    def key_costs(key_lens: np.ndarray, reply_bytes: np.ndarray | None = None) -> Costs:
        """Per key of a GET or EXISTS: the reply bytes it is expected to bring (`reply_bytes`, None: none known), its
        meta bytes, no data frames."""
        meta = np.asarray(key_lens, dtype=np.int64) + KEY_META_PER_KEY
        frames = np.zeros(meta.size, dtype=np.int64)
        frames.flags.writeable = False  # (shared as the data costs when none are known: read by everyone, changed by none)
        data = frames if reply_bytes is None else np.asarray(reply_bytes, dtype=np.int64)
        return data, meta, frames

    def batches(self, costs: Costs) -> list[slice]:
        """Consecutive slices of the keys (per key: data bytes, meta bytes, data frames) such that each slice keeps
        every limit; a key that alone exceeds one still travels, alone (the node then refuses it)."""
        data, meta, frames = costs
        n = len(data)
        if (  # the common call: one request
            0 < n <= self.max_keys
            and _total(data) <= self.max_data_bytes
            and _total(meta) <= self.max_meta_bytes
            and _total(frames) <= self.max_data_frames
        ):
            return [slice(0, n)]
        cums = [np.concatenate(([0], np.cumsum(c, dtype=np.int64))) for c in (data, meta, frames)]
        caps = (self.max_data_bytes, self.max_meta_bytes, self.max_data_frames)
        batches: list[slice] = []
        start = 0
        while start < n:
            end = min(n, start + self.max_keys)
            for cum, cap in zip(cums, caps):
                # the largest end with cum[end] - cum[start] <= cap
                end = min(end, int(np.searchsorted(cum, cum[start] + cap, side="right")) - 1)
            end = max(end, start + 1)
            batches.append(slice(start, end))
            start = end
        return batches


WIRE_LIMITS = RequestLimits()

_FEW = 32  # up to this many values, Python sums a list ~10x faster than numpy reduces a tiny array


def _total(values: np.ndarray) -> int:
    """The sum of an int64 array: a lookup's or a one-block call's few costs without numpy's per-call overhead (a few
    µs a reduction, paid on every small call)."""
    return sum(values.tolist()) if values.size <= _FEW else int(values.sum())


def key_lens(keys: Sequence[bytes]) -> np.ndarray:
    """int64 byte length of each key."""
    return np.array([len(k) for k in keys], dtype=np.int64)


# ---- authentication (transport/auth.py) ----


def check_access_id(raw: bytes) -> str:
    if len(raw) > MAX_ID_BYTES:
        raise ProtocolError(f"access_id of {len(raw)} bytes, limit {MAX_ID_BYTES}")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("access_id is not ASCII") from None


# ---- meta frames ----


def encode_keys(keys: Sequence[bytes]) -> tuple[np.ndarray, bytes]:
    """(key_lens u32, concatenated keys), checking the limits."""
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{len(keys)} keys in one request, limit {MAX_KEYS}")
    lens = np.fromiter((len(k) for k in keys), dtype=np.uint32, count=len(keys))
    if lens.size and int(lens.max()) > MAX_KEY_BYTES:
        raise ValueError(f"a key of {int(lens.max())} bytes, limit {MAX_KEY_BYTES}")
    return lens, b"".join(keys)


def split_keys(key_lens: np.ndarray, blob: memoryview | bytes) -> list[bytes]:
    """The keys of a meta frame, checking the limits; ProtocolError when they do not add up."""
    if key_lens.size and int(key_lens.max()) > MAX_KEY_BYTES:
        raise ProtocolError(f"a key of {int(key_lens.max())} bytes, limit {MAX_KEY_BYTES}")
    ends = np.cumsum(key_lens, dtype=np.int64)
    if (int(ends[-1]) if ends.size else 0) != len(blob):
        raise ProtocolError("key lengths do not match the key bytes")
    blob = bytes(blob)
    starts = (ends - key_lens).tolist()
    return [blob[a:b] for a, b in zip(starts, ends.tolist())]


def decode_flags(count: int, meta: memoryview | bytes) -> list[bool]:
    if len(meta) != count:
        raise ProtocolError(f"reply of {len(meta)} flags for {count} keys")
    return [b != 0 for b in bytes(meta)]


def encode_flags(flags: Sequence[bool]) -> bytes:
    """PUT/EXISTS reply meta."""
    return bytes(1 if f else 0 for f in flags)
