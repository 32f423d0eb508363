"""A pool node's disk tier (`--disk`), side by side in one run:

* load: GET of 1 MiB values that are on the disk only (a scan over a working set 8x the node's DRAM, so every batch
  is read from the disk, verified and promoted) vs a plain sequential O_DIRECT read of the same record files, one
  file after the other into one aligned buffer (the disk's limit for these bytes), vs a GET of the same values from
  a node that holds them in DRAM; and the tier's own lookups in process (`TieredStore.get_many`, no transport);
* save: PUT of 1 MiB values into a full node (every save evicts) with the disk tier off, on with a disk still
  filling, and on with a full disk (the steady state), rounds interleaved, and what the tier did with the
  evictions (written / dropped);
* restart: the time to rebuild the index from the disk (in process, and a whole node from start to its ready line,
  minus the same node on an empty directory) vs the number of values and bytes on the disk.

Prints the tables, writes perf/disk.png and appends them with the command to perf/RESULTS.md (unless
--no-results). Run under `flock /tmp/ems-bench.lock` (shared machine).
Usage: python perf/bench_disk.py [--values 256] [--rounds 3] [--restart 1000x1MiB,20000x16KiB,100000x1KiB]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))

from benchlib import machine  # noqa: E402
from disk_testlib import DiskNode  # noqa: E402
from pool_testlib import PoolProcess, joined, make_values  # noqa: E402

import ems.transport.ucx.config  # noqa: E402,F401 - UCX environment before ucxx loads
from ems.config import parse_size  # noqa: E402
from ems.pool.disk import DiskTier  # noqa: E402
from ems.pool.disk.records import ALIGN, aligned_buffer  # noqa: E402
from ems.pool.tiered_store import TieredStore  # noqa: E402
from ems.transport.ucx.remote import connect  # noqa: E402

MiB = 1 << 20
BATCH = 8  # values per PUT / GET, as an engine's request of a few blocks
T = 30.0


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _put(client, keys, values) -> float:
    start = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        client.put(keys[i : i + BATCH], values[i : i + BATCH], T)
    return time.perf_counter() - start


def _get(client, keys) -> tuple[float, int]:
    start = time.perf_counter()
    found = 0
    for i in range(0, len(keys), BATCH):
        found += sum(v is not None for v in client.get(keys[i : i + BATCH], T))
    return time.perf_counter() - start, found


def plain_direct_read(paths: list[Path]) -> tuple[float, int]:
    """Read every file whole, one after the other, with O_DIRECT into one aligned buffer: (seconds, bytes)."""
    size = max(os.path.getsize(p) for p in paths)
    buffer = aligned_buffer(-(-size // ALIGN) * ALIGN)
    total = 0
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            total += os.preadv(fd, [buffer.data], 0)
        finally:
            os.close(fd)
    return time.perf_counter() - start, total


def bench_load(work: Path, n: int, rounds: int) -> dict:
    values = make_values(n, MiB - 40, seed=1)
    nbytes = sum(len(joined(v)) for v in values)
    keys = [f"load-{i}".encode() for i in range(n)]
    disk_node = DiskNode(work / "load", capacity=f"{max(n // 8, 8)}MiB", disk_capacity=f"{2 * n}MiB")
    dram_node = PoolProcess(f"{2 * n}MiB")
    out: dict = {"values": n, "bytes": nbytes}
    try:
        dc, mc = connect(disk_node.address), connect(dram_node.address)
        _put(dc, keys, values)
        _put(mc, keys, values)
        if not disk_node.drained(60):
            raise RuntimeError("the disk node's write queue did not drain")
        files = sorted((work / "load").glob("*/*.rec"))
        best = {"plain": float("inf"), "disk": float("inf"), "dram": float("inf")}
        plain_bytes = 0
        misses = 0
        hits_before = disk_node.tier("ems_pool_tier_hits_total")
        for _ in range(rounds):
            seconds, plain_bytes = plain_direct_read(files)
            best["plain"] = min(best["plain"], seconds)
            seconds, found = _get(dc, keys)
            misses += n - found
            best["disk"] = min(best["disk"], seconds)
            seconds, found = _get(mc, keys)
            misses += n - found
            best["dram"] = min(best["dram"], seconds)
        disk_hits = disk_node.tier("ems_pool_tier_hits_total") - hits_before
        dc.close()
        mc.close()
        out.update(
            plain_gbps=_gbps(plain_bytes, best["plain"]),
            disk_gbps=_gbps(nbytes, best["disk"]),
            dram_gbps=_gbps(nbytes, best["dram"]),
            disk_hit_share=disk_hits / (rounds * n),
            misses=misses,
            files=len(files),
            file_bytes=plain_bytes,
        )
    finally:
        disk_node.cleanup()
        dram_node.cleanup()
    out.update(bench_lookup_in_process(work / "inproc", values, rounds))
    return out


def bench_lookup_in_process(folder: Path, values: list, rounds: int) -> dict:
    """`TieredStore.get_many` of values on the disk only (no transport): the tier's own cost."""
    n = len(values)
    disk = DiskTier(str(folder), 2 * n * MiB, 1 << 30)
    disk.open()
    store = TieredStore(8 * MiB, disk)
    keys = [f"in-{i}".encode() for i in range(n)]
    try:
        for key, value in zip(keys, values):
            data = joined(value)
            charge = store.charge_of(len(key), len(data))
            buffer = store.allocate(len(data), reserve=charge)
            buffer[:] = np.frombuffer(data, dtype=np.uint8)
            store.put_owned(key, buffer, reserved=charge)
        while disk.stats().queued_values:
            time.sleep(0.05)
        files = sorted(folder.glob("*/*.rec"))
        best = plain = float("inf")
        plain_bytes = 0
        for _ in range(rounds):  # interleaved with a plain read of the same files (the shared disk's speed drifts)
            seconds, plain_bytes = plain_direct_read(files)
            plain = min(plain, seconds)
            start = time.perf_counter()
            for i in range(0, n, BATCH):
                store.get_many(keys[i : i + BATCH])
            best = min(best, time.perf_counter() - start)
        stats = disk.stats()
        return {
            "inproc_gbps": _gbps(sum(len(joined(v)) for v in values), best),
            "inproc_plain_gbps": _gbps(plain_bytes, plain),
            "read_ms_per_record": 1e3 * stats.read_seconds / max(stats.reads, 1),
        }
    finally:
        store.close()


