"""Error types of the public API.

Contract: `EmsException` is the only exception type the public API raises. Its status code says what the caller
should do. Every code, and when this package raises it:

| code                   | raised when                                                   | what the engine does           |
|------------------------|---------------------------------------------------------------|--------------------------------|
| `EMS_INVALID_ARGUMENT` | a bad argument or config (named in the message), a call before | fix the call; nothing was       |
|                        | `register_kvcache`, a second `Ems.init` with another config,  | written                        |
|                        | a call on a shut-down client                                  |                                |
| `EMS_IO_ERROR`         | a call reached no pool node (connection lost or refused), or  | treat the blocks as missing;   |
|                        | at `Ems.init` a node refused the credentials (waiting will    | poll `Ems.check_health()`      |
|                        | not help: fix `access_id`/`access_key`)                       |                                |
| `EMS_IO_TIMEOUT`       | the pool did not answer within the request's timeout, or      | treat the blocks as missing;   |
|                        | `CcFuture.result(timeout)` ran out                            | retry later                    |
| `EMS_INTERNAL_ERROR`   | an SDK or device-memory fault (e.g. staging allocation, a     | report it; the call had no     |
|                        | missing optional dependency such as UCX)                      | effect on the pool's contents  |
| `EMS_RECOVERD_ERROR`   | `Ems.init` only: pool nodes are configured but none answered  | retry `Ems.init` later, e.g.   |
|                        | within `connect_timeout_ms`. Nothing is wrong with the config;| once `Ems.check_health()` is   |
|                        | the pool is not reachable *yet*. `Ems.get_cc()` stays None    | True (it probes the configured |
|                        | and `Ems.check_health()` probes the configured nodes          | nodes until init succeeds)     |

`EMS_RECOVERD_ERROR` keeps the EMS SDK's spelling, which engines written against the SDK compare with.
"""

from __future__ import annotations

import enum


class EmsErrorCode(enum.IntEnum):
    EMS_INVALID_ARGUMENT = 1
    EMS_IO_ERROR = 2
    EMS_IO_TIMEOUT = 3
    EMS_INTERNAL_ERROR = 4
    EMS_RECOVERD_ERROR = 5  # the SDK's spelling: a recoverable init failure (pool not reachable yet)


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
