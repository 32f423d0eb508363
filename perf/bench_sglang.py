"""SGLang HiCache: pages per second through `EmsHiCacheStorage` vs the same bytes through the package's own public
save/load to the same pool node, and beside them SGLang's own `file` backend on this machine's disk.

What runs (one process, one `python -m ems.pool` node on 127.0.0.1, SGLang's own `MHATokenToKVPoolHost` on CPU):
* `backend`: SGLang's `StorageBackendFactory` builds the backend from the JSON a user writes (`interface_v1`);
  `batch_set_v1` / `batch_get_v1` of PAGES pages (host indices as SGLang's controller passes them), each layout;
* `sdk`: the same pages of the same host pool through `ContextCaching.save` / `load` (V1 hash form, the same
  registration, slot mapping, hashes and offsets), alternating with the backend round by round: the anchor of the
  goal (the backend adds at most 10 %: backend rate / sdk rate >= 0.9);
* `v2-mamba` (hybrid models): SGLang's `MambaPoolHost` (page_first, MAMBA_LAYERS layers of a float32 temporal
  state and a bf16 conv state: 536 KiB a slot) registered as SGLang's hybrid controller registers it
  (`register_mem_host_pool_v2`), PAGES slots a call through `batch_set_v2` / `batch_get_v2` against the same slots
  through that pool's own client (`ContextCaching.save` / `load`, the same registration, hashes and slots);
* `file`: SGLang's `HiCacheFile` in a temporary directory on this disk, driven as SGLang's controller drives a
  backend without `interface_v1` (`get_data_page` per page then `batch_set`; `batch_get` into flat pages then
  `set_from_flat_data_page`).
Each figure is the best of ROUNDS rounds (fresh keys for every set). Run with the SGLang venv from the repository
root: `/work/venv-sglang/bin/python perf/bench_sglang.py` (`--quick`: fewer rounds, nothing recorded).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.insert(0, str(HERE))

from benchlib import machine  # noqa: E402
from pool_testlib import PoolProcess  # noqa: E402
from results import Figure, Goal, Run, command_line, record  # noqa: E402

from ems import CcKvOption, Ems  # noqa: E402

BUDGET = 4 << 30  # bytes of host memory the test pools are booked against
LAYERS, HEADS, HEAD_DIM, PAGE = 4, 4, 128, 64  # bf16: 512 KiB a page
PAGES = 32  # pages per call (SGLang batches up to 128)
LAYOUTS = ("layer_first", "page_first")
ROWS = (*LAYOUTS, "v2-mamba")  # what the table compares each backend row with (its sdk row)
MAMBA_LAYERS, MAMBA_TEMPORAL, MAMBA_CONV = 4, (8, 64, 64), (3, 1024)  # float32 temporal, bf16 conv: 536 KiB a slot
DEVICE_PAGES = 128


def host_pool(layout: str):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = DEVICE_PAGES * PAGE
    device = MHATokenToKVPool(
        tokens, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
    )
    # SGLang checks the pool against the host's free memory less a fixed reserve; on this shared machine that
    # depends on whatever else runs, so the pool is booked against an explicit budget (SGLang's own scope)
    with host_memory_budget_scope(BUDGET):
        host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device_capacity_tokens=tokens,
            start_layer=0,
            end_layer=LAYERS - 1,
            write_back_staging=None,
        )
    host.kv_buffer.view(torch.uint8).random_(0, 256)
    return host


def storage_config(extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, False, "bench/model", extra_config=extra)


def indices(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)[None, :]).reshape(-1)


def keys_of(round_: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}:{round_}:{i}".encode()).hexdigest() for i in range(PAGES)]


def best(times: list[float]) -> float:
    return PAGES / min(times)


def make_backend(address: str, layout: str):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = json.loads(
        json.dumps(
            {
                "backend_name": "ems",
                "module_path": "ems.integrations.sglang",
                "class_name": "EmsHiCacheStorage",
                "interface_v1": 1,
                "pool_nodes": address,
                "local_pool": "off",
                "read_cache_capacity": 0,
            }
        )
    )
    host = host_pool(layout)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), host)
    backend.register_mem_pool_host(host)
    return backend, host


def make_hybrid_backend(address: str):
    """The backend with a Mamba state pool beside the KV pool, attached as SGLang's hybrid controller attaches it."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    backend, host = make_backend(address, "layer_first")
    slots = 2 * PAGES
    info = MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, slots, *MAMBA_TEMPORAL, dtype=torch.float32),
        conv=(torch.zeros(MAMBA_LAYERS, slots, *MAMBA_CONV, dtype=torch.bfloat16),),
    )
    with host_memory_budget_scope(BUDGET):
        mamba = MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, layout="page_first")
    for buf in (mamba.temporal_buffer, *mamba.conv_buffer):
        buf.view(torch.uint8).random_(0, 256)
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend, mamba