def bench_save(work: Path, n: int, rounds: int) -> dict:
    """PUT into full nodes, rounds interleaved (distinct keys each round: every save evicts): disk tier off; on, with
    a disk that is still filling (each record a new file); on, with a full disk (the steady state: each record
    overwrites the file of one it evicts)."""
    capacity = f"{max(n // 8, 16)}MiB"
    nodes = {
        "off": PoolProcess(capacity),
        "filling": DiskNode(work / "save-filling", capacity=capacity, disk_capacity=f"{4 * n * (rounds + 1)}MiB", queue=None),
        "full": DiskNode(work / "save-full", capacity=capacity, disk_capacity=f"{max(n // 2, 16)}MiB", queue=None),
    }
    values = make_values(n, MiB - 40, seed=2)
    nbytes = sum(len(joined(v)) for v in values)
    clients = {}
    try:
        clients = {name: connect(node.address) for name, node in nodes.items()}
        for client in clients.values():  # every node full (and the full disk full) before the measured rounds
            _put(client, [f"warm-{i}".encode() for i in range(n)], values)
        for name in ("filling", "full"):
            nodes[name].drained(60)  # type: ignore[union-attr]
        times: dict[str, list[float]] = {name: [] for name in nodes}
        for r in range(rounds):
            keys = [f"save-{r}-{i}".encode() for i in range(n)]
            for name, client in clients.items():
                times[name].append(_put(client, keys, values))
        out = {"values": n, "bytes": nbytes}
        for name in nodes:
            out[f"{name}_gbps"] = _gbps(nbytes, min(times[name]))
        for name in ("filling", "full"):
            node = nodes[name]
            node.drained(60)  # type: ignore[union-attr]
            m = node.scrape()  # type: ignore[union-attr]
            out[f"{name}_written"] = m[("ems_pool_tier_writes_total", (("tier", "disk"),))]
            out[f"{name}_dropped"] = m[("ems_pool_tier_errors_total", (("kind", "dropped_write"), ("tier", "disk")))]
            out[f"{name}_evictions"] = m[("ems_pool_tier_evictions_total", (("tier", "dram"),))]
        return out
    finally:
        for client in clients.values():
            client.close()
        for node in nodes.values():
            node.cleanup()


