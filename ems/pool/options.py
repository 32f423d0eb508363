"""`ems-pool`'s command line (`ems.pool.__main__` runs the node): its options, their checks, and the access keys.

Contract: `build_parser()` is the node's argument parser (the cluster options from `ems.pool.cluster_node`);
`resolve_options(args)` checks the parsed options and turns them into a `NodeOptions` (sizes in bytes; ValueError,
EmsException or OSError naming the option on a bad one: the caller exits with status 2 and the message), leaving
the disk tier's and repair's sizes in `args` as bytes. Option by option:
* Access keys (`load_keys`, `parse_keys`): `--keys-file PATH` (lines `access_id:access_key`; blank lines and `#`
  comments skipped) and/or the environment variable EMS_POOL_KEYS (`id:key,id:key`; an id holding ',' needs the
  file). Never on the command line, where `ps` would show them. Ids are printable ASCII
  (`cc_kvstore@_@ds_default_ns_001` is fine). With no keys the node accepts anonymous clients.
* Limits (`ems.pool.budget.NodeLimits`; docs/guides/node-limits.md): `--max-inflight` bytes of requests in flight, all
  connections together (default: the capacity up to 4 GiB, a quarter of it above 16 GiB, at least 64 MiB);
  `--handshake-timeout` (10 s) and `--stall-timeout` (30 s, the longest wait for the next frame of a started
  request); `--max-connections` (1024) and `--max-connections-per-peer` (64).
* Same-host shared memory (`ems.transport.shm`; docs/concepts/shared-memory.md): `--shm-bytes` per connection (default
  256MiB; 0 turns it off), `--shm-total` for all connections together (default 4GiB), `--shm-tenant` for one tenant's
  connections together (default: half of the total on a node with two or more keys, else the whole total). A region
  counts until the node has freed its pages, whatever its client does (`transport.shm.server`).
* Lookup channels (`ems.transport.tcp`; docs/concepts/transport.md): `--lookup-port PORT`, the TCP port a client's
  lookups (EXISTS) may take beside its UCX connection (default 0: any free port, which clients are told; `off`: none,
  lookups go over UCX). A firewall between clients and nodes must let it through, as it does the UCX port.
* `--prefault-ahead SIZE` (default 256MiB): the store's values live in one arena of the capacity, whose pages a
  background thread keeps faulted in that far ahead of the values (`ems.store.kv_store`), on spare CPU only (an engine
  on the same host keeps its cores: `ems.buffers.SpareCpuPacer`): a save into fresh memory otherwise faults page by
  page (about 2 ms per MiB on a VM, up to 14 for memory the VM's host has not backed yet). 0 turns it off.
* `--disk DIR --disk-capacity SIZE` (`_disk_options`): a disk tier behind DRAM (`ems.pool.tiered_store`,
  `ems.pool.disk`): values evicted from DRAM are written there, found there, and found again after a restart (the
  index is rebuilt from DIR before the ready line). `--disk-queue`: bytes of evicted values waiting to be written
  (beyond them an eviction is dropped, never waited for).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where used: `ems-pool --help` and `status` load no transport)
    from ems.pool.budget import NodeLimits
    from ems.transport.shm import ShmSettings
    from ems.transport.tcp.wire import LookupSettings

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


def build_parser() -> argparse.ArgumentParser:
    """The node's argument parser (`ems-pool --help`)."""
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
        "--lookup-port",
        default="0",
        help="TCP port of the connections' lookup channels (0: any free port, the default; off: none)",
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
    return parser


@dataclasses.dataclass(frozen=True)
class NodeOptions:
    """The checked options a node runs with (sizes in bytes)."""

    capacity: int
    keys: dict[str, str]
    limits: NodeLimits
    shm: ShmSettings
    lookups: LookupSettings


def resolve_options(args: argparse.Namespace) -> NodeOptions:
    """Check the parsed options (see the module docstring); ValueError, EmsException or OSError on a bad one."""
    from ems.config import parse_size
    from ems.pool.budget import NodeLimits
    from ems.settings import host_copy_settings
    from ems.transport.shm import ShmSettings
    from ems.transport.tcp.wire import LookupSettings

    host_copy_settings()  # EMS_HOST_COPY / EMS_CACHE_DIR checked at start, not at the first value
    capacity = parse_size("--capacity", args.capacity)
    if capacity <= 0:
        raise ValueError("--capacity must be > 0")
    keys = load_keys(args.keys_file)
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
    shm_total = parse_size("--shm-total", args.shm_total)
    shm_tenant = (
        ShmSettings.default_tenant_bytes(shm_total, len(keys))
        if args.shm_tenant is None
        else parse_size("--shm-tenant", args.shm_tenant)
    )
    shm = ShmSettings(parse_size("--shm-bytes", args.shm_bytes), shm_total, shm_tenant)
    if shm.enabled and shm.tenant_share < shm.region_bytes:
        raise ValueError(f"--shm-tenant ({shm.tenant_share} bytes) must hold at least one region (--shm-bytes)")
    if args.lookup_port == "off":
        lookups = LookupSettings(port=None)
    elif args.lookup_port.isdigit() and int(args.lookup_port) <= 0xFFFF:
        lookups = LookupSettings(port=int(args.lookup_port))
    else:
        raise ValueError(f"--lookup-port must be a TCP port (0-65535) or off, not {args.lookup_port!r}")
    args.prefault_ahead = parse_size("--prefault-ahead", args.prefault_ahead)
    args.repair_rate = parse_size("--repair-rate", args.repair_rate)
    if args.replicas < 1 or args.repair_rate < 0 or not args.repair_interval > 0:
        raise ValueError("--replicas must be >= 1, --repair-rate >= 0 and --repair-interval > 0")
    _disk_options(args, capacity)
    return NodeOptions(capacity, keys, limits, shm, lookups)
