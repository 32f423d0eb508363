"""Settings: every setting this package reads, resolved once, and the one place the package reads its environment.

`Settings` is resolved once at `Ems.init` (`resolve_settings`, from the `EmsConfig` of `ems.config`): a pool setting
given to `EmsConfig` wins, else its environment variable, else its default (an error names the environment variable
when the value came from there, else the setting); the process settings (`chunk_bytes`, `profiling`, `sdk_log_dir`,
`pool_shm`, `host_copy`, `cache_dir`, `ucx`) come from the environment only, and the `mooncake_*` settings become
`Settings.mooncake` with `pool_backend="mooncake"`. Each setting, its variable and its default are in
docs/reference/configuration.md's table, the one list of them (tests/test_docs.py checks it against the code both
ways). Nothing re-reads them later: to change one, call `Ems.shutdown()` and `Ems.init` again (UCX's, which are
process-wide, hold from the first UCX connection on; the compiled host copy's, `host_copy_settings`, from its first
use).

This module is the one place the package reads its environment (tests/test_settings_home.py holds the code to it):
`resolve_settings` for an SDK process, and for the parts that run before or without `Ems.init`:
`host_copy_settings` (the compiled host copy, built on first use, in engines and pool nodes alike),
`pool_keys_from_environment` (a pool node's `EMS_POOL_KEYS`), `local_pool_dir_from_environment` and
`access_key_from_environment` (the vLLM connector's). What reads its own environment elsewhere, and why, is listed
in that test (UCX's and Triton's own variables, the C compiler's `CC`).

`device` default: the registered KV cache's device; else `npu:<device_id>` when torch_npu is already imported,
`cuda:<device_id>` when CUDA is available, otherwise `cpu`.

With `pool_backend="mooncake"` the pool is a Mooncake Store deployment (`ems.backends.mooncake`, docs/guides/mooncake.md):
`pool_replicas` is then Mooncake's `replica_num`; `pool_nodes`, `pool_etcd` and `read_cache_capacity` do not apply
(giving nodes or etcd with it is refused).

With `pool_etcd` the pool is the nodes registered in etcd under `pool_cluster`, plus any `pool_nodes` (always in
the set); see `ems.cluster` and docs/guides/pool-nodes.md.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from typing import cast

from ems.config import EmsConfig, check_int, parse_size
from ems.errors import invalid_argument
from ems.transport.ucx.config import UcxSettings

# perf/RESULTS.md ("A save that encodes while it gathers"): since a save's gather and encode are one pass on the
# calling thread, a request of two chunks or more overlaps it with the node's copy and check of the chunk before
# (32 and 48 MiB requests to a node on the same host saved 10-25% faster in 16 MiB chunks than in one or two), while
# chunks of 4 MiB and less lose to per-request costs; PIPELINE_DEPTH (ems.datapath.jobs) x 16 MiB stays within the smallest
# default in-flight budget of a node (64 MiB: a chunk never waits)
DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_MAX_INFLIGHT = 8  # async calls pending at once (`max_inflight`)


class KernelBackend(str, enum.Enum):
    """Which implementation moves the bytes (`EMS_KERNEL_BACKEND`): a setting's values, here with the settings
    (`ems.kernels.base` re-exports it for the copy backends), so this module imports nothing of the kernels."""

    AUTO = "auto"  # Triton on cuda/npu; on CPU the compiled host loop where it builds, else torch
    TRITON = "triton"  # Triton kernels; on CPU tensors this is the (slow) Triton interpreter
    HOST = "host"  # one compiled C loop per request (CPU only; host_backend.py)
    TORCH = "torch"  # vectorised torch indexing
    MEMCPY = "memcpy"  # one copy per (block or run, plane), as engines without kernels do it


class PoolBackendKind(str, enum.Enum):
    """Which pool `Ems.init` opens (`pool_backend`)."""

    EMS = "ems"  # the embedded store, or `ems.pool` nodes
    MOONCAKE = "mooncake"  # a Mooncake Store deployment


@dataclass(frozen=True)
class Settings:
    """The pool settings after environment variables and defaults are applied, all checked."""

    pool_nodes: tuple[str, ...]
    pool_capacity: int
    read_cache_capacity: int
    staging_capacity: int
    max_inflight: int
    kernel_backend: KernelBackend
    connect_timeout_ms: int
    device: str | None = None
    pool_etcd: str | None = None
    pool_cluster: str = "default"
    pool_replicas: int = 1
    pool_hedge: bool = True  # with replicas: reads hedged around slow nodes (ems.backends.reads)
    pool_prefault: int = 0  # embedded pool: bytes of its arena pre-faulted at start-up (see ems.store.kv_store)
    pool_prefault_ahead: int = 256 << 20  # embedded pool: bytes kept faulted in ahead of use, in the background
    pool_backend: PoolBackendKind = PoolBackendKind.EMS
    mooncake: MooncakeSettings | None = None  # with pool_backend mooncake
    # process settings: environment only (see the module docstring)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    profiling: bool = False
    sdk_log_dir: str | None = None
    pool_shm: str = "auto"  # "auto": shared memory with a node on this host; "off": always UCX
    host_copy: str = "auto"  # "auto": the compiled host copy where it builds; "off": torch and numpy ops
    cache_dir: str = ""  # where the compiled host copy is kept ("" until resolved: `host_copy_settings`)
    ucx: UcxSettings = field(default_factory=UcxSettings)

    @property
    def embedded(self) -> bool:
        return not self.pool_nodes and self.pool_etcd is None and self.pool_backend == PoolBackendKind.EMS


@dataclass(frozen=True)
class MooncakeSettings:
    """How to reach a Mooncake Store deployment (the `mooncake_*` settings, checked)."""

    master: str  # "host:port" of mooncake_master
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    devices: str = ""
    hostname: str = "127.0.0.1"
    buffer_bytes: int = 64 << 20
    segment_bytes: int = 0


def _setting(name: str, value: object, env: str, default: object) -> tuple[object, str]:
    """A pool setting's value (the `EmsConfig` keyword, else its environment variable, else the default) and the name
    its error messages give it: the variable the user set when the value came from the environment (`EMS_X (name)`),
    else the setting's name."""
    if value is not None:
        return value, name
    from_env = os.environ.get(env)
    return (from_env, f"{env} ({name})") if from_env not in (None, "") else (default, name)


