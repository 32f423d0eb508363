"""`python -m ems.pool` / `ems-pool`: run one pool node.

    ems-pool --listen HOST:PORT --capacity 4GiB [--keys-file PATH] [--log-level info]
             [--max-inflight SIZE] [--handshake-timeout S] [--stall-timeout S]
             [--max-connections N] [--max-connections-per-peer N] [--shm-bytes SIZE] [--shm-total SIZE]
             [--shm-tenant SIZE]
             [--etcd http://HOST:2379 [--cluster NAME] [--advertise HOST:PORT] [--lease-ttl S] [--drain S]
                                      [--replicas K] [--repair-rate SIZE] [--repair-interval S]]
             [--metrics HOST:PORT] [--prefault-ahead SIZE] [--disk DIR --disk-capacity SIZE [--disk-queue SIZE]]
    ems-pool status (--etcd URL [--cluster NAME] | --nodes METRICS_HOST:PORT,...) [--namespaces]   (see ems.pool.status)

Contract:
* Prints exactly one line to stdout when it serves, `ems-pool ready on HOST:PORT` (the real port when 0 was asked),
  and flushes it; logs go to stderr.
* Access keys: `--keys-file PATH` (lines `access_id:access_key`; blank lines and `#` comments skipped) and/or the
  environment variable EMS_POOL_KEYS (`id:key,id:key`; an id holding ',' needs the file). Never on the command
  line, where `ps` would show them. Ids are printable ASCII (`cc_kvstore@_@ds_default_ns_001` is fine).
  With no keys the node accepts anonymous clients.
* SIGTERM and SIGINT stop it cleanly (exit status 0). A bad option exits with status 2 and a message.
* `--listen HOST:PORT` binds there: a wildcard HOST (0.0.0.0, ::) listens on every interface; a specific address
  binds the UCX listener to it (`transport.ucx.listener`) and limits UCX's data connections to its interface
  (UCX_NET_DEVICES, unless set); when UCX cannot listen there, the node exits with status 1 and UCX's reason.
* Limits (`ems.pool.budget.NodeLimits`; docs/guides/node-limits.md): `--max-inflight` bytes of requests in flight, all
  connections together (default: the capacity up to 4 GiB, a quarter of it above 16 GiB, at least 64 MiB);
  `--handshake-timeout` (10 s) and `--stall-timeout` (30 s, the longest wait for the next frame of a started
  request); `--max-connections` (1024) and `--max-connections-per-peer` (64).
* Same-host shared memory (`ems.transport.shm`; docs/concepts/shared-memory.md): `--shm-bytes` per connection (default 256MiB;
  0 turns it off), `--shm-total` for all connections together (default 4GiB), `--shm-tenant` for one tenant's
  connections together (default: half of the total on a node with two or more keys, else the whole total). A region
  counts until the node has freed its pages, whatever its client does (`transport.shm.server`).
* `--prefault-ahead SIZE` (default 256MiB): the store's values live in one arena of the capacity, whose pages a
  background thread keeps faulted in that far ahead of the values (`ems.store.kv_store`), on spare CPU only (an engine on the
  same host keeps its cores: `ems.buffers.SpareCpuPacer`): a save into fresh memory otherwise faults page by page
  (about 2 ms per MiB on a VM, up to 14 for memory the VM's host has not backed yet). 0 turns it off.
* `--disk DIR --disk-capacity SIZE`: a disk tier behind DRAM (`ems.pool.tiered_store`, `ems.pool.disk`):
  values evicted from DRAM are written there, found there, and found again after a restart (the index is rebuilt
  from DIR before the ready line). A DIR that cannot be used at start exits with status 1; a disk that fails later
  turns the node DRAM-only. `--disk-queue`: bytes of evicted values waiting to be written (beyond them an eviction
  is dropped, never waited for).
* `--metrics HOST:PORT` serves Prometheus `/metrics` and `/healthz` (`ems.pool.metrics`; needs prometheus_client).
* `--etcd URL` registers the node in etcd under `--cluster` (`ems.cluster.membership`) before the ready line,
  as `--advertise` (default: the `--listen` host and the bound port); etcd unreachable at start exits with
  status 1. On SIGTERM/SIGINT the node first deregisters and reports `/healthz` 503, keeps serving for `--drain`
  seconds (so engines see it leave and calls in flight finish), then stops (`ems.pool.cluster_node`). A registered
  node repairs (`ems.pool.repair`): after membership changes it copies what it holds to owners lacking it
  (`--replicas`, the engines' pool_replicas), at most `--repair-rate` bytes per second (0: off).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ems.pool.budget import NodeLimits
    from ems.pool.handlers import NodeStore
    from ems.transport.shm import ShmSettings

_ID_RE = re.compile(r"[\x20-\x7e]{1,512}")  # printable ASCII, as EmsConfig.access_id (e.g. "cc_kvstore@_@ns_001")
_KEY_RE = re.compile(r"[0-9A-Za-z+/=]{32,256}")


def parse_keys(lines: Sequence[str], source: str) -> dict[str, str]:
    """`access_id:access_key` entries → {id: key}; ValueError naming the source and line on a bad entry."""
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        access_id, sep, access_key = line.rpartition(":")  # a key never holds ':', an id may
        if not sep or not _ID_RE.fullmatch(access_id) or not _KEY_RE.fullmatch(access_key):
            raise ValueError(
                f"{source} entry {number}: expected access_id:access_key with an id of 1-512 printable ASCII "
                "characters and a key of 32-256 characters of [0-9A-Za-z+/=]"
            )
        keys[access_id] = access_key
    return keys


def load_keys(keys_file: str | None) -> dict[str, str]:
    keys: dict[str, str] = {}
    if keys_file:
        with open(keys_file, encoding="utf-8") as f:
            keys.update(parse_keys(f.read().splitlines(), keys_file))
    from ems.settings import pool_keys_from_environment

    env = pool_keys_from_environment()
    if env.strip():
        keys.update(parse_keys(env.split(","), "EMS_POOL_KEYS"))
    return keys


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return number


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"--listen must be HOST:PORT (port 0 picks one), got {value!r}")
    return host.strip("[]"), int(port)


async def _run(
    host: str,
    port: int,
    capacity: int,
    keys: dict[str, str],
    limits: NodeLimits,
    args: argparse.Namespace,
    shm: ShmSettings,
) -> int:
    """Serve until SIGTERM/SIGINT; the exit status (1 when it cannot listen, register or serve metrics)."""
    from ems.pool.cluster_node import NodeExtras
    from ems.pool.node import assemble

    try:
        store = _build_store(capacity, args)
    except OSError as error:
        print(f"ems-pool: cannot use --disk {args.disk}: {error}", file=sys.stderr, flush=True)
        return 1
    extras = NodeExtras(store, args, keys)
    server = assemble(store, keys, limits, metrics=extras.metrics, shm=shm)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        bound = await server.start(port, host)
    except OSError as error:
        print(f"ems-pool: cannot listen on {host}:{port}: {error}", file=sys.stderr, flush=True)
        await server.stop()
        return 1
    logging.getLogger("ems.pool").info(
        "serving %s bytes, %s", capacity, f"{len(keys)} tenant keys" if keys else "anonymous clients accepted"
    )
    try:
        extras.start(f"{host}:{bound}")
    except Exception as error:  # e.g. etcd unreachable, metrics port taken
        print(f"ems-pool: cannot serve: {error}", file=sys.stderr, flush=True)
        extras.close()
        await server.stop()
        return 1
    print(f"ems-pool ready on {host}:{bound}", flush=True)
    try:
        await stop.wait()
        await extras.drain()
    finally:
        extras.close()
        await server.stop()
        close = getattr(store, "close", None)
        if close is not None:
            close()
        try:
            import ucxx

            ucxx.stop_notifier_thread()
        except Exception:  # nothing to stop
            pass
        logging.getLogger("ems.pool").info("stopped")
    return 0


def _build_store(capacity: int, args: argparse.Namespace) -> NodeStore:
    """The node's store: DRAM only, or DRAM in front of a disk tier (`--disk`), whose index is rebuilt from the
    disk before the node serves. OSError when the disk directory cannot be used."""
    from ems.store.kv_store import KvStore

    ahead = args.prefault_ahead  # bytes (checked with the other sizes)
    if args.disk is None:
        return KvStore(capacity, prefault_ahead=ahead)
    from ems.pool.disk import DiskTier
    from ems.pool.tiered_store import TieredStore

    disk = DiskTier(args.disk, args.disk_capacity, args.disk_queue)
    disk.open()
    return TieredStore(capacity, disk, prefault_ahead=ahead)


def _device_of(host: str) -> str | None:
    """The network interface that holds IPv4 address `host` (Linux), or None."""
    import fcntl
    import socket
    import struct

    try:
        wanted = socket.inet_aton(host)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if answer[20:24] == wanted:
                return name
    return None


def _restrict_ucx_devices(host: str) -> None:
    """For a specific listen address, UCX's data connections use only that address's interface (UCX_NET_DEVICES,
    unless the environment sets it): otherwise UCX opens a listening socket on every interface for them."""
    from ems.transport.ucx.server import WILDCARD_HOSTS

    if host in WILDCARD_HOSTS or "UCX_NET_DEVICES" in os.environ:
        return
    device = _device_of(host)
    if device is not None:
        os.environ["UCX_NET_DEVICES"] = device


def _tune_malloc() -> None:
    """glibc: allocations of 128 KiB and more get their own mapping, returned to the system when freed, and two
    arenas at most. By default the mmap threshold rises to the largest block freed so far (up to 32 MiB), so the
    MiB-sized value buffers a node churns through end up in fragmented heaps it never returns: measured on a
    256 MiB node under mixed load, 66 MiB less resident memory at rest with this (docs/guides/node-limits.md)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MALLOC_MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc: keep its defaults
        pass


