"""The Mooncake client's connection: set-up attempts, health, and the store handle's life.

Contract (`MooncakeConnection`):
* The constructor starts one `setup` attempt on the workers (`workers.Workers`: it may hang); `ready(timeout_s)` waits
  for the attempt in progress at most `timeout_s` and starts a new one after a failed one, so an engine can start
  before Mooncake does. `store` is the set-up client, or None (not yet, or closed).
* Mooncake's `setup` holds the interpreter lock while it waits for a master (over a minute when there is none), so an
  attempt first checks that the master, and a metadata server given as a URL, accept a TCP connection within
  `connect_timeout_s`; only then does it call `setup`.
* `healthy(timeout_s)`: True when the store is set up and its master answers a probe within `timeout_s`; never raises.
* `close()` marks the connection closed (no attempt starts after it; one that succeeds later closes its store) and
  hands back the store to close (the first time only): the caller closes it once no call is in flight.
* Thread-safe: `_lock` guards `store`, the attempt in progress and `closed`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from ems.backends.mooncake.keys import HEALTH_KEY
from ems.backends.mooncake.workers import Workers
from ems.records import Deadline
from ems.settings import MooncakeSettings

log = logging.getLogger("ems")


class MooncakeConnection:
    """Set-up attempts and the store handle; see the module docstring."""

    def __init__(self, settings: MooncakeSettings, factory: Any, workers: Workers, connect_timeout_s: float) -> None:
        self.settings = settings
        self._factory = factory  # MooncakeDistributedStore
        self._workers = workers
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self.store: Any = None  # set once a setup attempt succeeded
        self._attempt: concurrent.futures.Future | None = None
        self.closed = False
        self._connect()

    def _connect(self) -> concurrent.futures.Future | None:
        """The setup attempt in progress, starting one when there is none (or the last one failed)."""
        with self._lock:
            if self.store is not None or self.closed:
                return None
            attempt = self._attempt
            if attempt is None or (attempt.done() and (attempt.exception() is not None or attempt.result() is None)):
                attempt = self._attempt = self._workers.submit(self._setup)
            return attempt

    def _reachable(self) -> str | None:
        """Why the master (or a metadata server given as a URL) does not accept a TCP connection now, or None."""
        s = self.settings
        targets = [s.master.rpartition(":")[::2]]
        if "://" in s.metadata:
            url = urlsplit(s.metadata)
            if url.hostname and url.port:
                targets.append((url.hostname, str(url.port)))
        for host, port in targets:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=self._connect_timeout_s).close()
            except (OSError, ValueError) as error:
                return f"{host}:{port}: {error}"
        return None

    def _setup(self) -> Any:
        s = self.settings
        unreachable = self._reachable()  # before `setup`, which would hold the interpreter lock while it waits
        if unreachable is not None:
            log.warning("mooncake: not reachable yet: %s", unreachable)
            return None
        store = self._factory()
        rc = store.setup(s.hostname, s.metadata, s.segment_bytes, s.buffer_bytes, s.protocol, s.devices, s.master)
        if rc != 0:
            log.warning("mooncake: setup with master %s answered %s", s.master, rc)
            return None
        with self._lock:
            if self.closed:
                store.close()
                return None
            self.store = store
        log.info("mooncake: connected to master %s (%s, metadata %s)", s.master, s.protocol, s.metadata)
        return store

    def ready(self, timeout_s: float) -> Any:
        """The set-up store, waiting at most `timeout_s` for the setup attempt; None when not (yet) set up."""
        attempt = self._connect()
        if attempt is not None:
            concurrent.futures.wait([attempt], timeout=timeout_s)
        return self.store

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when the store is set up and its master answers within `timeout_s`; never raises."""
        deadline = Deadline.after(timeout_s)
        try:
            store = self.ready(timeout_s)
            if store is None:
                return False
            codes = self._workers.call(lambda: store.batch_is_exist([HEALTH_KEY]), deadline, "health probe")
            return len(codes) == 1 and int(codes[0]) >= 0
        except Exception:  # a probe reports, it never raises
            return False

    def close(self) -> tuple[bool, Any]:
        """Mark the connection closed: (whether this call closed it, the store to close once no call is in flight or
        None)."""
        with self._lock:
            if self.closed:
                return False, None
            self.closed = True
            store, self.store = self.store, None
        return True, store