def _parse_node(label: str, node: object) -> str:
    """One entry of pool_nodes, `label` naming it in errors (`pool_nodes[0]`, `EMS_POOL_NODES (pool_nodes[0])`)."""
    if not isinstance(node, str):
        raise invalid_argument(f"{label} must be a 'host:port' string, got {node!r}")
    host, sep, port = node.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise invalid_argument(f"{label} must be 'host:port' with a port in 1..65535, got {node!r}")
    return f"{host.strip('[]')}:{int(port)}"


def _int_setting(setting: tuple[object, str], minimum: int) -> int:
    """An int setting (`_setting`'s value and name) of at least `minimum`; a string of digits is read as one."""
    value, name = setting
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    check_int(name, value, minimum)
    return cast(int, value)  # _check_int let only ints through


def _size_setting(setting: tuple[object, str], positive: bool = False) -> int:
    """A size setting (`_setting`'s value and name): `parse_size`, and more than 0 where `positive`."""
    value, name = setting
    size = parse_size(name, value)
    if positive and size <= 0:
        raise invalid_argument(f"{name} must be > 0")
    return size


def resolve_settings(config: EmsConfig) -> Settings:
    """Apply environment variables and defaults to `config`'s pool settings, checking each one. An error names the
    environment variable when the value came from there, else the setting (`_setting`)."""
    nodes_value, nodes_name = _setting("pool_nodes", config.pool_nodes, "EMS_POOL_NODES", [])
    if isinstance(nodes_value, str):
        nodes_value = [n for n in nodes_value.split(",") if n.strip()]
    if not isinstance(nodes_value, (list, tuple)):
        raise invalid_argument(f"{nodes_name} must be a list of 'host:port' strings, got {nodes_value!r}")
    from_env = nodes_name != "pool_nodes"
    nodes = tuple(
        _parse_node(f"EMS_POOL_NODES (pool_nodes[{i}])" if from_env else f"pool_nodes[{i}]", n) for i, n in enumerate(nodes_value)
    )
    if len(set(nodes)) != len(nodes):
        raise invalid_argument(f"{nodes_name} lists a node twice: {list(nodes)}")
    backend_value, backend_name = _setting("kernel_backend", config.kernel_backend, "EMS_KERNEL_BACKEND", "auto")
    try:
        backend = KernelBackend(str(backend_value).lower())
    except ValueError:
        choices = ", ".join(k.value for k in KernelBackend)
        raise invalid_argument(f"{backend_name} must be one of {choices}, got {backend_value!r}") from None
    device, device_name = _setting("device", config.device, "EMS_DEVICE", None)
    if device is not None and not isinstance(device, str):
        raise invalid_argument(f"{device_name} must be a device string such as 'cpu' or 'npu:0', got {device!r}")
    settings = Settings(
        pool_nodes=nodes,
        pool_capacity=_size_setting(_setting("pool_capacity", config.pool_capacity, "EMS_POOL_CAPACITY", "1GiB"), positive=True),
        read_cache_capacity=_size_setting(
            _setting("read_cache_capacity", config.read_cache_capacity, "EMS_READ_CACHE_CAPACITY", "256MiB")
        ),
        staging_capacity=_size_setting(
            _setting("staging_capacity", config.staging_capacity, "EMS_STAGING_CAPACITY", "512MiB"), positive=True
        ),
        max_inflight=_int_setting(_setting("max_inflight", config.max_inflight, "EMS_MAX_INFLIGHT", DEFAULT_MAX_INFLIGHT), 1),
        kernel_backend=backend,
        connect_timeout_ms=_int_setting(
            _setting("connect_timeout_ms", config.connect_timeout_ms, "EMS_CONNECT_TIMEOUT_MS", 3000), 1
        ),
        device=device,
        **_cluster_settings(config),
        pool_prefault=_size_setting(_setting("pool_prefault", config.pool_prefault, "EMS_POOL_PREFAULT", 0)),
        pool_prefault_ahead=_size_setting(
            _setting("pool_prefault_ahead", config.pool_prefault_ahead, "EMS_POOL_PREFAULT_AHEAD", "256MiB")
        ),
        **_backend_settings(config),
        **_process_settings(),
    )
    if settings.pool_backend == PoolBackendKind.MOONCAKE and (settings.pool_nodes or settings.pool_etcd):
        backend_name = _setting("pool_backend", config.pool_backend, "EMS_POOL_BACKEND", "ems")[1]
        etcd_name = _setting("pool_etcd", config.pool_etcd, "EMS_POOL_ETCD", None)[1]
        given = [f"{nodes_name}={list(nodes)}"] if nodes else []
        given += [f"{etcd_name}={settings.pool_etcd!r}"] if settings.pool_etcd else []
        raise invalid_argument(
            f"{backend_name} is 'mooncake', which places blocks itself: give no pool_nodes or pool_etcd with it "
            f"(got {', '.join(given)})"
        )
    return settings


