"""A same-host client's opening of its connection's region (`transport.shm.wire` has the protocol and the security
model): SHM_OPEN on the node client's connection, the descriptor's hand-over on the node's Unix socket, the mapping.

Contract:
* `transport.base.NodeLink` is what a `shm.client.ShmClient` is handed of the node client it serves (`UcxNode` hands it one): the
  node's current connection, one request on it under the node client's rules, the record of a failure the node
  client did not see. Shared memory imports nothing of the node client's medium.
* `open_region(link, populate_bytes, deadline)` asks the node for a region on the link's current connection, stating
  how much of it to populate (`populate_bytes`, rounded up to MiB). It returns None when the request was not sent, a
  `Handed` without a region when the node offered none (size 0: its total or the tenant's share taken, or shared
  memory off) or the hand-over failed (the node busy, the token expired, a peer not the node's pid: logged at info),
  else the region mapped, its populate started on a background thread, and the socket it came on, which stays open as
  the region's request channel (`shm.client_region.ClientChannel`). A malformed SHM_OPEN reply is a failure of the
  node client's (`NodeLink.fail`, raised); so is a failed request (its `TransportError`, raised by
  `NodeLink.request`).
* The descriptor is taken only from the node's pid (SO_PEERCRED), within HANDOVER_TIMEOUT_S (and the deadline); the
  token is presented once. What fails on the way closes the socket and every descriptor received.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from ems.buffers import populate_in_background
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport import protocol
from ems.transport.base import NodeLink
from ems.transport.shm.wire import OpenReply, decode_open_reply, encode_open, map_region, peer_credentials

log = logging.getLogger("ems.transport")

HANDOVER_TIMEOUT_S = 2.0
_MIB = 1 << 20


@dataclass(frozen=True)
class Handed:
    """What SHM_OPEN on connection `ep` gave: the region mapped and the socket it was handed over on, or neither."""

    ep: Any
    array: np.ndarray | None = None
    sock: socket.socket | None = None


def open_region(link: NodeLink, populate_bytes: int, deadline: Deadline) -> Handed | None:
    """See the module docstring."""
    populate_mib = -(-populate_bytes // _MIB)
    sent = link.request(protocol.Op.SHM_OPEN, populate_mib, encode_open(os.getuid(), os.getpid()), deadline)
    if sent is None:  # (not bound to a connection: always sent)
        return None
    ep, reply = sent
    try:
        offer = decode_open_reply(reply)
    except protocol.ProtocolError as error:  # as the node client answers a malformed reply of its own
        raise link.fail(ep, EmsErrorCode.EMS_IO_ERROR, f"malformed reply: {error}") from None
    if offer.region_bytes == 0:
        return Handed(ep)
    try:
        array, sock = _receive_region(offer, min(HANDOVER_TIMEOUT_S, deadline.left()))
    except (OSError, ValueError) as error:
        log.info("%s: no shared memory for now (using UCX): %s", link.address, error)
        return Handed(ep)
    populate_in_background(array, populate_mib * _MIB, "ems-shm-prefault")  # the node populates as much
    return Handed(ep, array, sock)


def _receive_region(offer: OpenReply, timeout_s: float) -> tuple[np.ndarray, socket.socket]:
    """Present the token on the node's Unix socket and map the descriptor it hands over; the socket stays open as
    the region's request channel."""
    if not offer.socket_name.startswith(b"\0"):
        raise ValueError("the node's socket is not an abstract one")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        sock.settimeout(max(0.01, timeout_s))
        sock.connect(offer.socket_name)
        pid, _uid = peer_credentials(sock)
        if pid != offer.node_pid:
            raise ValueError(f"the socket's peer is pid {pid}, not the node's pid {offer.node_pid}")
        sock.sendall(offer.token)
        message, fds, _flags, _addr = socket.recv_fds(sock, 1, 4)
        if message != b"\1" or len(fds) != 1:
            raise ValueError("the node refused the mapping")
        array = map_region(fds[0], offer.region_bytes)
    except BaseException:
        sock.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return array, sock