MALLOC_MMAP_THRESHOLD = 128 << 10


def _disk_options(args: argparse.Namespace, capacity: int) -> None:
    """Check the disk tier's options and turn their sizes into bytes (ValueError on a bad one)."""
    from ems.config import parse_size

    if args.disk is None:
        if args.disk_capacity is not None or args.disk_queue is not None:
            raise ValueError("--disk-capacity and --disk-queue need --disk DIR")
        return
    if args.disk_capacity is None:
        raise ValueError("--disk DIR needs --disk-capacity SIZE")
    args.disk_capacity = parse_size("--disk-capacity", args.disk_capacity)
    if args.disk_capacity <= 0:
        raise ValueError("--disk-capacity must be > 0")
    if args.disk_queue is None:
        args.disk_queue = min(max(capacity // 4, DISK_QUEUE_MIN), DISK_QUEUE_MAX)
    else:
        args.disk_queue = parse_size("--disk-queue", args.disk_queue)
        if args.disk_queue <= 0:
            raise ValueError("--disk-queue must be > 0")


DISK_QUEUE_MIN = 32 << 20
DISK_QUEUE_MAX = 1 << 30

STATUS_EPILOG = """\
the operator's view of running nodes (needs the metrics extra):
  ems-pool status (--etcd URL [--cluster NAME] | --nodes METRICS_HOST:PORT,...)
      one line per node: state, fill, values, hit rate, requests per second,
      repair; read from the nodes' --metrics endpoints (ems-pool status --help)
  ems-pool status ... --namespaces
      per tenant, the key namespaces the pool holds: what each is made of
      (model, dtype, parallelism, layout, ...), values, hit rates, and which
      parts differ between namespaces of one model"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from ems.extras import MissingExtra, require

    if argv[:1] == ["status"]:
        try:
            require("prometheus_client", "metrics", "ems-pool status")
        except MissingExtra as error:
            print(f"ems-pool: {error}", file=sys.stderr)
            return 2
        from ems.pool.status import main as status_main

        return status_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="ems-pool",
        description="An EMS memory-pool node (UCX).",
        epilog=STATUS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--listen", type=_parse_listen, default=("0.0.0.0", 0), help="HOST:PORT (port 0: pick one)")
    parser.add_argument("--capacity", default="1GiB", help="bytes this node holds, e.g. 512MiB, 4GiB")
    parser.add_argument("--keys-file", default=None, help="file of access_id:access_key lines")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--max-inflight", default=None, help="bytes of requests in flight (default: see docs)")
    parser.add_argument("--handshake-timeout", type=_positive_float, default=10.0, help="seconds (default 10)")
    parser.add_argument(
        "--stall-timeout", type=_positive_float, default=30.0, help="seconds between frames of a request (default 30)"
    )
    parser.add_argument("--max-connections", type=_positive_int, default=1024, help="connections in all")
    parser.add_argument("--max-connections-per-peer", type=_positive_int, default=64, help="per peer IP address")
    parser.add_argument("--shm-bytes", default="256MiB", help="shared memory per same-host connection (0: off)")
    parser.add_argument("--shm-total", default="4GiB", help="shared memory of all connections together")
    parser.add_argument(
        "--shm-tenant",
        default=None,
        help="shared memory of one tenant's connections together (default: half of --shm-total with two or more "
        "keys, else all of it)",
    )
    parser.add_argument(
        "--prefault-ahead",
        default="256MiB",
        help="bytes of DRAM kept faulted in ahead of the values, in the background (0: fault on first write)",
    )
    parser.add_argument("--disk", default=None, help="directory of a disk tier behind DRAM (see docs/guides/disk-tier.md)")
    parser.add_argument("--disk-capacity", default=None, help="bytes the disk tier may use, e.g. 100GiB (with --disk)")
    parser.add_argument(
        "--disk-queue",
        default=None,
        help="bytes of evicted values waiting to be written (default: a quarter of --capacity, 32 MiB to 1 GiB)",
    )
    from ems.pool.cluster_node import add_arguments

    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        require("ucxx", "ucx", "ems-pool")
        if args.metrics is not None:
            require("prometheus_client", "metrics", "ems-pool --metrics")
    except MissingExtra as error:
        parser.error(str(error))
    from ems.transport.ucx.config import UcxSettings, configure

    try:
        configure(UcxSettings.from_env())  # the node's EMS_UCX_* settings: read once, here
    except ValueError as error:
        parser.error(str(error))
    host, port = args.listen
    _restrict_ucx_devices(host)

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s ems-pool %(levelname)s %(message)s")
    from ems.config import parse_size
    from ems.errors import EmsException
    from ems.settings import host_copy_settings

    try:
        host_copy_settings()  # EMS_HOST_COPY / EMS_CACHE_DIR checked at start, not at the first value
        capacity = parse_size("--capacity", args.capacity)
        if capacity <= 0:
            raise ValueError("--capacity must be > 0")
        keys = load_keys(args.keys_file)
        from ems.pool.budget import NodeLimits

        limits = NodeLimits.for_capacity(
            capacity,
            handshake_timeout_s=args.handshake_timeout,
            stall_timeout_s=args.stall_timeout,
            max_connections=args.max_connections,
            max_connections_per_peer=args.max_connections_per_peer,
        )
        if args.max_inflight is not None:
            inflight = parse_size("--max-inflight", args.max_inflight)
            if inflight <= 0:
                raise ValueError("--max-inflight must be > 0")
            limits = dataclasses.replace(limits, inflight_bytes=inflight)
        from ems.transport.shm import ShmSettings

        shm_total = parse_size("--shm-total", args.shm_total)
        shm_tenant = (
            ShmSettings.default_tenant_bytes(shm_total, len(keys))
            if args.shm_tenant is None
            else parse_size("--shm-tenant", args.shm_tenant)
        )
        shm = ShmSettings(parse_size("--shm-bytes", args.shm_bytes), shm_total, shm_tenant)
        if shm.enabled and shm.tenant_share < shm.region_bytes:
            raise ValueError(f"--shm-tenant ({shm.tenant_share} bytes) must hold at least one region (--shm-bytes)")
        args.prefault_ahead = parse_size("--prefault-ahead", args.prefault_ahead)
        args.repair_rate = parse_size("--repair-rate", args.repair_rate)
        if args.replicas < 1 or args.repair_rate < 0 or not args.repair_interval > 0:
            raise ValueError("--replicas must be >= 1, --repair-rate >= 0 and --repair-interval > 0")
        _disk_options(args, capacity)
    except (EmsException, ValueError, OSError) as error:
        parser.error(str(error))
    _tune_malloc()
    status = asyncio.run(_run(host, port, capacity, keys, limits, args, shm))
    # Listener and connections are closed; UCX's own threads would keep the interpreter from exiting.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
