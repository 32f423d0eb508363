"""Challenge-response authentication of a client to a pool node (HMAC-SHA256; the key never crosses the wire).

Contract: the node sends a fresh random nonce of NONCE_BYTES; the client answers `auth_mac(key, nonce, access_id)`;
the node accepts when `check_mac` (constant-time) holds for the key it has for that access_id. The MAC binds the
nonce (no replay on another connection) and the tenant (a MAC for one tenant is useless for another).
"""

from __future__ import annotations

import hashlib
import hmac

NONCE_BYTES = 32
MAC_BYTES = 32
_DOMAIN = b"ems-auth-v1\0"  # separates these MACs from any other use of the same key


def auth_mac(access_key: str, nonce: bytes, access_id: str) -> bytes:
    """HMAC-SHA256 proving knowledge of `access_key` for this nonce and tenant."""
    return hmac.new(access_key.encode(), _DOMAIN + nonce + access_id.encode(), hashlib.sha256).digest()


def check_mac(access_key: str, nonce: bytes, access_id: str, mac: bytes) -> bool:
    return hmac.compare_digest(auth_mac(access_key, nonce, access_id), mac)
