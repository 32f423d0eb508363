"""Value types of the public API: request options, V0 keys and buffers, layer groups, results, futures.

Field names, order and defaults follow the EMS Context Caching SDK exactly (see API.md). Constructors check
their own fields and raise `EmsException(EMS_INVALID_ARGUMENT)` naming the field.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from ems.errors import EmsErrorCode, EmsException, invalid_argument
from ems.records import MAX_TIMEOUT_MS  # noqa: F401 - re-exported: the longest wait a request honours

if TYPE_CHECKING:
    from ems.records import JobRecord

MAX_KEY_CHARS = 127  # a V0 PrimaryKey field is "under 128 characters"
# a V0 plain-str key (the SDK's older form, e.g. "vllm@tenant@pp1@tp1@0@<hash>"), in UTF-8 bytes: well within the
# wire protocol's key size once the 17-byte namespace is in front
MAX_STR_KEY_BYTES = 1024

V0Key = Union["PrimaryKey", str]


def _require_int(name: str, value: object, minimum: int | None = None) -> int:
    # bool is an int subclass; a flag where a count belongs is a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_argument(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise invalid_argument(f"{name} must be >= {minimum}, got {value}")
    return value


def _require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise invalid_argument(f"{name} must be a bool, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class CcKvOption:
    """Per-request options.

    write_rcache: keep a copy of what this request writes in the client's local read cache.
    read_local_only: a read never goes to another node (local read cache, or the embedded pool).
    timeout: milliseconds for the whole request, >= 0; 0 means no limit (the request waits for the pool). Any
        int >= 0 is accepted; a timeout above `MAX_TIMEOUT_MS` (365 days), like 0, waits at most that long.
    """

    write_rcache: bool = True
    read_local_only: bool = False
    timeout: int = 5000

    def __post_init__(self) -> None:
        _require_bool("CcKvOption.write_rcache", self.write_rcache)
        _require_bool("CcKvOption.read_local_only", self.read_local_only)
        _require_int("CcKvOption.timeout", self.timeout, minimum=0)


DEFAULT_OPTION = CcKvOption()


@dataclass(frozen=True)
class PrimaryKey:
    """A V0 key. Routing uses `distribute_key` only: keys sharing it land on the same pool node."""

    distribute_key: str
    attribute_key: str

    def __post_init__(self) -> None:
        for name in ("distribute_key", "attribute_key"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise invalid_argument(f"PrimaryKey.{name} must be a str, got {type(value).__name__}")
            if not value:
                raise invalid_argument(f"PrimaryKey.{name} must not be empty")
            if len(value) > MAX_KEY_CHARS:
                raise invalid_argument(f"PrimaryKey.{name} is {len(value)} characters; a key must be under {MAX_KEY_CHARS + 1}")
            _check_utf8(f"PrimaryKey.{name}", value)


def _check_utf8(name: str, value: str) -> bytes:
    """`value` in UTF-8 (how keys are stored and routed); EMS_INVALID_ARGUMENT naming `name` when it cannot be
    encoded (a lone surrogate such as "\\ud800")."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_argument(f"{name} is not encodable as UTF-8: {exc.reason} at index {exc.start}") from None


def check_str_key(name: str, key: str) -> bytes:
    """A V0 plain-str key as the UTF-8 bytes it is stored and routed by; EMS_INVALID_ARGUMENT naming `name`."""
    if not key:
        raise invalid_argument(f"{name} must not be an empty str")
    raw = _check_utf8(name, key)
    if len(raw) > MAX_STR_KEY_BYTES:
        raise invalid_argument(f"{name} is {len(raw)} bytes in UTF-8; a str key holds at most {MAX_STR_KEY_BYTES}")
    return raw


@dataclass(frozen=True)
class KvBufferWrapper:
    """A contiguous range of device memory: `length` bytes from address `data_ptr`."""

    data_ptr: int
    length: int

    def __post_init__(self) -> None:
        _require_int("KvBufferWrapper.data_ptr", self.data_ptr, minimum=1)
        _require_int("KvBufferWrapper.length", self.length, minimum=1)


@dataclass(frozen=True)
class StoreLayerGroupDesc:
    """One layer group: which layers, and the largest number of tokens one stored block of it holds."""

    store_block_size: int
    layer_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require_int("StoreLayerGroupDesc.store_block_size", self.store_block_size, minimum=1)
        if not isinstance(self.layer_ids, (list, tuple)) or not self.layer_ids:
            raise invalid_argument("StoreLayerGroupDesc.layer_ids must be a non-empty list of ints")
        for i, layer in enumerate(self.layer_ids):
            _require_int(f"StoreLayerGroupDesc.layer_ids[{i}]", layer, minimum=0)


@dataclass(frozen=True)
class CcResult:
    """`total` keys (or blocks) were asked for; `success` of them, consecutive from the first, succeeded."""

    success: int
    total: int


class CcFuture:
    """The pending result of an async call. `result()` blocks; `done()` never does."""

    def __init__(self, inner: concurrent.futures.Future[CcResult], job: JobRecord | None = None) -> None:
        self._inner = inner
        # this package's addition: the call's job record (`ems.records`: blocks, bytes, seconds, stages), final
        # once the future is done (a call that raised leaves it unfinished: no blocks, no bytes)
        self.job = job

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout: float | None = None) -> CcResult:
        """Wait up to `timeout` seconds (None: for ever); raise `EmsException(EMS_IO_TIMEOUT)` past it."""
        try:
            return self._inner.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT, f"result not ready after {timeout} s") from exc

    def add_done_callback(self, callback: Callable[[CcFuture], None]) -> None:
        self._inner.add_done_callback(lambda _inner: callback(self))

    def __repr__(self) -> str:
        return f"CcFuture(done={self.done()})"
