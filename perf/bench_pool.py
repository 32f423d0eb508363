"""Pool-node figures, side by side in one run: the EMS pool over UCX vs raw UCXX vs Redis vs Mooncake Store.

Throughput, for each value size (default 1 MiB), on the same batch of well-formed EMS values (header + payload):
* ems-1 / ems-3: `PoolClient` + `UcxNode` to 1 or 3 `python -m ems.pool` processes (routing, protocol v4, the node
  checks each value's XXH3 before storing); loads with `PoolClient.get_into` (received into reused buffers);
* raw: the same bytes as one UCX tagged message per value, same UCX settings, to a sink/source peer process;
* redis: a local redis-server (no persistence), pipelined SET / GET of the same values;
* mooncake: Mooncake Store (`mooncake_master` on loopback, TCP transfer engine, the segment in a second process),
  `batch_put_from` / `batch_get_into` of the same values from registered buffers (skipped, with the reason printed,
  when it cannot run).
Per call (median of many; ems, raw and Redis called in turn, so load changes hit them alike): exists of 1 key, save
and load of one 1 MiB value, next to a raw UCXX round trip, Redis EXISTS/SET/GET and Mooncake `is_exist`/put/get;
and 1-value saves per second to one node, 1 vs 8 in flight on one connection. The first lines name the transport
and its UCX progress mode (`EMS_UCX_PROGRESS_MODE`). Prints tables, writes perf/pool.png.

API over UCX (`--api-only` runs just this): `ContextCaching.save` / `.load` through `Ems.init(pool_nodes=[one node])`
(no read cache: every load crosses the wire) of one request of 1 MiB blocks (16 layers x 8 KV heads x 128 fp16,
16 tokens a block; 48 blocks by default), with the request cut into chunks of each `EMS_CHUNK_BYTES` in
`CHUNK_MODES` (0: the request as one chunk, nothing overlapped), next to raw UCXX of the same bytes (the same values
as single UCX messages to the peer above), interleaved round by round, best of N; prints the stage table of the
best one-chunk and pipelined jobs (stages overlap: their sum against the job's wall time), and `PoolClient.put` /
`get_into` of the same values in one call (the transport alone).
Inside an engine (`--engine-only` runs just this, also part of the full run): the 62 MiB load of a 4,000-token
prompt (124 values of 512 KiB, `PoolClient.get_into` into reused buffers, one node, default client settings), best
of N, alone and with a second Python thread of this process spinning in pure Python (as an engine's busy loops
hold the GIL), next to each other in turn, and `ContextCaching.load` also beside a thread as busy that does not
hold the GIL (what the third busy thread costs in CPU alone on this host); the first `ContextCaching.load` of a
freshly started client; and the node's CPU time (all its threads, /proc schedstat) per request (1-key exists) and
per MiB (1 MiB saves and loads, less the per-request part).
Progress models (`--progress-probe`, issue 16 item 1's measurement): in a separate process whose UCX worker has no
progress thread (ucxx "blocking" mode), the calling thread posts the protocol's frames itself and progresses the
worker until they complete (`progress_once`, then either sleeping in the worker's epoll, "event", or spinning,
"spin"): a 1-key exists round trip and the 62 MiB load above, alone and beside a busy Python thread; the current
client's figures come from the same run, next to it.
Issue 16's client goals (`--client-goals`), one run, shared memory off (every byte over UCX on loopback, standing
in for a node on another host): a 1-key exists next to raw UCXX 8-byte ping-pongs with the same peer process (posted
and waited for by the calling thread through `transport.ucx.direct`; from the calling thread through the event loop;
and back to back inside the event loop, the fastest; this process's event loop drives UCX itself, "loop" mode);
1-value saves per second, 1 vs 8 in flight (8 caller threads, one connection), for 1 MiB and 64 KiB values, with
the CPU one save costs in this process and in the node together (the most saves in flight can gain here); the 62
MiB load alone, beside a busy Python thread and beside a thread as busy that does not hold the GIL (what the CPU
alone costs on this host); and the API rows above for 32 blocks (one chunk and the default chunks).
Usage: python perf/bench_pool.py [--quick] [--sweep] [--no-mooncake] [--api-only] [--engine-only] [--progress-probe]
       [--client-goals] [--api-blocks N] [--threads T]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.insert(0, str(ROOT / "tests"))  # ucx_loop: the tests' event-loop thread for raw sessions

import torch  # noqa: E402
from benchlib import best_of, machine, median_us  # noqa: E402
from pool_testlib import PoolProcess, make_values  # noqa: E402
from proc_cpu import process_cpu_seconds, schedstat_seconds  # noqa: E402
from results import Figure, Goal, Run, command_line, record  # noqa: E402
from ucx_loop import UcxRuntime  # noqa: E402

import ems.transport.ucx.config  # noqa: E402 - UCX environment before ucxx loads
from ems.backends.base import PoolCall  # noqa: E402
from ems.backends.pool_client import PoolClient  # noqa: E402
from ems.settings import DEFAULT_CHUNK_BYTES  # noqa: E402
from ems.transport.shm.client import ShmMode  # noqa: E402
from ems.transport.ucx.client import UcxNode  # noqa: E402

try:
    from ems.transport.ucx.progress import recv, send
except ImportError:  # an older tree (thread progress only): ucxx's own calls, so one script measures before/after

    def send(ep, buf):  # type: ignore[no-redef]
        return ep.send(buf)

    def recv(ep, buf):  # type: ignore[no-redef]
        return ep.recv(buf)


from ems.types import CcKvOption  # noqa: E402

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
SHM = ShmMode.AUTO  # the bench's own clients (engine_like, api_over_ucx); --client-goals turns it off


# ---- raw UCXX: a sink/echo peer in another process ----

RAW_PEER = r"""
import asyncio, sys, numpy as np
import ems.transport.ucx.config as cfg
try:
    from ems.transport.ucx.progress import recv, send
except ImportError:
    send, recv = (lambda ep, b: ep.send(b)), (lambda ep, b: ep.recv(b))