def _process_settings() -> dict:
    """chunk_bytes, profiling, sdk_log_dir, pool_shm, host_copy, cache_dir, ucx: from the environment only, checked."""
    chunk = os.environ.get("EMS_CHUNK_BYTES", "").strip()
    host_copy = host_copy_settings()
    try:
        ucx = UcxSettings.from_env()
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    return {
        "chunk_bytes": parse_size("EMS_CHUNK_BYTES", chunk) if chunk else DEFAULT_CHUNK_BYTES,
        "profiling": os.environ.get("ENABLE_CC_PROFILING") == "1",
        "sdk_log_dir": os.environ.get("EMS_SDK_LOG") or None,
        "pool_shm": _shm_setting(os.environ.get("EMS_POOL_SHM") or "auto"),
        "host_copy": host_copy.mode,
        "cache_dir": host_copy.cache_dir,
        "ucx": ucx,
    }


def _shm_setting(value: str) -> str:
    mode = value.strip().lower()
    if mode not in ("auto", "off"):
        raise invalid_argument(f"EMS_POOL_SHM must be 'auto' or 'off', got {value!r}")
    return mode


_HOST_COPY_OFF = ("off", "0", "false", "no")


@dataclass(frozen=True)
class HostCopySettings:
    """The compiled host copy's settings (`ems.kernels.host_copy`): `EMS_HOST_COPY` and `EMS_CACHE_DIR`."""

    mode: str  # "auto" or "off"
    cache_dir: str  # EMS_CACHE_DIR, else $XDG_CACHE_HOME/ems, else ~/.cache/ems

    @property
    def enabled(self) -> bool:
        return self.mode == "auto"


def host_copy_settings() -> HostCopySettings:
    """`EMS_HOST_COPY` (`auto`, or `off`: also 0, false, no) and `EMS_CACHE_DIR`, checked. Read where the compiled
    copy is first used (an engine's first copy, a pool node's first value), which may come before `Ems.init`."""
    value = (os.environ.get("EMS_HOST_COPY") or "auto").strip().lower()
    if value not in ("auto", *_HOST_COPY_OFF):
        raise invalid_argument(f"EMS_HOST_COPY must be 'auto' or 'off', got {value!r}")
    cache_dir = os.environ.get("EMS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ems"
    )
    return HostCopySettings("off" if value in _HOST_COPY_OFF else "auto", cache_dir)


def pool_keys_from_environment() -> str:
    """A pool node's `EMS_POOL_KEYS` (`id:key,id:key`), read once when it starts; "" when unset."""
    return os.environ.get("EMS_POOL_KEYS", "")


def local_pool_dir_from_environment() -> str | None:
    """`EMS_LOCAL_POOL_DIR`: where the vLLM connector records the host's local pool node; None when unset."""
    return os.environ.get("EMS_LOCAL_POOL_DIR") or None


