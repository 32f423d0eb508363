"""A small etcd v3 client over etcd's documented JSON gateway (`/v3/kv/*`, `/v3/lease/*`, `/v3/watch`).

Why our own and not a PyPI client: `etcd3` (gRPC) has had no release since 2020 and pins old grpcio/protobuf that
clash with torch/vLLM stacks; `etcd3gw` (the gateway client) needs requests/futurist/pbr and its watcher drops the
end of its stream silently, so a client could never learn that etcd went away and resynchronise. Membership needs
seven calls; this module is those calls on `http.client`, with a timeout on every one.

Contract:
* Keys and values are bytes (base64 on the wire, as the gateway wants). Revisions and lease ids are ints.
* Every unary call returns within `timeout_s` or raises `EtcdError` (unreachable, refused, malformed reply).
* `watch_prefix` blocks, calling `on_events` for each batch, until the stream ends (etcd stopped, connection lost:
  it raises `EtcdError`), nothing arrives for `idle_s` seconds (`WatchIdle`: a half-open connection after a network
  partition would otherwise wait forever), `renew()` is called on the handle from another thread (`WatchIdle` too:
  the caller knows the stream may be stale), or `stop()` is called on the handle from another thread (it returns).
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Callable


class EtcdError(Exception):
    """etcd could not be reached, refused the call, or answered something unreadable."""


class WatchIdle(EtcdError):
    """A watch saw nothing for `idle_s` seconds (a quiet prefix, or a connection silently lost): watch again."""


@dataclasses.dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """One change: `deleted` is True for a DELETE (lease expiry included), else a PUT of `value`."""

    key: bytes
    value: bytes
    deleted: bool
    revision: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's `range_end` for a prefix)."""
    raw = bytearray(prefix)
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # every key


def parse_url(url: str) -> tuple[str, int]:
    """`http://host:port` → (host, port); ValueError on anything else (https is not supported)."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme != "http" or not parsed.hostname or parsed.path not in ("", "/"):
        raise ValueError(f"an etcd endpoint must look like http://HOST:PORT, got {url!r}")
    return parsed.hostname, parsed.port or 2379


class WatchHandle:
    """Stops, or renews, a running `watch_prefix` from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self.stopped = False
        self._renew = False

    def _attach(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._conn = conn
            self._renew = False  # a watch made now is fresh: an earlier renew() has nothing left to end
            if self.stopped:
                _shutdown(conn)

    def renew(self) -> None:
        """End the running watch with `WatchIdle` (the caller then reads the set again and watches anew)."""
        with self._lock:
            self._renew = True
            if self._conn is not None:
                _shutdown(self._conn)

    def _renewed(self) -> bool:
        with self._lock:
            renewed, self._renew = self._renew, False
            return renewed

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            if self._conn is not None:
                _shutdown(self._conn)


def _shutdown(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass


class EtcdClient:
    """The calls membership needs; see the module docstring. Thread-safe (one connection per call)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = url
        self.host, self.port = parse_url(url)
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s or self.timeout_s)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as error:
            raise EtcdError(f"etcd at {self.url} unreachable: {error!r}") from None
        finally:
            conn.close()
        try:
            reply = json.loads(data) if data else {}
        except ValueError:
            raise EtcdError(f"etcd at {self.url}: unreadable reply to {path}: {data[:200]!r}") from None
        if response.status != 200 or "error" in reply:
            raise EtcdError(f"etcd at {self.url} refused {path} (HTTP {response.status}): {reply}")
        return reply

    # ---- kv ----

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Store `value` under `key` (attached to `lease` when non-zero); returns the new revision."""
        body: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._post("/v3/kv/put", body)["header"]["revision"])

    def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store's revision they were read at."""
        reply = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = [
            KeyValue(_unb64(kv["key"]), _unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)))
            for kv in reply.get("kvs", [])
        ]
        return kvs, int(reply["header"]["revision"])

    def delete(self, key: bytes) -> int:
        """Delete `key`; returns how many keys were deleted (0 or 1)."""
        return int(self._post("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    # ---- leases ----

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; returns its id."""
        return int(self._post("/v3/lease/grant", {"TTL": int(ttl_s)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh `lease`; returns its remaining TTL, 0 when etcd no longer knows it (expired or revoked)."""
        reply = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """Revoke `lease`, deleting every key attached to it."""
        self._post("/v3/lease/revoke", {"ID": str(lease)})

    # ---- watch ----

    def watch_prefix(
        self,
        prefix: bytes,
        start_revision: int,
        on_events: Callable[[list[WatchEvent]], None],
        handle: WatchHandle | None = None,
        on_created: Callable[[], None] | None = None,
        idle_s: float | None = None,
    ) -> None:
        """Stream changes under `prefix` from `start_revision` on; see the module docstring."""
        handle = handle or WatchHandle()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            body = {
                "create_request": {
                    "key": _b64(prefix),
                    "range_end": _b64(prefix_end(prefix)),
                    "start_revision": str(start_revision),
                }
            }
            conn.request("POST", "/v3/watch", body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise EtcdError(f"etcd at {self.url} refused a watch (HTTP {response.status})")
            if conn.sock is not None:
                conn.sock.settimeout(idle_s)  # a watch waits for changes up to idle_s; stop() ends it at once
            handle._attach(conn)
            while True:
                line = response.readline()
                if handle.stopped:
                    return
                if handle._renewed():
                    raise WatchIdle(f"etcd at {self.url}: watch renewed on request")
                if not line:
                    raise EtcdError(f"etcd at {self.url}: the watch stream ended")
                if not line.strip():
                    continue
                message = json.loads(line)
                result = message.get("result", {})
                if "error" in message:
                    raise EtcdError(f"etcd at {self.url}: watch failed: {line[:200]!r}")
                if result.get("created"):
                    if on_created is not None:
                        on_created()
                    continue
                if result.get("canceled") or result.get("compact_revision"):
                    raise EtcdError(f"etcd at {self.url} cancelled the watch: {result}")
                events = [
                    WatchEvent(
                        key=_unb64(e["kv"]["key"]),
                        value=_unb64(e["kv"].get("value", "")),
                        deleted=e.get("type") == "DELETE",
                        revision=int(e["kv"].get("mod_revision", 0)),
                    )
                    for e in result.get("events", [])
                ]
                if events:
                    on_events(events)
        except (OSError, http.client.HTTPException, ValueError) as error:
            if handle.stopped:
                return
            if handle._renewed():
                raise WatchIdle(f"etcd at {self.url}: watch renewed on request") from None
            if isinstance(error, TimeoutError):
                raise WatchIdle(f"etcd at {self.url}: nothing on the watch for {idle_s} s") from None
            raise EtcdError(f"etcd at {self.url}: watch lost: {error!r}") from None
        finally:
            conn.close()