async def main():
    cfg.init_ucx()
    import ucxx
    async def handle(ep):
        hdr = np.empty(3, np.uint64)
        pool = {}
        while True:
            try:
                await recv(ep, hdr)
            except Exception:
                return
            op, n, size = (int(x) for x in hdr)
            if op == 2:  # a round trip: answer `size` bytes
                await send(ep, np.ones(max(size, 1), np.uint8))
                continue
            if op == 3:  # sink one message of `size` per request, ack each
                buf = np.empty(size, np.uint8)
                await recv(ep, buf)
                await send(ep, np.ones(1, np.uint8))
                continue
            if op == 0:  # sink n messages of size into reused buffers (no page faults, like a warm node), then ack
                if len(pool.get(size, [])) < n:
                    pool[size] = [np.ones(size, np.uint8) for _ in range(n)]
                bufs = pool[size][:n]
                await asyncio.gather(*(recv(ep, b) for b in bufs))
                await send(ep, np.ones(1, np.uint8))
            else:  # send n messages of size
                data = np.ones(size, np.uint8)
                await asyncio.gather(*(send(ep, data) for _ in range(n)))
    lst = ucxx.create_listener(handle, port=0)
    print(lst.port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


class RawUcx:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RAW_PEER], stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.rt = UcxRuntime.get()
        from ems.transport.ucx.endpoint import create_endpoint

        self.ep = asyncio.run_coroutine_threadsafe(create_endpoint("127.0.0.1", port, 5.0), self.rt.loop).result(10)
        self._bufs: dict = {}

    def put(self, values: list) -> None:
        async def run() -> None:
            await send(self.ep, np.array([0, len(values), len(values[0])], np.uint64))
            await asyncio.gather(*(send(self.ep, v) for v in values))
            await recv(self.ep, np.empty(1, np.uint8))

        asyncio.run_coroutine_threadsafe(run(), self.rt.loop).result(120)

    def get(self, n: int, size: int) -> None:
        async def run() -> None:
            await send(self.ep, np.array([1, n, size], np.uint64))
            if len(self._bufs.get(size, [])) < n:  # reused receive buffers, as `get_into` is given
                self._bufs[size] = [np.ones(size, np.uint8) for _ in range(n)]
            bufs = self._bufs[size][:n]
            await asyncio.gather(*(recv(self.ep, b) for b in bufs))

        asyncio.run_coroutine_threadsafe(run(), self.rt.loop).result(120)

    def round_trip(self, size: int = 8) -> None:
        async def run() -> None:
            await send(self.ep, np.array([2, 0, size], np.uint64))
            await recv(self.ep, np.empty(max(size, 1), np.uint8))

        asyncio.run_coroutine_threadsafe(run(), self.rt.loop).result(10)

    def round_trips_in_loop(self, n: int, size: int = 8) -> float:
        """Median µs of `n` round trips run back to back inside one coroutine on the loop (no caller-thread hop per
        trip): the raw UCXX ping-pong at its fastest in this process."""

        async def run() -> list:
            head, answer, times = np.array([2, 0, size], np.uint64), np.empty(max(size, 1), np.uint8), []
            for _ in range(n):
                start = time.perf_counter()
                await send(self.ep, head)
                await recv(self.ep, answer)
                times.append(time.perf_counter() - start)
            return times

        return float(np.median(asyncio.run_coroutine_threadsafe(run(), self.rt.loop).result(60))) * 1e6

    def put_one(self, value: np.ndarray) -> None:
        async def run() -> None:
            await send(self.ep, np.array([3, 1, value.size], np.uint64))
            await send(self.ep, value)
            await recv(self.ep, np.empty(1, np.uint8))

        asyncio.run_coroutine_threadsafe(run(), self.rt.loop).result(10)

    def get_one(self, out: np.ndarray) -> None:
        async def run() -> None:
            await send(self.ep, np.array([1, 1, out.size], np.uint64))
            await recv(self.ep, out)

        asyncio.run_coroutine_threadsafe(run(), self.rt.loop).result(10)

    def close(self) -> None:
        self.rt.call_soon(self.ep.abort)
        self.proc.kill()
        self.proc.wait()