def access_key_from_environment() -> str | None:
    """`EMS_ACCESS_KEY`: the vLLM connector's tenant key when its config names an `access_id` but no key."""
    return os.environ.get("EMS_ACCESS_KEY") or None


_CLUSTER_RE = re.compile(r"[0-9a-z._-]{1,512}")


def _cluster_settings(config: EmsConfig) -> dict:
    """pool_etcd, pool_cluster, pool_replicas, pool_hedge, checked."""
    etcd, etcd_name = _setting("pool_etcd", config.pool_etcd, "EMS_POOL_ETCD", None)
    if etcd is not None:
        from ems.cluster.etcd import parse_url

        try:
            parse_url(etcd if isinstance(etcd, str) else "")
        except ValueError:
            raise invalid_argument(f"{etcd_name} must be an etcd endpoint like 'http://127.0.0.1:2379', got {etcd!r}") from None
    cluster, cluster_name = _setting("pool_cluster", config.pool_cluster, "EMS_POOL_CLUSTER", "default")
    if not isinstance(cluster, str) or _CLUSTER_RE.fullmatch(cluster) is None:
        raise invalid_argument(f"{cluster_name} must be 1-512 characters of [0-9a-z._-] (an etcd key part), got {cluster!r}")
    replicas = _int_setting(_setting("pool_replicas", config.pool_replicas, "EMS_POOL_REPLICAS", 1), 1)
    hedge, hedge_name = _setting("pool_hedge", config.pool_hedge, "EMS_POOL_HEDGE", "on")
    if isinstance(hedge, str) and hedge.strip().lower() in ("on", "off"):
        hedge = hedge.strip().lower() == "on"
    if not isinstance(hedge, bool):
        raise invalid_argument(f"{hedge_name} must be 'on' or 'off' (or a bool), got {hedge!r}")
    return {"pool_etcd": etcd, "pool_cluster": cluster, "pool_replicas": replicas, "pool_hedge": hedge}


_PROTOCOL_RE = re.compile(r"[0-9a-z_]{1,64}")


def _backend_settings(config: EmsConfig) -> dict:
    """pool_backend and, for Mooncake, the mooncake_* settings, checked."""
    value, backend_name = _setting("pool_backend", config.pool_backend, "EMS_POOL_BACKEND", "ems")
    try:
        backend = PoolBackendKind(str(value).strip().lower())
    except ValueError:
        raise invalid_argument(f"{backend_name} must be 'ems' or 'mooncake', got {value!r}") from None
    if backend != PoolBackendKind.MOONCAKE:
        return {"pool_backend": backend}
    master, master_name = _setting("mooncake_master", config.mooncake_master, "EMS_MOONCAKE_MASTER", None)
    if master is None:
        raise invalid_argument("pool_backend='mooncake' needs mooncake_master (EMS_MOONCAKE_MASTER), 'host:port'")
    host, sep, port = master.strip().rpartition(":") if isinstance(master, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise invalid_argument(f"{master_name} must be 'host:port' with a port in 1..65535, got {master!r}")
    master = f"{host}:{int(port)}"
    texts = {}
    names = {}
    for name, env, default in (
        ("mooncake_metadata", "EMS_MOONCAKE_METADATA", "P2PHANDSHAKE"),
        ("mooncake_protocol", "EMS_MOONCAKE_PROTOCOL", "tcp"),
        ("mooncake_devices", "EMS_MOONCAKE_DEVICES", ""),
        ("mooncake_hostname", "EMS_MOONCAKE_HOSTNAME", "127.0.0.1"),
    ):
        text, names[name] = _setting(name, getattr(config, name), env, default)
        if not isinstance(text, str) or not text.isprintable() or (not text and name != "mooncake_devices"):
            raise invalid_argument(f"{names[name]} must be a non-empty printable string, got {text!r}")
        texts[name] = text.strip()
    protocol = texts["mooncake_protocol"].lower()
    if _PROTOCOL_RE.fullmatch(protocol) is None:
        raise invalid_argument(f"{names['mooncake_protocol']} must be a protocol name such as 'tcp' or 'rdma', got {protocol!r}")
    mooncake = MooncakeSettings(
        master=master,
        metadata=texts["mooncake_metadata"],
        protocol=protocol,
        devices=texts["mooncake_devices"],
        hostname=texts["mooncake_hostname"],
        buffer_bytes=_size_setting(
            _setting("mooncake_buffer", config.mooncake_buffer, "EMS_MOONCAKE_BUFFER", "64MiB"), positive=True
        ),
        segment_bytes=_size_setting(_setting("mooncake_segment", config.mooncake_segment, "EMS_MOONCAKE_SEGMENT", 0)),
    )
    return {"pool_backend": backend, "mooncake": mooncake}
