"""The handshake of a client connecting to a pool node over UCX (`transport.ucx.server`; protocol docstring).

Contract:
* `handshake(ep, access_keys, metrics)` runs HELLO, CHALLENGE (a fresh nonce), AUTH and its reply, and returns the
  tenant the client is accepted as, or None when it was refused (its refusal sent, then a short pause so it reaches
  the client before the server closes the endpoint): a protocol version this node does not speak (BAD_REQUEST),
  or, with access keys configured, no access id or a wrong proof (AUTH_FAILED; counted in `metrics.auth_failures`).
  Without keys every client is accepted under the tenant it names.
* A malformed handshake raises `protocol.ProtocolError`; a peer that left, `Closed`. The server bounds the whole
  handshake by `handshake_timeout_s` (its watchdog aborts the connection).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from ems.transport import protocol
from ems.transport.handler import SessionMetrics
from ems.transport.ucx.connections import Closed
from ems.transport.ucx.frames import recv_header_frame, recv_meta, send_all

log = logging.getLogger("ems.pool")


async def handshake(ep: Any, access_keys: dict[str, str], metrics: SessionMetrics | None) -> str | None:
    """The tenant the client behind `ep` is accepted as, or None; see the module docstring."""
    try:
        hello = await _recv_header(ep)
    except protocol.VersionMismatch as mismatch:
        log.warning("refused a client: %s", mismatch)
        message = f"protocol version {mismatch.version} is not supported: this node speaks {protocol.VERSION}".encode()
        reply = protocol.pack_header(
            protocol.Op.HELLO | protocol.REPLY,
            status=protocol.Status.BAD_REQUEST,
            meta_len=len(message),
            meta_end=protocol.end_byte(message),
        )
        await send_all(ep, [reply, message])
        await asyncio.sleep(0.05)  # let the refusal reach the client before the endpoint closes
        return None
    if hello.op != protocol.Op.HELLO or hello.data_len or hello.meta_len > protocol.MAX_ID_BYTES:
        raise protocol.ProtocolError(f"expected HELLO, got op {hello.op}")
    access_id = protocol.check_access_id(await recv_meta(ep, hello))
    nonce = os.urandom(protocol.NONCE_BYTES)
    flags = protocol.Flags.AUTH_REQUIRED if access_keys else protocol.Flags.NONE
    challenge = protocol.pack_header(protocol.Op.CHALLENGE, meta_len=len(nonce), flags=flags, meta_end=protocol.end_byte(nonce))
    await send_all(ep, [challenge, nonce])
    auth = await _recv_header(ep)
    if auth.op != protocol.Op.AUTH or auth.data_len or auth.meta_len not in (0, protocol.MAC_BYTES):
        raise protocol.ProtocolError(f"expected AUTH, got op {auth.op}")
    mac = await recv_meta(ep, auth)
    if access_keys:
        key = access_keys.get(access_id)
        if not access_id or key is None or not protocol.check_mac(key, nonce, access_id, mac):
            reason = (
                "this node requires an access_id and access_key" if not access_id else "unknown access_id or wrong access_key"
            )
            log.warning("refused a client (access_id %r): %s", access_id, reason)
            if metrics is not None:
                metrics.auth_failures.inc()
            message = f"authentication failed: {reason}".encode()
            await send_all(
                ep,
                [
                    protocol.pack_header(
                        protocol.Op.AUTH | protocol.REPLY,
                        status=protocol.Status.AUTH_FAILED,
                        meta_len=len(message),
                        meta_end=protocol.end_byte(message),
                    ),
                    message,
                ],
            )
            await asyncio.sleep(0.05)  # let the refusal reach the client before the endpoint closes
            return None
    await send_all(ep, [protocol.pack_header(protocol.Op.AUTH | protocol.REPLY)])
    log.debug("client connected as tenant %r", access_id)
    return access_id


async def _recv_header(ep: Any) -> protocol.Header:
    try:
        frame = await recv_header_frame(ep)
    except protocol.ProtocolError:
        raise
    except Exception as error:
        raise Closed() from error
    return protocol.unpack_header(frame)
