"""`Ems`: process-wide start-up of the SDK.

`Ems.init(config)` initialises the process's one SDK instance: a second call with an equal config is a no-op, with
another config it raises `EmsException(EMS_INVALID_ARGUMENT)` until `Ems.shutdown()`, after which `init` may run
again, with any config. With no pool nodes configured the pool is embedded in the process
(the same store code a pool node runs); with nodes, at least one must answer within `connect_timeout_ms`, else
`EmsException(EMS_RECOVERD_ERROR)`: a recoverable failure (the SDK's code): nothing is initialised, `Ems.check_health()`
keeps probing the configured nodes and turns True once one answers, and `Ems.init` may then be called again (any
config). With `pool_backend="mooncake"` the pool is a Mooncake Store (`ems.backends.mooncake`): the same, with its master
in place of the nodes. A node that refuses the credentials raises `EMS_IO_ERROR` (retrying will not help). `Ems.get_cc()` returns
the `ContextCaching` object, or None when init failed or the config had no cc_config. `Ems.check_health()` is True
while the pool is reachable. The config is checked (all fields, whatever was changed after construction) and
snapshotted at init: changing it afterwards has no effect.
`Ems.shutdown()` (this package's addition) releases everything, after which `init` may run again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ems.backends.base import PoolBackend
from ems.backends.embedded import EmbeddedPool
from ems.client.context_caching import ContextCaching
from ems.config import EmsConfig, check_config
from ems.errors import EmsErrorCode, EmsException, invalid_argument
from ems.extras import MissingExtra, require
from ems.settings import PoolBackendKind, Settings, resolve_settings
from ems.store.kv_store import KvStore

if TYPE_CHECKING:
    from ems.transport.base import NodeClient

logger = logging.getLogger("ems")


class _SdkLogHandler(logging.FileHandler):
    """The file handler EMS_SDK_LOG adds (one per process, however often `Ems.init` runs)."""


def _configure_logging(directory: str | None) -> None:
    """`directory` (EMS_SDK_LOG): the SDK logs to a file there."""
    if not directory or any(isinstance(h, _SdkLogHandler) for h in logger.handlers):
        return
    os.makedirs(directory, exist_ok=True)
    handler = _SdkLogHandler(os.path.join(directory, f"ems-sdk-{os.getpid()}.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def connect_pool(config: EmsConfig, settings: Settings) -> PoolBackend:
    """The pool `settings` name (Mooncake, the embedded store, or pool nodes), connected: what `Ems.init` gives its
    `ContextCaching`, and what an engine plug-in with a client of its own opens (`ems.integrations.host_region`)."""
    if settings.pool_backend == PoolBackendKind.MOONCAKE and settings.mooncake is not None:
        from ems.backends.mooncake import MooncakePool  # Mooncake's client is needed only with this backend

        return MooncakePool(settings.mooncake, settings.pool_replicas, settings.connect_timeout_ms / 1000.0)
    if settings.embedded:
        # values come from this process's own checksummed staging: re-verifying them on put would only repeat work
        try:
            store = KvStore(
                settings.pool_capacity,
                verify_on_put=False,
                prefault_bytes=settings.pool_prefault,
                prefault_ahead=settings.pool_prefault_ahead,
            )
        except OSError as exc:  # the arena's address space could not be reserved
            raise invalid_argument(
                f"pool_capacity={settings.pool_capacity}: the embedded pool cannot reserve it: {exc}"
            ) from None
        return EmbeddedPool(store)
    try:
        require("ucxx", "ucx", "pool_nodes")  # UCX is needed only with remote nodes
    except MissingExtra as exc:
        raise EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, str(exc)) from exc
    from ems.transport.shm.client import ShmMode
    from ems.transport.ucx import config as ucx_config
    from ems.transport.ucx.remote import connect

    try:
        ucx_config.configure(settings.ucx)  # before the first connection starts UCX in this process
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None

    # a fixed node list, or the members etcd reports; a large list connected lazily
    from ems.backends.remote_pool import EAGER_CONNECT_NODES, open_remote_pool
    from ems.transport.ucx.client import UcxNode

    # (a node not connected yet connects on its first call, by itself); etcd's members always so
    def opener(open_node: Callable[..., NodeClient]) -> Callable[[str], NodeClient]:
        return lambda address: open_node(
            address,
            access_id=config.access_id,
            access_key=config.access_key,
            connect_timeout_ms=settings.connect_timeout_ms,
            shm=ShmMode(settings.pool_shm),
        )

    static = connect if len(settings.pool_nodes) <= EAGER_CONNECT_NODES else UcxNode
    return open_remote_pool(settings, opener(static), join=opener(UcxNode))


def _unreachable(settings: Settings) -> EmsException:
    if settings.mooncake is not None:
        return EmsException(
            EmsErrorCode.EMS_RECOVERD_ERROR,
            f"the Mooncake master {settings.mooncake.master} did not answer within {settings.connect_timeout_ms} ms; "
            "call Ems.init again later (Ems.check_health() turns True once it answers)",
        )
    return EmsException(
        EmsErrorCode.EMS_RECOVERD_ERROR,
        f"no pool node answered within {settings.connect_timeout_ms} ms: {list(settings.pool_nodes)}"
        + (f" (and those of etcd {settings.pool_etcd}, cluster {settings.pool_cluster!r})" if settings.pool_etcd else "")
        + "; the pool is "
        "not reachable yet: call Ems.init again later (Ems.check_health() turns True once a node answers)",
    )


class Ems:
    """Process-wide entry point of the SDK (class methods only)."""

    _lock = threading.Lock()
    _config: EmsConfig | None = None
    _settings: Settings | None = None
    _pool: PoolBackend | None = None
    _cc: ContextCaching | None = None
    # after an EMS_RECOVERD_ERROR: the config and its (not yet answering) pool, which check_health probes
    _pending: tuple[EmsConfig, PoolBackend] | None = None

    @classmethod
    def init(cls, config: EmsConfig) -> None:
        config = check_config(config)  # a checked snapshot: the caller may go on mutating its own objects
        with cls._lock:
            if cls._config is not None:
                if config == cls._config:
                    return
                raise invalid_argument(
                    "Ems.init was already called with a different config; call Ems.shutdown() first to init with another"
                )
            settings = resolve_settings(config)
            _configure_logging(settings.sdk_log_dir)
            pool = cls._take_pending(config)
            if pool is None:
                pool = connect_pool(config, settings)
            if not settings.embedded and not pool.healthy(settings.connect_timeout_ms / 1000.0):
                cls._pending = (config, pool)
                raise _unreachable(settings)
            cc_config = config.context_caching_config
            try:
                cls._cc = ContextCaching(cc_config, config.access_id, pool, settings) if cc_config is not None else None
            except BaseException:
                pool.close()
                raise
            cls._config, cls._settings, cls._pool = config, settings, pool
            logger.info("EMS initialised: pool %s", pool.describe())

    @classmethod
    def _take_pending(cls, config: EmsConfig) -> PoolBackend | None:
        """The pool of an earlier init that raised EMS_RECOVERD_ERROR, when the config is the same; else close it."""
        pending, cls._pending = cls._pending, None
        if pending is None:
            return None
        if pending[0] == config:
            return pending[1]
        pending[1].close()
        return None

    @classmethod
    def get_cc(cls) -> ContextCaching | None:
        return cls._cc

    @classmethod
    def check_health(cls) -> bool:
        """True while the pool is reachable. After an init that raised EMS_RECOVERD_ERROR it probes the configured
        nodes, so an engine can poll it and call `Ems.init` again once it is True. Never raises."""
        pool = cls._pool
        if pool is None and cls._pending is not None:
            pool = cls._pending[1]
        if pool is None:
            return False
        try:
            return pool.healthy(1.0)
        except Exception:  # a health probe reports, it never raises
            return False

    @classmethod
    def settings(cls) -> Settings | None:
        """The resolved pool settings (this package's addition), or None before init."""
        return cls._settings

    @classmethod
    def shutdown(cls) -> None:
        """Finish pending async calls, close connections and forget the config (this package's addition)."""
        with cls._lock:
            if cls._cc is not None:
                cls._cc.close()
            if cls._pool is not None:
                cls._pool.close()
            if cls._pending is not None:
                cls._pending[1].close()
            cls._config = cls._settings = cls._pool = cls._cc = cls._pending = None