def round_v2(backend, keys: list[str]) -> tuple[float, float]:
    """One batch_set_v2 and one batch_get_v2 of PAGES Mamba slots."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    src = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(PAGES), keys=keys)
    dst = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(PAGES, 2 * PAGES), keys=keys)
    start = time.perf_counter()
    ok = backend.batch_set_v2([src])[PoolName.MAMBA]
    middle = time.perf_counter()
    got = backend.batch_get_v2([dst])[PoolName.MAMBA]
    end = time.perf_counter()
    if not all(ok) or not all(got):
        raise RuntimeError(f"v2: set {ok.count(True)}, get {got.count(True)} of {PAGES}")
    return middle - start, end - middle


def round_v2_sdk(backend, keys: list[str]) -> tuple[float, float]:
    """The same slots through the Mamba pool's own client (what the backend registered): save / load."""
    cc = backend._side_pools["mamba"].cc
    option = CcKvOption(timeout=5000)
    hashes, offsets = [int(k, 16) for k in keys], [1] * PAGES
    start = time.perf_counter()
    saved = cc.save(torch.arange(PAGES), hashes, offsets, option)
    middle = time.perf_counter()
    loaded = cc.load(torch.arange(PAGES, 2 * PAGES), hashes, offsets, option)
    end = time.perf_counter()
    if saved.success != PAGES or loaded.success != PAGES:
        raise RuntimeError(f"sdk v2: saved {saved.success}, loaded {loaded.success} of {PAGES}")
    return middle - start, end - middle


def round_backend(backend, keys: list[str]) -> tuple[float, float]:
    """One set and one get of PAGES pages through the backend."""
    src, dst = indices(list(range(PAGES))), indices(list(range(PAGES, 2 * PAGES)))
    start = time.perf_counter()
    ok = backend.batch_set_v1(keys, src)
    middle = time.perf_counter()
    got = backend.batch_get_v1(keys, dst)
    end = time.perf_counter()
    if not all(ok) or not all(got):
        raise RuntimeError(f"backend: set {ok.count(True)}, get {got.count(True)} of {PAGES}")
    return middle - start, end - middle


def round_sdk(keys: list[str]) -> tuple[float, float]:
    """The same pages of the same host pool through the package's public V1 save/load, over the same registration
    (the backend's attach registered the host pool's views with `register_kvcache`), the same slot mapping, hashes
    (the keys as ints) and offsets: what the backend adds is all that differs."""
    cc = Ems.get_cc()
    if cc is None:
        raise RuntimeError("no client")
    option = CcKvOption(timeout=5000)
    src, dst = indices(list(range(PAGES))), indices(list(range(PAGES, 2 * PAGES)))
    hashes, offsets = [int(k, 16) for k in keys], [PAGE] * PAGES
    start = time.perf_counter()
    saved = cc.save(src, hashes, offsets, option)
    middle = time.perf_counter()
    loaded = cc.load(dst, hashes, offsets, option)
    end = time.perf_counter()
    if saved.success != PAGES or loaded.success != PAGES:
        raise RuntimeError(f"sdk: saved {saved.success}, loaded {loaded.success} of {PAGES}")
    return middle - start, end - middle


