"""Error types of the public API.

Contract: `EmsException` is the only exception type the public API raises. Its status code says what the caller
should do: `EMS_INVALID_ARGUMENT` fix the call and retry; `EMS_IO_ERROR` the pool failed or a connection was lost;
`EMS_IO_TIMEOUT` the pool is overloaded or a node hangs; `EMS_INTERNAL_ERROR` an SDK or device-memory fault.
"""

from __future__ import annotations

import enum


class EmsErrorCode(enum.IntEnum):
    EMS_INVALID_ARGUMENT = 1
    EMS_IO_ERROR = 2
    EMS_IO_TIMEOUT = 3
    EMS_INTERNAL_ERROR = 4


class EmsException(Exception):
    """An error from the EMS SDK, with a status code and a message."""

    def __init__(self, status_code: EmsErrorCode, message: str) -> None:
        super().__init__(f"[{status_code.name}] {message}")
        self._status_code = status_code
        self._message = message

    def status_code(self) -> EmsErrorCode:
        return self._status_code

    def message(self) -> str:
        return self._message


def invalid_argument(message: str) -> EmsException:
    """An `EMS_INVALID_ARGUMENT` exception; the message names the argument (and index) at fault."""
    return EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, message)
