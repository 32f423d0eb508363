"""The transport contract: one pool node, as a client sees it.

A `NodeClient` carries batched requests to one node: the embedded store in this process (`inprocess.py`) or a
remote pool node (`ucx.py`). Every call takes `timeout_s` and must return or raise within it, even when the node
hangs; a node that fails raises `TransportError` with `EMS_IO_ERROR` (lost, refused, malformed reply) or
`EMS_IO_TIMEOUT` (no answer in time). Per-key outcomes (a refused put, a missing key) are results, not errors.
"""

from __future__ import annotations

import abc
from typing import Optional, Sequence

from ems.errors import EmsErrorCode, EmsException
from ems.value_format import Buffer


class TransportError(EmsException):
    """A node failed as a whole (connection, protocol or timeout)."""

    def __init__(self, status_code: EmsErrorCode, message: str) -> None:
        super().__init__(status_code, message)


class NodeClient(abc.ABC):
    """Batched requests to one pool node."""

    #: "host:port" of a remote node, or "embedded"
    address: str = "?"

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], timeout_s: float) -> list[bool]:
        """Store `values[i]` (its parts concatenated) under `keys[i]`; True where the node stored it."""

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], timeout_s: float) -> list[Optional[Buffer]]:
        """The stored value of each key, or None where the node has none."""

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes], timeout_s: float) -> list[bool]:
        """Whether the node holds each key."""

    @abc.abstractmethod
    def ping(self, timeout_s: float) -> bool:
        """True when the node answers within `timeout_s`; never raises."""

    def close(self) -> None:
        """Release connections; further calls may reconnect."""