def _fill(folder: Path, count: int, size: int) -> int:
    """Write `count` values of `size` payload bytes as records (through the tier's own writer); their file bytes."""
    disk = DiskTier(str(folder), 1 << 50, 1 << 30)
    disk.open()
    value = joined(make_values(1, size, seed=3)[0])
    try:
        for i in range(count):
            disk.submit(f"restart-{i:08d}".encode(), value)
            if i % 1000 == 999:
                while disk.stats().queued_bytes > (256 << 20):
                    time.sleep(0.01)
        while disk.stats().queued_values:
            time.sleep(0.05)
        return disk.stats().used_bytes
    finally:
        disk.close()


def _node_start_seconds(folder: Path) -> float:
    start = time.perf_counter()
    node = PoolProcess("64MiB", args=("--disk", str(folder), "--disk-capacity", "1TiB"))
    seconds = time.perf_counter() - start
    node.cleanup()
    return seconds


def bench_restart(work: Path, cases: list[tuple[int, int]], rounds: int) -> list[dict]:
    empty = work / "empty"
    empty.mkdir()
    baseline = min(_node_start_seconds(empty) for _ in range(rounds))
    rows = []
    for count, size in cases:
        folder = work / f"restart-{count}-{size}"
        file_bytes = _fill(folder, count, size)
        index_s = float("inf")
        for _ in range(rounds):
            disk = DiskTier(str(folder), 1 << 50, 1 << 20)
            disk.open()
            index_s = min(index_s, disk.stats().restore_seconds)
            assert disk.stats().restored_values == count
            disk.close()
        node_s = min(_node_start_seconds(folder) for _ in range(rounds))
        rows.append(
            {
                "values": count,
                "value_bytes": size,
                "file_bytes": file_bytes,
                "index_s": index_s,
                "node_s": node_s,
                "node_extra_s": node_s - baseline,
                "baseline_s": baseline,
            }
        )
        shutil.rmtree(folder)
    return rows