class RawDirect:
    """Raw UCXX tagged messages to the same kind of peer, posted and waited for by the calling thread through
    `transport.ucx.direct` (the client's progress model without the protocol or a node): a ping-pong."""

    def __init__(self) -> None:
        from ems.transport.ucx.connector import connect
        from ems.transport.ucx.direct import DirectRuntime

        self.proc = subprocess.Popen([sys.executable, "-c", RAW_PEER], stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.runtime = DirectRuntime.get()
        self.conn = connect(self.runtime, "127.0.0.1", port, time.monotonic() + 10)
        self.head = np.array([2, 0, 8], np.uint64)
        self.answer = np.empty(8, np.uint8)

    def round_trip(self) -> None:
        from ems.transport.ucx.direct import futures_context

        with futures_context():
            posted = [self.conn.recv(self.answer), self.conn.send(self.head)]
            self.runtime.wait(posted, time.monotonic() + 10)

    def close(self) -> None:
        from ems.transport.base import Ending

        self.conn.abort(Ending.CANCELLED)
        self.proc.kill()
        self.proc.wait()


# ---- Redis ----


class Redis:
    def __init__(self) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not installed (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        self.port = 6390 + os.getpid() % 1000
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--maxmemory",
                "0",
                "--proto-max-bulk-len",
                "1gb",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def put(self, keys: list, values: list) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k, v in zip(keys, values):
            pipe.set(k, v)
        pipe.execute()

    def get(self, keys: list) -> list:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        return pipe.execute()

    def close(self) -> None:
        self.client.flushall()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Mooncake:
    """Mooncake Store on loopback: `mooncake_master`, one storage process holding the segment (the peer the data
    crosses TCP to, like a pool node), and this process as a client with registered source/destination buffers."""

    SEGMENT = r"""
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", "127.0.0.1:" + sys.argv[1])
print("ready", rc, flush=True)
while True:
    time.sleep(1)
"""

    def __init__(self, segment_bytes: int, buffer_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
        if not Path(exe).exists():
            raise RuntimeError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        port = 50600 + os.getpid() % 300
        self.procs = [
            subprocess.Popen(
                [
                    exe,
                    f"--rpc_port={port}",
                    "--rpc_address=127.0.0.1",
                    "--default_kv_lease_ttl=50",
                    "--enable_http_metadata_server=false",
                    f"--metrics_port={port + 1}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        time.sleep(1.5)
        seg = subprocess.Popen(
            [sys.executable, "-u", "-c", self.SEGMENT, str(port), str(segment_bytes)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.procs.append(seg)
        line = seg.stdout.readline() if seg.stdout else ""
        if not line.startswith("ready 0"):
            self.close()
            raise RuntimeError(f"Mooncake storage process did not start: {line!r}")
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", f"127.0.0.1:{port}")
        if rc != 0:
            self.close()
            raise RuntimeError(f"Mooncake client setup failed: {rc}")
        self.src = np.empty(buffer_bytes, np.uint8)
        self.dst = np.empty(buffer_bytes, np.uint8)
        for buf in (self.src, self.dst):
            if self.store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("Mooncake register_buffer failed")
        self.generation = 0

    def load_values(self, flat: list) -> None:
        at = 0
        for f in flat:
            self.src[at : at + len(f)] = np.frombuffer(f, np.uint8)
            at += len(f)

    def put(self, keys: list, size: int) -> list:
        """batch_put_from of the values in `src` under fresh keys (Mooncake does not overwrite); the keys used."""
        self.generation += 1
        names = [f"{k.decode()}-{self.generation}" for k in keys]
        ptrs = [self.src.ctypes.data + i * size for i in range(len(keys))]
        codes = self.store.batch_put_from(names, ptrs, [size] * len(keys))
        if any(c != 0 for c in codes):
            raise RuntimeError(f"Mooncake batch_put_from: {set(codes)}")
        self.last = names
        return names

    GET_BATCH = 8  # batch_get_into of more keys at once answered -707 on this machine (see perf/RESULTS.md)

    def get(self, names: list, size: int) -> None:
        for at in range(0, len(names), self.GET_BATCH):
            part = names[at : at + self.GET_BATCH]
            ptrs = [self.dst.ctypes.data + (at + i) * size for i in range(len(part))]
            got = self.store.batch_get_into(part, ptrs, [size] * len(part))
            if any(g != size for g in got):
                raise RuntimeError(f"Mooncake batch_get_into: {set(got)}")

    def clear(self) -> None:
        time.sleep(0.1)  # past the 50 ms lease
        self.store.remove_all()

    def close(self) -> None:
        try:
            self.store.close()
        except Exception:  # never set up
            pass
        for proc in reversed(self.procs):
            proc.kill()
            proc.wait()


def medians_us(fns: dict, calls: int) -> dict:
    """{name: median µs} of `calls` calls of each, taken in turn (call 1 of each, then call 2 of each, ...), so load
    changes on this shared machine hit every peer alike."""
    times: dict = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) * 1e6 for name, t in times.items()}


def saves_per_second(pool: PoolClient, value: list, in_flight: int, total: int, option: CcKvOption) -> float:
    """1-value saves per second on one PoolClient (one connection per node), `in_flight` callers at once."""
    per = total // in_flight
    errors: list = []

    def worker(t: int) -> None:
        for i in range(per):
            key = f"conc-{in_flight}-{t}-{i}".encode()
            if not pool.put(PoolCall([key], [key], option), [value]).results[0]:
                errors.append(key)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(in_flight)]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{len(errors)} saves failed")
    return per * in_flight / (time.perf_counter() - start)


def cpu_per_save(pool: PoolClient, node: PoolProcess, value: list, saves: int, option: CcKvOption) -> tuple[float, float]:
    """CPU seconds per 1-value save, one at a time: (this process, the node). On a host of C cores, saves in flight
    can at most reach C / (their sum) saves per second, whatever the transport does. The saves overwrite 64 keys in
    turn, so the node reuses the buffers it frees instead of faulting in fresh memory (see "Fresh memory on these
    VMs" in perf/RESULTS.md), and a first pass over them is not counted."""
    keys = [f"cpu-{i}".encode() for i in range(64)]

    def run(count: int) -> None:
        for i in range(count):
            key = keys[i % len(keys)]
            if not pool.put(PoolCall([key], [key], option), [value]).results[0]:
                raise RuntimeError("a save failed")

    run(len(keys))
    own, theirs = time.process_time(), process_cpu_seconds(node.proc.pid)
    run(saves)
    return (time.process_time() - own) / saves, (process_cpu_seconds(node.proc.pid) - theirs) / saves


class BusyPythonThread:
    """A second thread that spins in pure Python (holding the GIL but for the interpreter's switch interval)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            for _ in range(1000):
                n += 1

    def __enter__(self) -> BusyPythonThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def api_load_beside_busy_thread(node: PoolProcess, blocks: int, rounds: int) -> tuple[float, float, float, float, str]:
    """Seconds of `ContextCaching.load` of `blocks` blocks of 512 KiB (8 layers x 8 KV heads x 128 fp16, 16
    tokens) from `node`: the first load of a freshly started client (connected at `Ems.init`, then 1 s of an
    engine's start-up), then the best alone, beside a busy Python thread and beside a thread as busy that does not
    hold the GIL (what the CPU alone costs on this host), in turn; and the stage table of the best load of the first
    two (where the busy thread's cost lands)."""
    from ems import CcConfig, Ems, EmsConfig
    from ems.records import JobKind, JobRecord, stage_table
    from ems.tools.demo import Engine

    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "bench-engine"), pool_nodes=[node.address], read_cache_capacity=0))
    try:
        cc = Ems.get_cc()
        engine = Engine(8, blocks, 16, 8, 128, torch.float16, torch.device("cpu"))
        cc.register_kvcache(engine.kvcache)
        for plane in engine.planes:
            plane.copy_(torch.randn(plane.shape, dtype=torch.float32).to(plane.dtype))
        slots = engine.slots(engine.allocate(blocks))
        offsets, hashes = [16] * blocks, [7_000_000 + i for i in range(blocks)]
        option = CcKvOption(timeout=60_000, write_rcache=False)
        if cc.save(slots, hashes, offsets, option).success != blocks:
            raise RuntimeError("save incomplete")
        Ems.shutdown()  # a fresh client: its connection (and same-host region) made at init, as an engine's
        Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "bench-engine"), pool_nodes=[node.address], read_cache_capacity=0))
        cc = Ems.get_cc()
        cc.register_kvcache(engine.kvcache)
        time.sleep(1.0)  # an engine's start-up between connecting and its first load
        first = best_of(lambda: cc.load(slots, hashes, offsets, option), 1)

        def load() -> None:
            if cc.load(slots, hashes, offsets, option).success != blocks:
                raise RuntimeError("load incomplete")

        load()
        modes = {"alone": contextlib.nullcontext, "busy": BusyPythonThread, "gil-free": GilFreeThread}
        best: dict[str, tuple[float, JobRecord | None]] = {mode: (float("inf"), None) for mode in modes}
        for _ in range(rounds):
            for mode, beside in modes.items():
                with beside():
                    seconds = best_of(load, 1)
                if seconds < best[mode][0]:
                    best[mode] = (seconds, cc.jobs.last(JobKind.LOAD))
        records = [record for mode in ("alone", "busy") if (record := best[mode][1]) is not None]
        return first, best["alone"][0], best["busy"][0], best["gil-free"][0], stage_table(records)
    finally:
        Ems.shutdown()


def engine_like(node: PoolProcess, rounds: int, calls: int) -> tuple[str, dict]:
    """The 62 MiB load alone and beside a busy Python thread; the node's CPU per request and per MiB."""
    option = CcKvOption(timeout=60_000, write_rcache=False)
    pool = PoolClient([UcxNode(node.address, connect_timeout_ms=5000, shm=SHM)])
    try:
        n, size = 124, 512 << 10
        values = make_values(n, size - 40, seed=62)
        keys = [f"engine-{i}".encode() for i in range(n)]
        outs = [np.empty(size, np.uint8) for _ in range(n)]
        if not all(pool.put(PoolCall(keys, keys, option), values).results):
            raise RuntimeError("the 62 MiB batch was not stored")
        load = lambda: pool.get_into(PoolCall(keys, keys, option), outs)
        load()
        if bytes(outs[-1]) != b"".join(values[-1]):
            raise RuntimeError("a value did not come back")
        alone, busy = float("inf"), float("inf")
        for _ in range(rounds):  # in turn, best of each
            alone = min(alone, best_of(load, 1))
            with BusyPythonThread():
                busy = min(busy, best_of(load, 1))
        total = n * size
        api_first, api_alone, api_busy, api_gil_free, api_stages = api_load_beside_busy_thread(node, n, rounds)
        one = make_values(1, (1 << 20) - 40, seed=63)
        assert pool.put(PoolCall([b"cpu-one"], [b"cpu-one"], option), one).results == [True]
        one_out = [np.empty(1 << 20, np.uint8)]
        cpu: dict = {}
        cpu_calls = 4 * calls
        for name, fn in (
            ("exists", lambda: pool.exists(PoolCall([b"cpu-one"], [b"cpu-one"], option))),
            ("save 1 MiB", lambda: pool.put(PoolCall([b"cpu-one"], [b"cpu-one"], option), one)),
            ("load 1 MiB", lambda: pool.get_into(PoolCall([b"cpu-one"], [b"cpu-one"], option), one_out)),
        ):
            fn()
            start = schedstat_seconds(node.proc.pid)
            for _ in range(cpu_calls):
                fn()
            cpu[name] = (schedstat_seconds(node.proc.pid) - start) / cpu_calls * 1e6  # µs of node CPU per call
    finally:
        pool.close()
    per_request = cpu["exists"]
    figures = {
        "load alone GB/s": total / alone / 1e9,
        "load busy GB/s": total / busy / 1e9,
        "busy/alone": alone / busy,
        "api first load GB/s": total / api_first / 1e9,
        "api load alone GB/s": total / api_alone / 1e9,
        "api load busy GB/s": total / api_busy / 1e9,
        "api busy/alone": api_alone / api_busy,
        "api load gil-free busy GB/s": total / api_gil_free / 1e9,
        "api gil-free/alone": api_alone / api_gil_free,
        "node cpu us per request": per_request,
        "node cpu us per MiB save": cpu["save 1 MiB"] - per_request,
        "node cpu us per MiB load": cpu["load 1 MiB"] - per_request,
    }
    text = "\n".join(
        [
            f"Inside an engine: 62 MiB load (124 x 512 KiB, 1 node, read cache off), best of {rounds} in turn",
            "",
            "| path | load alone GB/s | with a busy Python thread GB/s | busy / alone | goal |",
            "|---|---|---|---|---|",
            f"| PoolClient.get_into | {figures['load alone GB/s']:.2f} | {figures['load busy GB/s']:.2f} "
            f"| {figures['busy/alone']:.2f} | >= 0.8 |",
            f"| ContextCaching.load (default chunks, verify + scatter) | {figures['api load alone GB/s']:.2f} "
            f"| {figures['api load busy GB/s']:.2f} | {figures['api busy/alone']:.2f} | >= 0.8 |",
            "",
            f"The same `ContextCaching.load` beside a thread as busy that does not hold the GIL (CPU alone): "
            f"{figures['api load gil-free busy GB/s']:.2f} GB/s, {figures['api gil-free/alone']:.2f}x of alone "
            "(on two cores the load's own two threads, the client's scatter and the node's copy, then share them "
            "with a third: the ceiling of the busy-thread ratio on this host, whatever the GIL costs).",
            "",
            f"The first `ContextCaching.load` of a freshly started client (connected at init, then 1 s): "
            f"{figures['api first load GB/s']:.2f} GB/s ({figures['api first load GB/s'] / figures['api load alone GB/s']:.2f}x "
            "the best warm one).",
            "",
            "Stages of the best `ContextCaching.load` alone, then of the best beside the busy thread:",
            "",
            api_stages,
            "",
            f"Node CPU (all threads of the node process, /proc schedstat, over {4 * calls} calls each, µs per call; "
            "per MiB = the 1 MiB call less the per-request part):",
            "",
            "| per request (1-key exists) | per MiB saved | per MiB loaded |",
            "|---|---|---|",
            f"| {per_request:.0f} | {figures['node cpu us per MiB save']:.0f} | {figures['node cpu us per MiB load']:.0f} |",
        ]
    )
    return text, figures


CALLER_PROBE = r'''"""The calling thread progresses the UCX worker itself; argv: mode ("event" | "spin"), repository, rounds."""

import asyncio, sys, time, statistics
sys.path.insert(0, sys.argv[2] + "/tests/pool"); sys.path.insert(0, sys.argv[2] + "/perf")
import numpy as np
from pool_testlib import PoolProcess, make_values
from ems.transport import metas, protocol
from ems.transport.ucx import frames as ucx_frames
from ems.transport.ucx import progress as ucx_progress
from ems.transport.ucx.config import init_ucx
from ems.transport.ucx.endpoint import create_endpoint
from ems.transport.ucx.frames import send_all, recv_header_frame, recv_meta
from bench_pool import BusyPythonThread
node = PoolProcess("256MiB")
ROUNDS = int(sys.argv[3])
loop = asyncio.new_event_loop(); asyncio.set_event_loop(loop)
async def setup():
    init_ucx("loop")
    ep = await create_endpoint("127.0.0.1", node.port, 5)
    await send_all(ep, [protocol.pack_header(protocol.Op.HELLO), b""])
    await recv_meta(ep, protocol.unpack_header(await recv_header_frame(ep)))
    await send_all(ep, [protocol.pack_header(protocol.Op.AUTH)])
    await recv_header_frame(ep)
    return ep
ep = loop.run_until_complete(setup())
from ucxx.core import _get_ctx
import ucxx._lib.libucxx as u
from ucxx._lib.arr import Array
worker = _get_ctx().worker
inner = ep._ep
send_base, recv_base = ep._tags["msg_send"], ep._tags["msg_recv"]
rids = iter(range(1, 1 << 31))
MODE = sys.argv[1]

def wait_all(reqs, deadline):
    while True:
        while worker.progress_once():
            pass
        if all(r.completed for r in reqs):
            for r in reqs: r.check_error()
            return
        if time.monotonic() > deadline: raise TimeoutError
        if MODE == "event":
            if worker.arm():  # nothing pending: sleep in epoll until the worker has an event (GIL released?)
                worker.progress_worker_event(10)

def request(op, meta, count):
    rid = next(rids)
    header = protocol.pack_header(op, count=count, meta_len=len(meta), meta_end=protocol.end_byte(meta),
                                  flags=protocol.Flags.INLINE, request_id=rid)
    head = ucx_frames.pack_head(header, meta); reply = np.zeros(ucx_frames.HEAD_BYTES, np.uint8)
    keep = [Array(head), Array(reply)]
    r_recv = inner.tag_recv(keep[1], u.UCXXTag(protocol.request_tag(recv_base, rid)), u.UCXXTagMaskFull)
    r_send = inner.tag_send(keep[0], u.UCXXTag(send_base))
    wait_all([r_recv], time.monotonic() + 5)
    return rid, protocol.unpack_header(reply[:protocol.HEADER_SIZE]), reply, keep, r_send

def exists():
    rid, h, reply, keep, r_send = request(protocol.Op.EXISTS, metas.encode_keys_meta([b"k0"]), 1)
    wait_all([r_send], time.monotonic() + 5)

def put(keys, values):
    lens = np.array([sum(len(p) for p in v) for v in values]); chunks = [b"".join(v) for v in values]
    meta = metas.encode_put_meta(keys, lens, lens, protocol.end_bytes(chunks))
    rid = next(rids)
    header = protocol.pack_header(protocol.Op.PUT, count=len(keys), meta_len=len(meta), meta_end=protocol.end_byte(meta),
                                  data_len=int(lens.sum()), flags=protocol.Flags.INLINE, request_id=rid)
    head = ucx_frames.pack_head(header, meta)
    reply = np.zeros(ucx_frames.HEAD_BYTES, np.uint8)
    arrs = [Array(head), Array(reply)] + [Array(np.frombuffer(c, np.uint8)) for c in chunks]
    r_recv = inner.tag_recv(arrs[1], u.UCXXTag(protocol.request_tag(recv_base, rid)), u.UCXXTagMaskFull)
    data_tag = u.UCXXTag(protocol.request_tag(send_base, rid))
    sends = [inner.tag_send(arrs[0], u.UCXXTag(send_base))] + [inner.tag_send(a, data_tag) for a in arrs[2:]]
    wait_all([r_recv] + sends, time.monotonic() + 30)

def get_into(keys, outs):
    rid, h, reply, keep, r_send = request(protocol.Op.GET, metas.encode_keys_meta(keys), len(keys))
    meta = reply[protocol.HEADER_SIZE : protocol.HEADER_SIZE + h.meta_len].tobytes()
    lens, _, plan, _ = metas.decode_get_reply(len(keys), h.data_len, meta)
    offsets, sizes = metas.segment_bounds(lens, plan)
    segs = [np.empty(int(s), np.uint8) for s in sizes]; arrs = [Array(s) for s in segs]
    tag = u.UCXXTag(protocol.request_tag(recv_base, rid))
    reqs = [inner.tag_recv(a, tag, u.UCXXTagMaskFull) for a in arrs]
    wait_all(reqs + [r_send], time.monotonic() + 30)
    for i, (seg, off, n) in enumerate(zip(plan.tolist(), offsets.tolist(), lens.tolist())):
        outs[i][:] = segs[seg][off:off + n]

values = make_values(124, (512 << 10) - 40, seed=1)
keys = [f"k{i}".encode() for i in range(124)]
put(keys, values)
outs = [np.empty(512 << 10, np.uint8) for _ in range(124)]
get_into(keys, outs); assert bytes(outs[9]) == b"".join(values[9])
def median_us(fn, n=300):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
print("exists", median_us(exists), flush=True)
total = 124 * (512 << 10)
def best(fn, n=5):
    out = []
    for _ in range(n):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return min(out)
a, b = float("inf"), float("inf")
for _ in range(ROUNDS):
    a = min(a, best(lambda: get_into(keys, outs), 1))
    with BusyPythonThread():
        b = min(b, best(lambda: get_into(keys, outs), 1))
print("load", total / a / 1e9, total / b / 1e9, flush=True)
node.cleanup()
import os; os._exit(0)
'''


def caller_progress_probe(rounds: int) -> str:
    """The `--progress-probe` table: caller-driven progress (two ways) next to the current client, one run."""
    engine_node = PoolProcess("256MiB")
    try:
        _, current = engine_like(engine_node, rounds, 150)
        option = CcKvOption(timeout=60_000, write_rcache=False)
        pool = PoolClient([UcxNode(engine_node.address, connect_timeout_ms=5000)])
        try:
            pool.exists(PoolCall([b"k0"], [b"k0"], option))
            current_exists = median_us(lambda: pool.exists(PoolCall([b"k0"], [b"k0"], option)), 300)
        finally:
            pool.close()
    finally:
        engine_node.cleanup()
    rows = [
        f"| current client (ucx_direct: C++ progress thread, the caller waits) | {current_exists:.0f} "
        f"| {current['load alone GB/s']:.2f} | {current['load busy GB/s']:.2f} | {current['busy/alone']:.2f} |"
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(CALLER_PROBE)
    try:
        for mode in ("event", "spin"):
            proc = subprocess.run(
                [sys.executable, script.name, mode, str(ROOT), str(rounds)], capture_output=True, text=True, timeout=600
            )
            figures = {
                line.split()[0]: [float(x) for x in line.split()[1:]]
                for line in proc.stdout.splitlines()
                if line.split() and line.split()[0] in ("exists", "load")
            }
            if "load" not in figures:
                raise RuntimeError(f"probe {mode} failed: {proc.stderr[-2000:]}")
            alone, busy = figures["load"]
            rows.append(
                f"| the caller progresses the worker ({mode}) | {figures['exists'][0]:.0f} | {alone:.2f} "
                f"| {busy:.2f} | {busy / alone:.2f} |"
            )
    finally:
        os.unlink(script.name)
    return "\n".join(
        [
            f"Progress models: 1-key exists (median µs) and the 62 MiB load (124 x 512 KiB, best of {rounds}), one node",
            "",
            "| client | exists µs | load GB/s | load beside a busy Python thread GB/s | busy / alone |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )


CHUNK_MODES = ("0", "1MiB", "4MiB", "8MiB", "16MiB", "32MiB")  # EMS_CHUNK_BYTES of the API rows (0: one chunk)
DEFAULT_MODE = f"{DEFAULT_CHUNK_BYTES >> 20}MiB"  # the one of them that is the default


def api_over_ucx(raw: RawUcx, blocks: int, rounds: int, modes: tuple[str, ...] = CHUNK_MODES) -> tuple[str, str, dict]:
    """The API-over-UCX rows (see the module docstring): (the table, the stage table, the figures in GB/s)."""
    from ems import CcConfig, Ems, EmsConfig
    from ems.config import parse_size
    from ems.records import JobKind, stage_table
    from ems.tools.demo import Engine

    value_bytes = (1 << 20) + 40  # a 1 MiB block and its header: what crosses the wire, for both peers
    total = blocks * value_bytes
    # two rounds' values: from the third round on every save evicts and reuses the buffers it frees (the steady
    # state). A node still growing writes fresh memory, and on this project's VMs a page the host has not backed yet
    # costs 5-14 ms per MiB to fault in (perf/RESULTS.md, "Fresh memory on these VMs"): a growing node measures that.
    node = PoolProcess(f"{2 * (len(modes) + 1) * total >> 20}MiB")
    load_before = os.getloadavg()[0]
    best = {mode: {"save": float("inf"), "load": float("inf")} for mode in modes}
    records: dict = {}
    raw_save = raw_load = client_save = client_load = float("inf")
    client: PoolClient | None = None
    try:
        Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "bench-api"), pool_nodes=[node.address], read_cache_capacity=0))
        cc = Ems.get_cc()
        engine = Engine(16, 2 * blocks, 16, 8, 128, torch.float16, torch.device("cpu"))
        cc.register_kvcache(engine.kvcache)
        for plane in engine.planes:
            plane.copy_(torch.randn(plane.shape, dtype=torch.float32).to(plane.dtype))
        slots = engine.slots(engine.allocate(blocks))
        offsets = [16] * blocks
        option = CcKvOption(timeout=60_000, write_rcache=False)
        arrays = [np.ones(value_bytes, np.uint8) for _ in range(blocks)]
        client = PoolClient([UcxNode(node.address, connect_timeout_ms=5000, shm=SHM)])  # the transport alone, one call
        values = make_values(blocks, value_bytes - 40, seed=blocks)
        outs = [np.empty(value_bytes, np.uint8) for _ in range(blocks)]
        counter = iter(range(1, 1 << 30))
        for round_ in range(rounds + 2):  # two rounds warm up (connection, staging, the node full): not counted
            warm = round_ < 2
            for mode in modes:
                # white-box: each chunk size in one session (Settings.chunk_bytes is read at Ems.init)
                cc._settings = dataclasses.replace(cc._settings, chunk_bytes=parse_size("EMS_CHUNK_BYTES", mode))
                hashes = [next(counter) * 1000 + i for i in range(blocks)]
                start = time.perf_counter()
                if cc.save(slots, hashes, offsets, option).success != blocks:
                    raise RuntimeError("save incomplete")
                t = time.perf_counter() - start
                if not warm and t < best[mode]["save"]:
                    best[mode]["save"], records[(mode, "save")] = t, cc.jobs.last(JobKind.SAVE)
                start = time.perf_counter()
                if cc.load(slots, hashes, offsets, option).success != blocks:
                    raise RuntimeError("load incomplete")
                t = time.perf_counter() - start
                if not warm and t < best[mode]["load"]:
                    best[mode]["load"], records[(mode, "load")] = t, cc.jobs.last(JobKind.LOAD)
            t_save = best_of(lambda: raw.put(arrays), 1)
            t_load = best_of(lambda: raw.get(blocks, value_bytes), 1)
            keys = [b"client-%d-%d" % (next(counter), i) for i in range(blocks)]
            c_save = best_of(lambda: client.put(PoolCall(keys, keys, option), values), 1)  # type: ignore[union-attr]
            c_load = best_of(lambda: client.get_into(PoolCall(keys, keys, option), outs), 1)  # type: ignore[union-attr]
            if not warm:
                raw_save, raw_load = min(raw_save, t_save), min(raw_load, t_load)
                client_save, client_load = min(client_save, c_save), min(client_load, c_load)
    finally:
        if client is not None:
            client.close()
        Ems.shutdown()
        node.cleanup()
    raw_s, raw_l = total / raw_save / 1e9, total / raw_load / 1e9
    lines = [
        f"API over UCX, 1 node, {blocks} blocks of 1 MiB ({total / 2**20:.0f} MiB a call), best of {rounds} "
        f"interleaved rounds; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "",
        "| EMS_CHUNK_BYTES | chunks | save GB/s | load GB/s | raw UCXX save | raw UCXX load | save/raw | load/raw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        save, load = total / best[mode]["save"] / 1e9, total / best[mode]["load"] / 1e9
        chunks = records[(mode, "save")].stages[next(iter(k for k in records[(mode, "save")].stages if k.value == "send"))].runs
        lines.append(
            f"| {mode if mode != '0' else '0 (one chunk)'} | {chunks} | {save:.2f} | {load:.2f} | {raw_s:.2f} "
            f"| {raw_l:.2f} | {save / raw_s:.2f}x | {load / raw_l:.2f}x |"
        )
    c_s, c_l = total / client_save / 1e9, total / client_load / 1e9
    lines.append(
        f"| PoolClient put / get_into alone (same values, one call) | - | {c_s:.2f} | {c_l:.2f} | {raw_s:.2f} "
        f"| {raw_l:.2f} | {c_s / raw_s:.2f}x | {c_l / raw_l:.2f}x |"
    )
    shown = [records[(m, op)] for m in ("0", DEFAULT_MODE) if m in modes for op in ("save", "load")]
    stages = stage_table(shown).replace("| job |", f"| job (one chunk, then {DEFAULT_MODE} chunks: the default) |", 1)
    figures = {mode: {op: total / best[mode][op] / 1e9 for op in ("save", "load")} for mode in modes}
    figures.update({"raw": {"save": raw_s, "load": raw_l}, "client": {"save": c_s, "load": c_l}, "blocks": blocks})
    return "\n".join(lines), stages, figures


class GilFreeThread:
    """A second thread that keeps a core as busy as `BusyPythonThread` but without holding the GIL (hashing 1 MiB at
    a time releases it): what a busy thread costs in CPU alone, next to what it costs in GIL hand-overs."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        import hashlib

        data = bytes(1 << 20)
        while not self._stop.is_set():
            hashlib.sha256(data).digest()

    def __enter__(self) -> GilFreeThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def client_goals(rounds: int, calls: int, api_blocks: int) -> str:
    """Issue 16's client goals in one run, shared memory off (`--client-goals`; see the module docstring)."""
    option = CcKvOption(timeout=60_000, write_rcache=False)
    # a node that soon holds all it can (saves then reuse what they evict) and populates nothing in the background,
    # so that its CPU per save is the save's own (see "Fresh memory on these VMs" in perf/RESULTS.md)
    raw, direct, node = RawUcx(), RawDirect(), PoolProcess("256MiB", args=("--prefault-ahead", "0"))
    lines: list[str] = []
    try:
        pool = PoolClient([UcxNode(node.address, connect_timeout_ms=5000, shm=ShmMode.OFF)])
        try:
            one = make_values(1, (1 << 20) - 40, seed=99)
            assert pool.put(PoolCall([b"one"], [b"one"], option), one).results == [True]
            for _ in range(20):
                pool.exists(PoolCall([b"one"], [b"one"], option))
                direct.round_trip()
                raw.round_trip(8)
            node_client = pool.nodes[0]
            per = medians_us(
                {
                    "ems exists (PoolClient)": lambda: pool.exists(PoolCall([b"one"], [b"one"], option)),
                    "ems exists (UcxNode alone)": lambda: node_client.exists([b"one"], 5.0),
                    "raw ping-pong, caller waits (ucx_direct)": direct.round_trip,
                    "raw ping-pong, caller -> event loop": lambda: raw.round_trip(8),
                },
                calls,
            )
            per["raw ping-pong inside the event loop"] = raw.round_trips_in_loop(calls)
            fastest_raw = min(v for k, v in per.items() if k.startswith("raw"))
            lines += [
                f"Per call (median of {calls}, in turn; the in-loop ping-pong after them), µs:",
                "",
                "| call | µs | / fastest raw ping-pong |",
                "|---|---|---|",
                *(f"| {k} | {v:.0f} | {v / fastest_raw:.2f}x |" for k, v in per.items()),
                "",
            ]
            conc: dict = {}
            ceiling: dict = {}
            for size in (1 << 20, 64 << 10):
                value = make_values(1, size - 40, seed=size)[0]
                rates = {1: 0.0, 8: 0.0}
                for _ in range(rounds):  # 1 and 8 in flight in turn, best of each
                    for k in rates:
                        rates[k] = max(rates[k], saves_per_second(pool, value, k, 240, option))
                conc[size] = rates
                ceiling[size] = cpu_per_save(pool, node, value, 1500, option)
            lines += [
                f"1-value saves per second on one connection (8 in flight: 8 caller threads), best of {rounds} in turn; "
                "the CPU one save costs, this process and the node together, over 1,500 saves one at a time, and the "
                "most in-flight saves can gain on this host's cores when every core is busy with them:",
                "",
                "| value | 1 at a time /s | 8 in flight /s | ratio | CPU per save, µs (client + node) | ceiling |",
                "|---|---|---|---|---|---|",
                *(
                    f"| {size >> 10} KiB | {r[1]:.0f} | {r[8]:.0f} | {r[8] / r[1]:.2f}x | {sum(ceiling[size]) * 1e6:.0f} "
                    f"({ceiling[size][0] * 1e6:.0f} + {ceiling[size][1] * 1e6:.0f}) "
                    f"| {(os.cpu_count() or 1) / r[1] / sum(ceiling[size]):.2f}x |"
                    for size, r in conc.items()
                ),
                "",
            ]
            n, size = 124, 512 << 10
            values = make_values(n, size - 40, seed=62)
            keys = [f"engine-{i}".encode() for i in range(n)]
            outs = [np.empty(size, np.uint8) for _ in range(n)]
            if not all(pool.put(PoolCall(keys, keys, option), values).results):
                raise RuntimeError("the 62 MiB batch was not stored")

            def load() -> None:
                if not all(pool.get_into(PoolCall(keys, keys, option), outs).results):
                    raise RuntimeError("load incomplete")

            load()
            best = {"alone": float("inf"), "busy Python thread": float("inf"), "GIL-free busy thread": float("inf")}
            for _ in range(rounds):
                best["alone"] = min(best["alone"], best_of(load, 1))
                with BusyPythonThread():
                    best["busy Python thread"] = min(best["busy Python thread"], best_of(load, 1))
                with GilFreeThread():
                    best["GIL-free busy thread"] = min(best["GIL-free busy thread"], best_of(load, 1))
            total = n * size
            lines += [
                f"62 MiB load (124 x 512 KiB, `PoolClient.get_into`), best of {rounds} in turn:",
                "",
                "| beside | GB/s | / alone | / beside the GIL-free thread |",
                "|---|---|---|---|",
                *(
                    f"| {k} | {total / t / 1e9:.2f} | {best['alone'] / t:.2f}x | {best['GIL-free busy thread'] / t:.2f}x |"
                    for k, t in best.items()
                ),
                "",
            ]
        finally:
            pool.close()
        api, _, _ = api_over_ucx(raw, api_blocks, rounds, ("0", DEFAULT_MODE))
        lines.append(api)
    finally:
        raw.close()
        direct.close()
        node.cleanup()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller batches and fewer repeats")
    parser.add_argument("--sweep", action="store_true", help="value sizes 64 KiB .. 16 MiB (default: 1 MiB only)")
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--batch-mib", type=int, default=64, help="bytes per call, MiB")
    parser.add_argument("--api-only", action="store_true", help="only the API-over-UCX rows (and their raw peer)")
    parser.add_argument(
        "--progress-probe",
        action="store_true",
        help="only the caller-driven progress probe next to the current client (issue 16 item 1)",
    )
    parser.add_argument(
        "--client-goals",
        action="store_true",
        help="only issue 16's client goals (exists vs raw ping-pong, 8 saves in flight, the busy-thread load, the "
        "API vs raw), shared memory off",
    )
    parser.add_argument(
        "--engine-only",
        action="store_true",
        help="only the load beside a busy Python thread and the node's CPU per request / per MiB",
    )
    parser.add_argument("--api-blocks", type=int, default=48, help="1 MiB blocks per API call")
    parser.add_argument("--json", type=Path, help="also write the figures to this file (perf/bench_goals.py reads it)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (as bench_e2e: on 2 shared cores, 2-thread gathers starve the "
        "UCX and node threads they should overlap with)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = (16 if args.quick else args.batch_mib) << 20
    repeats = 3 if args.quick else 5
    calls = 40 if args.quick else 150
    sizes = SIZES if args.sweep else [1 << 20]
    option = CcKvOption(timeout=60_000, write_rcache=False)
    print(f"# {machine()}")
    if args.client_goals:  # the raw client at its fastest (its own event loop drives UCX); shared memory off
        global SHM
        SHM = ShmMode.OFF
        os.environ["EMS_POOL_SHM"] = "off"
        os.environ.setdefault("EMS_UCX_PROGRESS_MODE", "loop")
    UcxRuntime.get()  # starts UCX in this process: its progress mode is known from here on
    print(
        f"# transport {Path(ems.transport.ucx.config.__file__).parent}, UCX progress mode: this process "
        f"{ems.transport.ucx.config.PROGRESS_MODE}, pool nodes and the raw peer "
        f"{os.environ.get('EMS_UCX_PROGRESS_MODE') or getattr(ems.transport.ucx.config, 'NODE_PROGRESS_MODE', 'thread')}"
    )
    if args.progress_probe:
        print(caller_progress_probe(repeats))
        return
    if args.client_goals:
        print(client_goals(repeats, calls * 2, 32))
        return
    if args.engine_only:
        engine_node = PoolProcess("256MiB")
        try:
            print(engine_like(engine_node, repeats, calls)[0])
        finally:
            engine_node.cleanup()
        return
    if args.api_only:
        raw = RawUcx()
        try:
            api, api_stages, _ = api_over_ucx(raw, args.api_blocks, repeats)
        finally:
            raw.close()
        print(api)
        print()
        print(api_stages)
        return

    nodes = [PoolProcess("2GiB") for _ in range(3)]
    raw = RawUcx()
    red = Redis()
    moon: Mooncake | None = None
    moon_reason = "--no-mooncake"
    if not args.no_mooncake:
        try:
            moon = Mooncake(1 << 30, batch + (16 << 20))
        except Exception as error:  # reported in the table's notes
            moon_reason = f"{type(error).__name__}: {error}"
            print(f"Mooncake skipped: {moon_reason}", flush=True)
    rows = []
    per_call: dict = {}
    moon_errors: list = []
    try:
        pools = {
            "ems-1": PoolClient([UcxNode(nodes[0].address, connect_timeout_ms=5000)]),
            "ems-3": PoolClient([UcxNode(n.address, connect_timeout_ms=5000) for n in nodes]),
        }
        for size in sizes:
            n = max(2, batch // size)
            values = make_values(n, size - 40, seed=size)  # each value (with its 40-byte header) is `size` bytes
            flat = [b"".join(v) for v in values]
            total = n * size
            keys = [f"bench-{size}-{i}".encode() for i in range(n)]
            outs = [np.empty(size, np.uint8) for _ in range(n)]
            row: dict = {"size": size}
            for name, pool in pools.items():
                ks = [name.encode() + k for k in keys]
                row[f"{name} save"] = total / best_of(lambda: pool.put(PoolCall(ks, ks, option), values), repeats) / 1e9
                out = pool.get_into(PoolCall(ks, ks, option), outs)
                if not all(out.results) or bytes(outs[-1]) != flat[-1]:
                    raise RuntimeError(f"{name}: a value did not come back ({out.errors})")
                row[f"{name} load"] = total / best_of(lambda: pool.get_into(PoolCall(ks, ks, option), outs), repeats) / 1e9
            arrays = [np.frombuffer(f, np.uint8) for f in flat]
            row["raw save"] = total / best_of(lambda: raw.put(arrays), repeats) / 1e9
            row["raw load"] = total / best_of(lambda: raw.get(n, size), repeats) / 1e9
            row["redis save"] = total / best_of(lambda: red.put(keys, flat), repeats) / 1e9
            row["redis load"] = total / best_of(lambda: red.get(keys), repeats) / 1e9
            red.client.flushall()
            if moon is not None:
                try:
                    moon.load_values(flat)
                    best = 0.0
                    for _ in range(repeats):
                        start = time.perf_counter()
                        moon.put(keys, size)
                        best = max(best, total / (time.perf_counter() - start) / 1e9)
                        moon.clear()  # only the latest batch stays (Mooncake does not overwrite)
                    row["mooncake save"] = best
                    names = moon.put(keys, size)
                    row["mooncake load"] = total / best_of(lambda: moon.get(names, size), repeats) / 1e9
                    moon.clear()
                except RuntimeError as error:
                    moon_errors.append(f"{size >> 10} KiB batch: {error}")
            rows.append(row)
            print(_fmt_row(row), flush=True)

        # ---- per call: one 1 MiB value, one key ----
        pool = pools["ems-1"]
        one = make_values(1, (1 << 20) - 40, seed=99)
        one_flat = b"".join(one[0])
        one_out = np.empty(len(one_flat), np.uint8)
        assert pool.put(PoolCall([b"one"], [b"one"], option), one).results == [True]
        for _ in range(10):  # warm both connections and the node's buffers
            pool.exists(PoolCall([b"one"], [b"one"], option))
            pool.get_into(PoolCall([b"one"], [b"one"], option), [one_out])
            raw.round_trip(8)
            raw.get_one(one_out)
        per_call["exists"] = medians_us(
            {
                "ems": lambda: pool.exists(PoolCall([b"one"], [b"one"], option)),
                "raw": lambda: raw.round_trip(8),
                "redis": lambda: red.client.exists(b"one"),
            },
            calls,
        )
        per_call["save 1 MiB"] = medians_us(
            {
                "ems": lambda: pool.put(PoolCall([b"one"], [b"one"], option), one),
                "raw": lambda: raw.put_one(np.frombuffer(one_flat, np.uint8)),
                "redis": lambda: red.client.set(b"one", one_flat),
            },
            calls,
        )
        per_call["load 1 MiB"] = medians_us(
            {
                "ems": lambda: pool.get_into(PoolCall([b"one"], [b"one"], option), [one_out]),
                "raw": lambda: raw.get_one(one_out),
                "redis": lambda: red.client.get(b"one"),
            },
            calls,
        )
        if moon is not None:
            for name_, fn in (
                ("exists", lambda: moon.store.is_exist(moon_name[0])),
                ("save 1 MiB", lambda: moon.put([b"one"], len(one_flat))),
                ("load 1 MiB", lambda: moon.get(moon_name, len(one_flat))),
            ):
                try:
                    moon.load_values([one_flat])
                    moon_name = moon.put([b"one-ref"], len(one_flat))
                    per_call[name_]["mooncake"] = median_us(fn, calls)
                    moon.clear()
                except RuntimeError as error:
                    moon_errors.append(f"per call {name_}: {error}")
        total_saves = 48 if args.quick else 240
        conc = {1: 0.0, 8: 0.0}
        for _ in range(1 if args.quick else 3):  # 1 and 8 in flight in turn, best of each (the host is shared)
            for k in conc:
                conc[k] = max(conc[k], saves_per_second(pool, one[0], k, total_saves, option))
        for p in pools.values():
            p.close()
        engine, engine_figures = engine_like(nodes[1], repeats, calls)
        api, api_stages, api_figures = api_over_ucx(raw, args.api_blocks, repeats)
    finally:
        raw.close()
        red.close()
        if moon is not None:
            moon.close()
        for node in nodes:
            node.cleanup()
    print()
    print(table(rows, moon is not None))
    print()
    print(per_call_table(per_call, conc))
    print()
    print(engine)
    print()
    print(api)
    print()
    print(api_stages)
    if moon is None:
        print(f"\nMooncake not measured: {moon_reason}")
    for error in moon_errors:
        print(f"Mooncake failed: {error}")
    plot(rows, ROOT / "perf" / "pool.png", moon is not None)
    if not args.quick:  # (a smoke run's figures are not recorded)
        print(f"results: {record(results_run(per_call, conc, api_figures, engine_figures))}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "per_call": per_call,
                    "in_flight": conc,
                    "api": api_figures,
                    "api_table": api,
                    "api_stages": api_stages,
                    "machine": machine(),
                    "engine": engine_figures,
                    "mooncake": None if moon is None else "measured",
                    "mooncake_note": moon_reason if moon is None else "; ".join(moon_errors),
                },
                indent=1,
            )
        )


def results_run(per_call: dict, conc: dict, api: dict, engine: dict) -> Run:
    """This run's headline figures in the results format (perf/results.py), each next to the peer it was measured
    beside in this run."""
    raw, chunks = api["raw"], api[DEFAULT_MODE]
    exists, save1, load1 = per_call["exists"], per_call["save 1 MiB"], per_call["load 1 MiB"]
    plot = "perf/pool.png"
    return Run(
        "pool",
        command_line(),
        [
            Figure("exists of 1 block over UCX, median", exists["ems"], "µs", "Redis EXISTS", exists["redis"], Goal("<=", 2)),
            Figure("save of 1 block (1 MiB), median", save1["ems"], "µs", "raw UCXX", save1["raw"]),
            Figure("load of 1 block (1 MiB), median", load1["ems"], "µs", "raw UCXX", load1["raw"]),
            Figure(f"API save, {api['blocks']} x 1 MiB", chunks["save"], "GB/s", "raw UCXX", raw["save"], Goal(">=", 0.8), plot),
            Figure(f"API load, {api['blocks']} x 1 MiB", chunks["load"], "GB/s", "raw UCXX", raw["load"], Goal(">=", 0.8), plot),
            Figure("1-block saves, 8 in flight", conc[8], "saves/s", "1 at a time", conc[1], Goal(">=", 3)),
            Figure(
                "62 MiB load beside a busy Python thread",
                engine["load busy GB/s"],
                "GB/s",
                "the same load alone",
                engine["load alone GB/s"],
                Goal(">=", 0.8),
            ),
        ],
        machine=machine(),
    )


def _columns(with_moon: bool) -> list:
    cols = ["ems-1 save", "ems-1 load", "ems-3 save", "ems-3 load", "raw save", "raw load", "redis save", "redis load"]
    return cols + (["mooncake save", "mooncake load"] if with_moon else [])


def _fmt_row(row: dict) -> str:
    row = {k: v for k, v in row.items()}
    return f"{row['size'] >> 10:>6} KiB " + " ".join(f"{c} {v:.2f}" for c, v in row.items() if c != "size")


def table(rows: list, with_moon: bool) -> str:
    cols = _columns(with_moon)
    ratio_names = ["ems-1/raw save", "ems-1/raw load", "ems-1/redis save", "ems-1/redis load"]
    if with_moon:
        ratio_names += ["ems-1/mooncake save", "ems-1/mooncake load"]
    lines = [
        "| value | " + " | ".join(cols + ratio_names) + " |",
        "|---" * (len(cols) + len(ratio_names) + 1) + "|",
    ]
    for r in rows:
        nan = float("nan")
        ratios = [
            r["ems-1 save"] / r["raw save"],
            r["ems-1 load"] / r["raw load"],
            r["ems-1 save"] / r["redis save"],
            r["ems-1 load"] / r["redis load"],
        ]
        if with_moon:
            ratios += [r["ems-1 save"] / r.get("mooncake save", nan), r["ems-1 load"] / r.get("mooncake load", nan)]
        lines.append(
            f"| {r['size'] >> 10} KiB | "
            + " | ".join(f"{r.get(c, nan):.2f}" for c in cols)
            + " | "
            + " | ".join(f"{x:.2f}x" for x in ratios)
            + " |"
        )
    return "GB/s (best of runs)\n" + "\n".join(lines)


def per_call_table(per_call: dict, conc: dict) -> str:
    peers = ["ems", "raw", "redis", "mooncake"]
    lines = ["| call (median µs) | " + " | ".join(peers) + " |", "|---" * (len(peers) + 1) + "|"]
    for name, figures in per_call.items():
        lines.append(f"| {name} | " + " | ".join(f"{figures[p]:.0f}" if p in figures else "—" for p in peers) + " |")
    lines.append("")
    lines.append(
        f"1-value (1 MiB) saves per second to one node on one connection (best of runs): 1 in flight {conc[1]:.0f}/s, "
        f"8 in flight {conc[8]:.0f}/s ({conc[8] / conc[1]:.2f}x)"
    )
    return "\n".join(lines)


def plot(rows: list, path: Path, with_moon: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["ems-1", "ems-3", "raw", "redis"] + (["mooncake"] if with_moon else [])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, op in zip(axes, ["save", "load"]):
        if len(rows) == 1:
            ax.bar(names, [rows[0].get(f"{name} {op}", 0.0) for name in names])
            ax.set_title(f"{op}, {rows[0]['size'] >> 10} KiB values")
        else:
            sizes = [r["size"] >> 10 for r in rows]
            for name in names:
                ax.plot(sizes, [r.get(f"{name} {op}", float("nan")) for r in rows], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("value size (KiB)")
            ax.set_title(op)
            ax.legend()
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    fig.suptitle("EMS pool nodes vs raw UCXX vs Redis vs Mooncake, loopback (2 shared cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
