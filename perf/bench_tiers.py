"""Chunks per second through the engine plug-ins vs the same bytes through this package's own public save/load.

Run in a venv with vllm and lmcache (CI's `.venv-vllm`): `python perf/bench_tiers.py [--chunks 64] [--rounds 5]
[--layers 4]`.

One `ems.pool` node on loopback. Per round, in turn (the order rotates each round), each path stores the same
`--chunks` chunks and reads them back. A chunk is LMCache's: 256 tokens of `--layers` layers, K and V, 64 float16
a token (8 heads of 8): 64 KiB a layer, 256 KiB with the default 4 layers (a tiny model: each path's fixed cost per
chunk shows most), 2 MiB with `--layers 32` (a real model's chunk is larger still: 32 MiB for an 8B Llama's).

* `api`: `Ems.init` + `register_kvcache` over a CPU cache of one-chunk blocks, `save`/`load` (slot_mapping form):
  the anchor.
* `vllm tier`: `EmsTier` built by vLLM's own factories (`TieringOffloadingSpec`), a cascade job (`submit_store`)
  and a promotion job (`submit_load`) over the CPU primary tier's memory, each until `drain_jobs` returns.
* `lmcache plugin`: `EmsRemoteConnector` built by LMCache's `CreateStorageBackends`, `batched_submit_put_task` (until
  every put is done) and `batched_get_blocking` (objects allocated and filled from the pool), with LMCache's allocator
  aligned to the chunk size (`local_cpu.pinned_align_bytes`, as docs/guides/lmcache.md advises: one copy a chunk); and
  `lmcache plugin, 4 KiB align` with LMCache's default alignment (a chunk moves as 64 runs of 4 KiB).
* `lmcache fs`: LMCache's own `fs` plugin on this machine's disk (a temporary folder), the same calls.

Where the LMCache plugin's time goes (printed under the table, not goals): `lmcache plugin, direct` makes the
plugin's own calls on the caller's thread (`_put_all` over the same objects; `_get_prefix`, which allocates the
batch's objects, hashes the keys and makes one SDK load, then the objects freed), without LMCache's `RemoteBackend`
(its event-loop hop, its instrumentation, the plugin's hop to its I/O thread); `lmcache allocate + free` is the
load side's LMCache part alone: the batch's objects allocated from LMCache's local CPU backend and freed, as every
get through LMCache's remote-plugin contract does (the API's load fills memory the engine registered once).

Prints a table of each path's best round (interleaved rounds: on a shared host the others measure the neighbours),
the ratios to the anchor (goal: a plug-in adds at most 10 %: ratio >= 0.9), writes
perf/tiers.png and records the figures (perf/results.py; another `--layers` than 4: perf/tiers-<N>-layers.png,
results run `tiers-<N>-layers`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import ems.transport.ucx.config  # noqa: F401 - UCX environment before ucxx loads
from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig
from ems.integrations import kv_layouts

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.append(str(HERE))

from benchlib import machine  # noqa: E402
from pool_testlib import PoolProcess  # noqa: E402
from results import Figure, Goal, Run, command_line, load, record  # noqa: E402

HEADS, HEAD, TOKENS = 8, 8, 256  # LMCache's chunk: [2, LAYERS, 256 tokens, 64] float16
LAYERS = 4  # `--layers`
CHUNK_BYTES = LAYERS * 2 * TOKENS * HEADS * HEAD * 2  # 256 KiB with 4 layers


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def api_path(address: str, n: int) -> tuple[Callable[[], None], Callable[[], None]]:
    Ems.init(
        EmsConfig(
            pool_nodes=[address],
            cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="bench-tiers-api", kvcache_type="MHA"),
        )
    )
    cc = Ems.get_cc()
    assert cc is not None
    memory = torch.randint(0, 256, (n * CHUNK_BYTES,), dtype=torch.uint8)
    planes = kv_layouts.block_planes(memory.view(n, CHUNK_BYTES), n)
    cc.register_kvcache([list(planes)])
    hashes, slots, offsets = list(range(1, n + 1)), list(range(n)), [1] * n
    option = CcKvOption(write_rcache=False)

    def save() -> None:
        if cc.save(slots, hashes, offsets, option).success != n:
            raise RuntimeError("api save incomplete")

    def load() -> None:
        if cc.load(slots, hashes, offsets, option).success != n:
            raise RuntimeError("api load incomplete")

    return save, load


def tier_path(address: str, n: int):
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import TransferJob

    tier_cfg = {"type": "EmsTier", "module_path": "ems.integrations.vllm_tier", "pool_nodes": [address], "local_pool": "off"}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",), group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES // 2,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 2 * n * CHUNK_BYTES,
            "secondary_tiers": [tier_cfg],
        },
        engine_id=uuid.uuid4().hex,
        model=OffloadingModelConfig(name="bench/tiers", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    tier = manager.secondary_tiers[0]
    if tier.block_size_bytes != CHUNK_BYTES:
        raise RuntimeError(f"the primary tier's chunks are {tier.block_size_bytes} bytes")
    view = manager.primary_tier.get_kv_memoryview()
    np.frombuffer(view.cast("B"), dtype=np.uint8)[:] = np.random.default_rng(0).integers(
        0, 256, len(view) * CHUNK_BYTES, dtype=np.uint8
    )
    keys = [make_offload_key(i.to_bytes(32, "little"), 0) for i in range(n)]
    ctx = ReqContext(req_id="bench")
    jobs = iter(range(1, 1 << 30))

    def run(promotion: bool, ids: np.ndarray) -> None:
        job = next(jobs)
        (tier.submit_load if promotion else tier.submit_store)(TransferJob(job, keys, ids, promotion, ctx))
        tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        if len(results) != 1 or not results[0].success:
            raise RuntimeError(f"tier job failed: {results}")

    return (lambda: run(False, np.arange(n))), (lambda: run(True, np.arange(n, 2 * n))), manager.shutdown


def lmcache_path(extra: dict, plugin: str, n: int, loop: asyncio.AbstractEventLoop):
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    config = LMCacheEngineConfig.from_dict(
        {
            "chunk_size": TOKENS,
            "local_cpu": True,
            "max_local_cpu_size": 3 * n * CHUNK_BYTES / (1 << 30) + 0.01,
            "remote_storage_plugins": [plugin],
            "extra_config": extra,
        }
    )
    md = LMCacheMetadata(
        model_name="bench/tiers",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=(LAYERS, 2, TOKENS, HEADS, HEAD),
        chunk_size=TOKENS,
    )
    backends = CreateStorageBackends(config, md, loop, dst_device="cpu")
    local, remote = backends["LocalCPUBackend"], backends[f"RemoteBackend-{plugin}"]
    objs = [local.allocate(md.get_shapes(), md.get_dtypes(), None) for _ in range(n)]
    for i, obj in enumerate(objs):
        if obj.get_size() != CHUNK_BYTES:
            raise RuntimeError(f"LMCache chunk of {obj.get_size()} bytes")
        obj.raw_data[:CHUNK_BYTES].copy_(
            torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
        )
    keys = [CacheEngineKey("bench/tiers", 1, 0, 10_000 + i, torch.float16) for i in range(n)]
    connector = remote.connection._connector  # (LMCache wraps the plugin in its InstrumentedRemoteConnector)

    def put() -> None:
        done = threading.Semaphore(0)
        remote.batched_submit_put_task(keys, objs, on_complete_callback=lambda _key: done.release())
        for _ in keys:
            if not done.acquire(timeout=60):
                raise RuntimeError(f"{plugin}: puts did not finish")
        if remote.put_failed_count:
            raise RuntimeError(f"{plugin}: {remote.put_failed_count} puts failed")

    def get() -> None:
        got = remote.batched_get_blocking(keys)
        missing = sum(o is None for o in got)
        for o in got:
            if o is not None:
                o.ref_count_down()
        if missing:
            raise RuntimeError(f"{plugin}: {missing} chunks missing")

    def direct_put() -> None:
        connector._put_all(keys, objs)

    def direct_get() -> None:
        got = connector._get_prefix(keys)
        for o in got:
            o.ref_count_down()
        if len(got) < n:
            raise RuntimeError(f"{plugin}: {n - len(got)} chunks missing")

    def allocate_free() -> None:
        batch = local.batched_allocate(md.get_shapes(), md.get_dtypes(), n, None, busy_loop=False)
        if not batch or len(batch) < n:
            raise RuntimeError("LMCache's local CPU backend could not allocate the batch")
        for o in batch:
            o.ref_count_down()

    def close() -> None:
        for obj in objs:
            obj.ref_count_down()
        for backend in reversed(list(backends.values())):
            backend.close()

    return put, get, close, (direct_put, direct_get), allocate_free


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--without-lmcache", action="store_true", help="the API and vLLM's tier only")
    ap.add_argument("--no-results", action="store_true", help="print only: do not record nor append to RESULTS.md")
    ap.add_argument("--plot-only", action="store_true", help="draw perf/tiers.png from perf/results/tiers.json")
    ap.add_argument("--layers", type=int, default=4, help="layers of a chunk: 64 KiB each (default 4: 256 KiB chunks)")
    args = ap.parse_args(argv)
    global LAYERS, CHUNK_BYTES
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    LAYERS, CHUNK_BYTES = args.layers, args.layers * 2 * TOKENS * HEADS * HEAD * 2
    run_name = "tiers" if LAYERS == 4 else f"tiers-{LAYERS}-layers"
    if args.plot_only:  # (the vLLM venv has no matplotlib: draw the recorded run from another venv)
        return plot_recorded(HERE / "results" / f"{run_name}.json", HERE / f"{run_name}.png")
    n = args.chunks
    node = PoolProcess(f"{max(256, 8 * n * CHUNK_BYTES >> 20)}MiB")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    closers: list[Callable[[], None]] = []
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_FS_DIR")) as fs_dir:
            ems_extra = {
                "remote_storage_plugin.ems.module_path": "ems.integrations.lmcache",
                "remote_storage_plugin.ems.class_name": "EmsRemoteConnector",
                "remote_storage_plugin.ems.pool_nodes": [node.address],
                "remote_storage_plugin.ems.local_pool": "off",
            }
            paths: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {"api": api_path(node.address, n)}
            t_save, t_load, t_close = tier_path(node.address, n)
            paths["vllm tier"], closers = (t_save, t_load), [t_close]
            lmcache = () if args.without_lmcache else ("plugin", "plugin, 4 KiB", "fs")
            aligned = {**ems_extra, "local_cpu.pinned_align_bytes": CHUNK_BYTES}  # one slot a chunk (docs/guides/lmcache.md)
            for which, extra, plugin, label in (
                ("plugin", aligned, "ems", "lmcache plugin"),
                ("plugin, 4 KiB", ems_extra, "ems", "lmcache plugin, 4 KiB align"),
                ("fs", {"remote_storage_plugin.fs.base_path": fs_dir}, "fs", "lmcache fs"),
            ):
                if which in lmcache:
                    put, get, close, direct, allocate_free = lmcache_path(extra, plugin, n, loop)
                    paths[label] = (put, get)
                    closers.append(close)
                    if which == "plugin":  # where its time goes (see the module docstring)
                        paths["lmcache plugin, direct"] = direct
                        paths["lmcache allocate + free"] = (allocate_free, allocate_free)
            for save, load in paths.values():  # warm-up: connections, first values
                save()
                load()
            times: dict[tuple[str, str], list[float]] = {(p, op): [] for p in paths for op in ("save", "load")}
            names = list(paths)
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    save, load = paths[name]
                    times[(name, "save")].append(timed(save))
                    times[(name, "load")].append(timed(load))
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:  # a benchmark's teardown: report, keep closing
                print(f"close failed: {exc}")
        Ems.shutdown()
        node.cleanup()
    # the best round of each path: on a shared 2-core host the other rounds measure the neighbours
    rate = {key: n / min(values) for key, values in times.items()}
    spread = {key: max(values) / min(values) for key, values in times.items()}
    print(f"\n{n} chunks of {CHUNK_BYTES >> 10} KiB, best of {args.rounds} interleaved rounds, one ems.pool node on loopback")
    print(machine())
    print("| path | store chunks/s | load chunks/s | store vs api | load vs api |")
    print("|---|---|---|---|---|")
    parts = [name for name in names if name in ("lmcache plugin, direct", "lmcache allocate + free")]
    for name in [name for name in names if name not in parts]:
        s, ld = rate[(name, "save")], rate[(name, "load")]
        print(f"| {name} | {s:.0f} | {ld:.0f} | {s / rate[('api', 'save')]:.2f} | {ld / rate[('api', 'load')]:.2f} |")
    if parts:
        best = {key: min(values) / n * 1e6 for key, values in times.items()}  # µs a chunk, best round
        api, whole = best[("api", "load")], best[("lmcache plugin", "load")]
        direct, alloc = best[("lmcache plugin, direct", "load")], best[("lmcache allocate + free", "load")]
        print("\nWhere an LMCache plugin load's time goes (µs a chunk, best rounds; the rest is LMCache's RemoteBackend):")
        columns = ("API load", "plugin through LMCache", "plugin called directly", "of which LMCache's allocate + free")
        print("| " + " | ".join((*columns, "RemoteBackend + hops")) + " |")
        print("|---|---|---|---|---|")
        print(f"| {api:.1f} | {whole:.1f} | {direct:.1f} | {alloc:.1f} | {whole - direct:.1f} |")
        s_api, s_whole, s_direct = (
            best[("api", "save")],
            best[("lmcache plugin", "save")],
            best[("lmcache plugin, direct", "save")],
        )
        print(f"store: API {s_api:.1f}, plugin through LMCache {s_whole:.1f}, plugin called directly {s_direct:.1f} µs a chunk")
        names = [name for name in names if name not in parts]
    plot(rate, names, HERE / f"{run_name}.png")  # (without matplotlib: `--plot-only` from another venv)
    if args.no_results:
        return 0
    figures = []
    goals = {"vllm tier": Goal(">=", 0.9), "lmcache plugin": Goal(">=", 0.9)}
    for name, goal in ((name, goals.get(name)) for name in names if name != "api"):
        for op in ("save", "load"):
            figures.append(
                Figure(
                    f"{name} {'store' if op == 'save' else 'load'} ({n} x {CHUNK_BYTES >> 10} KiB chunks)",
                    rate[(name, op)],
                    "chunks/s",
                    f"API {op} to the same node",
                    rate[("api", op)],
                    goal,
                    f"perf/{run_name}.png",
                    f"best of {args.rounds} interleaved rounds (worst/best {spread[(name, op)]:.1f}x)",
                )
            )
    run = Run(run_name, command_line(), figures, machine=machine())
    print(f"results: {record(run)}")
    return 0


def plot_recorded(results: Path, path: Path) -> int:
    """The plot of a recorded run: each figure's value and anchor are a path's and the API's chunks/s."""
    rate: dict[tuple[str, str], float] = {}
    names = ["api"]
    for figure in load(results).figures:
        name, op = figure.name.split(" (")[0].rsplit(" ", 1)
        op = "save" if op == "store" else op
        rate[(name, op)], rate[("api", op)] = figure.value, float(figure.anchor_value or 0.0)
        if name not in names:
            names.append(name)
    plot(rate, names, path)
    print(f"plot: {path}")
    return 0


def plot(rate: dict, names: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(names))
    for i, op in enumerate(("save", "load")):
        ax.bar(x + (i - 0.5) * 0.38, [rate[(name, op)] for name in names], 0.38, label="store" if op == "save" else "load")
    ax.set_xticks(x, [name.replace(" ", "\n", 1) for name in names], fontsize=9)
    ax.set_ylabel(f"chunks/s ({CHUNK_BYTES >> 10} KiB)")
    ax.set_title("Engine plug-ins vs the public API to the same pool node (loopback)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