def _case(text: str) -> tuple[int, int]:
    count, _, size = text.partition("x")
    return int(count), parse_size("--restart", size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--values", type=int, default=256, help="1 MiB values per load/save measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--restart", default="1000x1MiB,20000x16KiB,100000x1KiB", help="COUNTxSIZE,... restart cases")
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--no-results", action="store_true", help="do not append to perf/RESULTS.md or write the plot")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ems-bench-disk-", dir=args.dir))
    try:
        load = bench_load(work, args.values, args.rounds)
        save = bench_save(work, args.values, args.rounds)
        restart = bench_restart(work, [_case(c) for c in args.restart.split(",")], args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"machine: {machine()}; disk: {work.parent} ({os.statvfs(work.parent).f_bsize}-byte blocks)",
        "",
        f"load: {load['values']} values of 1 MiB on the disk only, GETs of {BATCH}, best of {args.rounds}",
        "",
        "| path | GB/s | vs plain O_DIRECT read |",
        "|---|---|---|",
        f"| plain sequential O_DIRECT read of the {load['files']} record files | {load['plain_gbps']:.2f} | 1.00 |",
        f"| disk tier, in process (`TieredStore.get_many`: read, verify, promote) | {load['inproc_gbps']:.2f} | "
        f"{load['inproc_gbps'] / load['inproc_plain_gbps']:.2f} (vs {load['inproc_plain_gbps']:.2f} in its rounds) |",
        f"| disk tier through a node (GET over UCX) | {load['disk_gbps']:.2f} | {load['disk_gbps'] / load['plain_gbps']:.2f} |",
        f"| DRAM hit through a node (GET over UCX) | {load['dram_gbps']:.2f} | {load['dram_gbps'] / load['plain_gbps']:.2f} |",
        "",
        f"disk-tier GET / DRAM-hit GET: {load['disk_gbps'] / load['dram_gbps']:.2f}; share of the disk node's GETs "
        f"answered by the disk: {load['disk_hit_share']:.2f}; misses: {load['misses']}; mean record read "
        f"{load['read_ms_per_record']:.2f} ms",
        "",
        f"save: {save['values']} values of 1 MiB per round into a full node, PUTs of {BATCH}, best of {args.rounds}",
        "",
        "| disk tier | GB/s | vs off | DRAM evictions | records written | evictions dropped (write ring full) |",
        "|---|---|---|---|---|---|",
        f"| off | {save['off_gbps']:.2f} | 1.00 | | | |",
        f"| on, disk filling (new files) | {save['filling_gbps']:.2f} | {save['filling_gbps'] / save['off_gbps']:.2f} | "
        f"{save['filling_evictions']:.0f} | {save['filling_written']:.0f} | {save['filling_dropped']:.0f} |",
        f"| on, disk full (files overwritten) | {save['full_gbps']:.2f} | {save['full_gbps'] / save['off_gbps']:.2f} | "
        f"{save['full_evictions']:.0f} | {save['full_written']:.0f} | {save['full_dropped']:.0f} |",
        "",
        f"restart (best of {args.rounds}; a node's start on an empty directory: {restart[0]['baseline_s']:.2f} s)",
        "",
        "| values | value bytes | bytes on disk | index rebuild (s) | node start (s) | node start minus empty (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in restart:
        lines.append(
            f"| {r['values']} | {r['value_bytes']} | {r['file_bytes'] / MiB:.0f} MiB | {r['index_s']:.3f} | "
            f"{r['node_s']:.2f} | {r['node_extra_s']:.2f} |"
        )
    most = max(restart, key=lambda r: r["values"])
    big = max(restart, key=lambda r: r["file_bytes"])
    lines += [
        "",
        f"extrapolated index rebuild (linear in values, from the case with the most): 1,000,000 values "
        f"~{most['index_s'] / most['values'] * 1e6:.1f} s; 10 GiB of 1 MiB values (10,240 values) "
        f"~{big['index_s'] / big['values'] * 10240:.2f} s",
    ]
    text = "\n".join(lines)
    print(text)
    if args.no_results:
        return
    _plot(load, save, restart, HERE / "disk.png")
    command = "flock /tmp/ems-bench.lock python perf/bench_disk.py " + " ".join(sys.argv[1:])
    with (HERE / "RESULTS.md").open("a") as f:
        f.write(f"\n## Disk tier on a pool node (`--disk`)\n\n`{command.strip()}`\n\n{text}\n\nPlot: perf/disk.png\n")


def _plot(load: dict, save: dict, restart: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    names = ["plain O_DIRECT\nread", "disk tier\nin process", "disk tier\nnode GET", "DRAM hit\nnode GET"]
    a.bar(
        names,
        [load["plain_gbps"], load["inproc_gbps"], load["disk_gbps"], load["dram_gbps"]],
        color=["grey", "tab:orange", "tab:red", "tab:blue"],
    )
    a.set_ylabel("GB/s")
    a.set_title("load of 1 MiB values")
    b.bar(
        ["tier off", "on, disk filling", "on, disk full"],
        [save["off_gbps"], save["filling_gbps"], save["full_gbps"]],
        color=["tab:blue", "tab:orange", "tab:red"],
    )
    b.set_ylabel("GB/s")
    b.set_title("save into a full node (every save evicts)")
    c.plot([r["values"] for r in restart], [r["index_s"] for r in restart], "o-", label="index rebuild")
    c.plot([r["values"] for r in restart], [max(r["node_extra_s"], 1e-3) for r in restart], "s--", label="node start minus empty")
    c.set_xscale("log")
    c.set_yscale("log")
    c.set_xlabel("values on disk")
    c.set_ylabel("seconds")
    c.set_title("restart")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