def bench_file(directory: str, rounds: int) -> tuple[list[float], list[float]]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    host = host_pool("layer_first")
    store = HiCacheFile(storage_config(None), file_path=directory)
    sets, gets = [], []
    for r in range(rounds):
        keys = keys_of(r, "file")
        start = time.perf_counter()  # SGLang's _generic_page_set
        ok = store.batch_set(keys, [host.get_data_page(p * PAGE) for p in range(PAGES)])
        sets.append(time.perf_counter() - start)
        start = time.perf_counter()  # SGLang's _generic_page_get
        data = store.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(data):
            host.set_from_flat_data_page((PAGES + i) * PAGE, page)
        gets.append(time.perf_counter() - start)
        if not ok or any(d is None for d in data):
            raise RuntimeError("file backend failed")
    return sets, gets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="3 rounds, nothing recorded")
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    node = PoolProcess("2GiB")
    times: dict[str, tuple[list[float], list[float]]] = {}
    try:
        Ems.shutdown()
        for layout in LAYOUTS:
            backend, _host = make_backend(node.address, layout)  # registers this layout's host pool
            # backend and SDK alternate round by round, so that the shared host's load falls on both alike
            for r in range(rounds):
                for name, run_one in ((f"backend {layout}", lambda k: round_backend(backend, k)), (f"sdk {layout}", round_sdk)):
                    s_t, g_t = run_one(keys_of(r % 2, name))  # (two key sets: each set replaces values)
                    sets, gets = times.setdefault(name, ([], []))
                    sets.append(s_t)
                    gets.append(g_t)
        hybrid, _mamba = make_hybrid_backend(node.address)
        for r in range(rounds):
            for name, run_one in (
                ("backend v2-mamba", lambda k: round_v2(hybrid, k)),
                ("sdk v2-mamba", lambda k: round_v2_sdk(hybrid, k)),
            ):
                s_t, g_t = run_one(keys_of(r % 2, name))
                sets, gets = times.setdefault(name, ([], []))
                sets.append(s_t)
                gets.append(g_t)
        hybrid.close()
        with tempfile.TemporaryDirectory(dir=str(ROOT)) as directory:  # this disk (not a tmpfs /tmp)
            times["sglang file"] = bench_file(directory, rounds)
    finally:
        Ems.shutdown()
        node.cleanup()
    rates = {name: (best(s), best(g)) for name, (s, g) in times.items()}
    page_kib = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2 / 1024
    print(f"\n{PAGES} pages of {page_kib:.0f} KiB per call, best of {rounds} rounds, one pool node on 127.0.0.1\n")
    for line in table_rows(rates):
        print(line)
    plot = save_plot(rates)
    if args.quick:
        return 0
    figures = []
    note = f"{PAGES} pages of {page_kib:.0f} KiB a call, best of {rounds} interleaved rounds"
    for layout in LAYOUTS:
        s, g = rates[f"backend {layout}"]
        sdk = rates[f"sdk {layout}"]
        figures.append(Figure(f"HiCache batch_set_v1 ({layout})", s, "pages/s", "sdk save", sdk[0], Goal(">=", 0.9), plot, note))
        figures.append(Figure(f"HiCache batch_get_v1 ({layout})", g, "pages/s", "sdk load", sdk[1], Goal(">=", 0.9), plot, note))
    s, g = rates["backend v2-mamba"]
    sdk = rates["sdk v2-mamba"]
    note_v2 = f"{PAGES} Mamba state slots of 536 KiB a call, best of {rounds} interleaved rounds"
    figures.append(Figure("HiCache batch_set_v2 (Mamba state)", s, "pages/s", "sdk save", sdk[0], Goal(">=", 0.9), plot, note_v2))
    figures.append(Figure("HiCache batch_get_v2 (Mamba state)", g, "pages/s", "sdk load", sdk[1], Goal(">=", 0.9), plot, note_v2))
    f_s, f_g = rates["sglang file"]
    b_s, b_g = rates["backend layer_first"]
    figures.append(Figure("HiCache set (layer_first) vs SGLang file backend", b_s, "pages/s", "sglang file set", f_s, None, plot))
    figures.append(Figure("HiCache get (layer_first) vs SGLang file backend", b_g, "pages/s", "sglang file get", f_g, None, plot))
    run = Run("sglang", command_line(), figures, machine=machine())
    print(f"results: {record(run)}")
    with (HERE / "RESULTS.md").open("a") as f:
        f.write(
            f"\n## SGLang HiCache backend (issue 44), {datetime.date.today()}, cpu, one node on loopback\n\n"
            f"Command: `{run.command}` (SGLang venv) at commit {run.commit}. {PAGES} pages of {page_kib:.0f} KiB per "
            f"call, best of {rounds} rounds; pages/s and the ratio to the package's own save/load of the same bytes "
            "(goal >= 0.9; backend and SDK alternate round by round over the same registered host pool) and to SGLang's "
            f"`file` backend on this disk (its rounds run after the others); `v2-mamba`: {PAGES} Mamba state slots of "
            f"536 KiB a call through batch_set_v2 / batch_get_v2 against that pool's own client. Machine: {run.machine}.\n\n"
            + "\n".join(table_rows(rates))
            + "\n"
        )
    return 0


def table_rows(rates: dict[str, tuple[float, float]]) -> list[str]:
    """The table: every path's rates, and each against the SDK on the same layout (file: against layer_first's)."""
    rows = ["| path | set pages/s | get pages/s | set vs sdk | get vs sdk |", "|---|---|---|---|---|"]
    for name, (s, g) in rates.items():
        layout = name.split()[-1] if name.split()[-1] in ROWS else "layer_first"
        sdk = rates[f"sdk {layout}"]
        rows.append(f"| {name} | {s:.0f} | {g:.0f} | {s / sdk[0]:.2f} | {g / sdk[1]:.2f} |")
    return rows


def save_plot(rates: dict[str, tuple[float, float]]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return None
    names = list(rates)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.4
    xs = range(len(names))
    ax.bar([x - width / 2 for x in xs], [rates[n][0] for n in names], width, label="set")
    ax.bar([x + width / 2 for x in xs], [rates[n][1] for n in names], width, label="get")
    ax.set_xticks(list(xs), names, rotation=15)
    ax.set_ylabel("pages/s")
    ax.set_title(f"SGLang HiCache: {PAGES}-page calls to one pool node")
    ax.legend()
    fig.tight_layout()
    path = HERE / "sglang.png"
    fig.savefig(path)
    return str(path.relative_to(ROOT))


if __name__ == "__main__":
    sys.exit(main())
