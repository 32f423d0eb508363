"""`python -m ems.pool` / `ems-pool`: run one pool node.

    ems-pool --listen HOST:PORT --capacity 4GiB [--keys-file PATH] [--log-level info]
             [--max-inflight SIZE] [--handshake-timeout S] [--stall-timeout S]
             [--max-connections N] [--max-connections-per-peer N] [--shm-bytes SIZE] [--shm-total SIZE]
             [--shm-tenant SIZE] [--lookup-port PORT|off]
             [--etcd http://HOST:2379 [--cluster NAME] [--advertise HOST:PORT] [--lease-ttl S] [--drain S]
                                      [--replicas K] [--repair-rate SIZE] [--repair-interval S]]
             [--metrics HOST:PORT] [--prefault-ahead SIZE] [--disk DIR --disk-capacity SIZE [--disk-queue SIZE]]
    ems-pool status (--etcd URL [--cluster NAME] | --nodes METRICS_HOST:PORT,...) [--namespaces]   (see ems.pool.status)

Contract:
* Prints exactly one line to stdout when it serves, `ems-pool ready on HOST:PORT` (the real port when 0 was asked),
  and flushes it; logs go to stderr.
* SIGTERM and SIGINT stop it cleanly (exit status 0). A bad option exits with status 2 and a message.
* `--listen HOST:PORT` binds there: a wildcard HOST (0.0.0.0, ::) listens on every interface; a specific address
  binds the UCX listener to it (`transport.ucx.listener`) and limits UCX's data connections to its interface
  (UCX_NET_DEVICES, unless set); when UCX cannot listen there, the node exits with status 1 and UCX's reason.
* The options, their defaults and checks, and the access keys (`--keys-file`, EMS_POOL_KEYS): `ems.pool.options`.
* `--disk DIR`: a DIR that cannot be used at start exits with status 1; a disk that fails later turns the node
  DRAM-only (`ems.pool.tiered_store`).
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
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ems.pool.options import NodeOptions, build_parser, resolve_options

if TYPE_CHECKING:
    from ems.pool.node_store import NodeStore


async def _run(host: str, port: int, options: NodeOptions, args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the exit status (1 when it cannot listen, register or serve metrics)."""
    capacity, keys, limits, shm = options.capacity, options.keys, options.limits, options.shm
    from ems.pool.cluster_node import NodeExtras
    from ems.pool.node import assemble

    try:
        store = _build_store(capacity, args)
    except OSError as error:
        print(f"ems-pool: cannot use --disk {args.disk}: {error}", file=sys.stderr, flush=True)
        return 1
    extras = NodeExtras(store, args, keys)
    server = assemble(store, keys, limits, metrics=extras.metrics, shm=shm, lookups=options.lookups)
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
    from ems.transport.handler import WILDCARD_HOSTS

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
    parser = build_parser()
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
    from ems.errors import EmsException

    try:
        options = resolve_options(args)
    except (EmsException, ValueError, OSError) as error:
        parser.error(str(error))
    _tune_malloc()
    status = asyncio.run(_run(host, port, options, args))
    # Listener and connections are closed; UCX's own threads would keep the interpreter from exiting.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
