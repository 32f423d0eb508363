"""The lookup channel's protocol and security model: a TCP socket beside a node's UCX connection that carries only
that connection's lookups (EXISTS), between hosts or on one host without a shared-memory region.

Why: a lookup over UCX costs UCX's own round trip through its TCP lanes and progress thread, about RTT + 200 µs
between namespace hosts where a plain socket's round trip from Python is RTT + 30 µs (perf/RESULTS.md, "a lookup
channel across hosts"); a lookup is a few bytes each way, so what it costs is that round trip.

Protocol:
* **LOOKUP_OPEN** (a request on the node's UCX connection, after the handshake, in the inline framing; no meta, count
  0): the node answers with `OPEN_REPLY`: a fresh one-time token (TOKEN_BYTES, random) and the TCP port of its
  lookup listener. Port 0 (and a zero token): no channel (the node offers none); the client asks later. A connection
  has one offer at a time: a later LOOKUP_OPEN replaces its unpresented token.
* The client connects to that port at the address its UCX connection reached and sends the token, alone. The node
  answers `ACCEPTED` (one byte) and from then on the socket is the connection's lookup channel; any other outcome
  closes the socket without a byte. The channel carries the protocol's 32-byte header and meta per request, EXISTS
  only (with its LEASE or PIN flag), no data, never the INLINE flag; each reply is a header and its meta
  (`transport.stream`). Up to CHANNEL_IN_FLIGHT lookups are in flight on it at once, told apart by their request
  ids; the node answers them in order.

Security model (the channel has no handshake of its own: it borrows the UCX connection's):
* The token proves the TCP peer is the client of an authenticated UCX connection: it travels only on that connection,
  is 256 random bits, is spent by its first presentation, right or wrong, and expires TOKEN_TTL_S after it was given.
  The node also requires the TCP peer's IP address to be the UCX connection's peer's (a token seen on another host
  cannot be used from there).
* A channel's lookups are the connection's: under its tenant's namespace, answered as the node answers an EXISTS on
  UCX (`transport.handler.RequestHandler.answer_now`: the same checks, metrics and holds). A channel ends when its
  connection ends, when the connection opens another, and on anything malformed (any other op included).
* Limits: a peer that has not presented a token holds one of MAX_PENDING places (MAX_PENDING_PER_IP for one IP
  address) for at most HANDSHAKE_TIMEOUT_S; a peer finding none free is closed at once. Channels: one per
  connection, so the node's connection limits bound them. A channel's unread requests stay in the client's socket
  (the reader holds at most `RequestReader.READ_BYTES` of them) and the node sends one reply at a time, so a client
  that sends without reading replies stalls only its own channel.
* Like UCX's TCP lanes, the channel is not encrypted: it carries keys and flags, never values.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from dataclasses import dataclass

from ems.transport import protocol

TOKEN_BYTES = 32
TOKEN_TTL_S = 10.0  # a token not presented within this long is forgotten
HANDSHAKE_TIMEOUT_S = 2.0  # a TCP peer must present its token within this long
MAX_PENDING = 64  # TCP peers that have not presented a token yet, all together ...
MAX_PENDING_PER_IP = 8  # ... and from one IP address
ACCEPTED = b"\x01"  # the node's answer to a right token
CHANNEL_OPS = frozenset({int(protocol.Op.EXISTS)})
CHANNEL_IN_FLIGHT = 8  # lookups in flight on one channel (a call finding every slot taken asks over UCX)
OPEN_REPLY = struct.Struct("<32sH")  # token | port
NO_CHANNEL = b"\0" * TOKEN_BYTES


@dataclass(frozen=True)
class LookupSettings:
    """A node's lookup listener: `port` 0 for any free port (the client is told which), None for no channel."""

    port: int | None = 0

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 0xFFFF:
            raise ValueError(f"lookup port {self.port} is not a TCP port (0 for any free one, None for off)")

    @property
    def enabled(self) -> bool:
        return self.port is not None


class LookupRefusal(str, enum.Enum):
    """Why the node closed a TCP peer of its lookup listener: the `reason` of `ems_pool_lookup_refusals_total`."""

    BUSY = "busy"  # every pending place taken (in all, or of the peer's address): closed at accept
    NO_TOKEN = "no_token"  # no whole token within HANDSHAKE_TIMEOUT_S (silence, half a token, a close)
    UNKNOWN_TOKEN = "unknown_token"  # a token never offered, or spent
    EXPIRED = "expired"  # a token presented past TOKEN_TTL_S
    OTHER_PEER = "other_peer"  # a token presented from another address than its connection's peer (and spent so)
    MALFORMED = "malformed"  # a channel that sent something malformed, or an op other than EXISTS (ended)


@dataclass(frozen=True)
class LookupStats:
    """A node's lookup channels now (`tcp.server.LookupService.stats`)."""

    channels: int  # open, one per connection at most
    pending: int  # TCP peers that have not presented a token yet
    refusals: dict[str, int]  # by `LookupRefusal` value, since start


def encode_open_reply(token: bytes, port: int) -> bytes:
    return OPEN_REPLY.pack(token, port)


def decode_open_reply(meta: bytes) -> tuple[bytes, int]:
    """(token, port) of a LOOKUP_OPEN reply; port 0: no channel. ProtocolError when malformed."""
    if len(meta) != OPEN_REPLY.size:
        raise protocol.ProtocolError(f"a LOOKUP_OPEN reply of {len(meta)} bytes (expected {OPEN_REPLY.size})")
    token, port = OPEN_REPLY.unpack(meta)
    if (port == 0) != (token == NO_CHANNEL):
        raise protocol.ProtocolError("a LOOKUP_OPEN reply with a port but no token, or a token but no port")
    return token, port


def same_address(a: str, b: str) -> bool:
    """Whether two textual IP addresses name the same host address (an IPv4-mapped IPv6 address is its IPv4 one);
    False when either is not an IP address."""
    try:
        first, second = ipaddress.ip_address(a.split("%")[0]), ipaddress.ip_address(b.split("%")[0])
    except ValueError:
        return False
    if isinstance(first, ipaddress.IPv6Address) and first.ipv4_mapped is not None:
        first = first.ipv4_mapped
    if isinstance(second, ipaddress.IPv6Address) and second.ipv4_mapped is not None:
        second = second.ipv4_mapped
    return first == second
