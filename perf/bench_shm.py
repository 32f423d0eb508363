"""Same-host shared memory against UCX, side by side in one run, next to a plain copy of the same bytes.

One `python -m ems.pool` node on 127.0.0.1, one client process. Rounds alternate shared memory on and off on the
same connection setup (the `UcxNode`'s shared-memory client is switched off for the "off" rows, so every byte
crosses loopback UCX), best of N rounds after a warm-up round:
* API: `ContextCaching.save` / `.load` (`Ems.init(pool_nodes=[the node])`, no read cache) of one request of
  BLOCKS 1 MiB blocks (16 layers x 8 KV heads x 128 fp16, 16 tokens a block) through the pipelined staged path, at
  each chunk size of `--chunks` (EMS_CHUNK_BYTES; with shared memory the node's copies of chunk k overlap the
  client's work on chunk k-1);
* transport: `PoolClient.put` / `get_into` of the same number of well-formed 1 MiB values in one call;
* plain copy: `torch.Tensor.copy_` of the same number of bytes between two preallocated contiguous tensors.
Prints a table (GB/s and ratios to the plain copy) and the stage tables of the best API jobs; writes perf/shm.png.
Usage: flock /tmp/ems-bench.lock python perf/bench_shm.py [--blocks 32] [--rounds 5] [--threads 1] [--node-capacity S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))

import torch  # noqa: E402
from benchlib import best_of, machine  # noqa: E402
from pool_testlib import PoolProcess, make_values  # noqa: E402

import ems.transport.ucx.config  # noqa: E402,F401 - UCX environment before ucxx loads
from ems.backends.base import PoolCall  # noqa: E402
from ems.backends.pool_client import PoolClient  # noqa: E402
from ems.transport.ucx.client import UcxNode  # noqa: E402
from ems.types import CcKvOption  # noqa: E402

MODES = ("shm", "ucx")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=32, help="1 MiB blocks per call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (2 shared cores: 1)")
    parser.add_argument(
        "--node-capacity",
        default="160MiB",
        help="the node's capacity: small enough that saves evict after the warm-up (the steady state: "
        "buffers recycled, no fresh pages)",
    )
    parser.add_argument(
        "--chunks", default="32MiB,8MiB", help="EMS_CHUNK_BYTES values for the API rows, comma-separated (32MiB: the default)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from ems import CcConfig, Ems, EmsConfig
    from ems.records import JobKind, stage_table
    from ems.tools.demo import Engine

    blocks = args.blocks
    value_bytes = (1 << 20) + 40  # a 1 MiB block and its header
    total = blocks * value_bytes
    print(f"# {machine()}")
    node = PoolProcess(args.node_capacity)
    option = CcKvOption(timeout=60_000, write_rcache=False)
    chunks = [c.strip() for c in args.chunks.split(",") if c.strip()]
    api_ops = [f"{op}@{c}" for c in chunks for op in ("save", "load")]
    best = {m: {k: float("inf") for k in (*api_ops, "put", "get_into")} for m in MODES}
    records: dict = {}
    load_before = os.getloadavg()[0]
    client = None
    try:
        Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "bench-shm"), pool_nodes=[node.address], read_cache_capacity=0))
        cc = Ems.get_cc()
        ucx_node = next(n for n in cc._pool.nodes if isinstance(n, UcxNode))
        if ucx_node.shm is None:
            raise RuntimeError("the node is not on this host or EMS_POOL_SHM=off: nothing to compare")
        shm_client = ucx_node.shm
        engine = Engine(16, 2 * blocks, 16, 8, 128, torch.float16, torch.device("cpu"))
        cc.register_kvcache(engine.kvcache)
        for plane in engine.planes:
            plane.copy_(torch.randn(plane.shape, dtype=torch.float32).to(plane.dtype))
        slots = engine.slots(engine.allocate(blocks))
        offsets = [16] * blocks
        direct = UcxNode(node.address, connect_timeout_ms=5000)
        client = PoolClient([direct])
        direct_shm = direct.shm
        values = make_values(blocks, value_bytes - 40, seed=blocks)
        outs = [np.empty(value_bytes, np.uint8) for _ in range(blocks)]
        src = torch.randn(total // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        copy_s = float("inf")
        counter = iter(range(1, 1 << 30))
        warm_up = 3  # connections, regions, staging, and the node's store filled (later saves recycle its buffers)
        for round_ in range(-warm_up + 1, args.rounds + 1):  # rounds up to 0 are not counted
            for mode in MODES:
                ucx_node.shm = shm_client if mode == "shm" else None
                direct.shm = direct_shm if mode == "shm" else None
                times: dict = {}
                for chunk in chunks:
                    os.environ["EMS_CHUNK_BYTES"] = chunk
                    hashes = [next(counter) * 1000 + i for i in range(blocks)]
                    start = time.perf_counter()
                    if cc.save(slots, hashes, offsets, option).success != blocks:
                        raise RuntimeError("save incomplete")
                    times[f"save@{chunk}"] = (time.perf_counter() - start, cc.jobs.last(JobKind.SAVE))
                    start = time.perf_counter()
                    if cc.load(slots, hashes, offsets, option).success != blocks:
                        raise RuntimeError("load incomplete")
                    times[f"load@{chunk}"] = (time.perf_counter() - start, cc.jobs.last(JobKind.LOAD))
                keys = [b"client-%d-%d" % (next(counter), i) for i in range(blocks)]
                t_put = best_of(lambda: client.put(PoolCall(keys, keys, option), values), 1)  # type: ignore[union-attr]
                got = client.get_into(PoolCall(keys, keys, option), outs)  # type: ignore[union-attr]
                if not all(got.results) or bytes(outs[-1]) != b"".join(values[-1]):
                    raise RuntimeError(f"get_into: a value did not come back ({got.errors})")
                t_get = best_of(lambda: client.get_into(PoolCall(keys, keys, option), outs), 1)  # type: ignore[union-attr]
                if round_ <= 0:
                    continue
                times.update({"put": (t_put, None), "get_into": (t_get, None)})
                for name, (t, record) in times.items():
                    if t < best[mode][name]:
                        best[mode][name] = t
                        records[(mode, name)] = record
            if round_ > 0:
                copy_s = min(copy_s, best_of(lambda: dst.copy_(src), 3))
    finally:
        if client is not None:
            client.close()
        Ems.shutdown()
        node.cleanup()
    copy_gbps = total / copy_s / 1e9
    lines = [
        f"Same host: {blocks} x 1 MiB blocks ({total / 2**20:.0f} MiB a call), one node on 127.0.0.1, best of "
        f"{args.rounds} interleaved rounds, node capacity {args.node_capacity}; load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after; "
        f"plain copy (torch copy_ of {total / 2**20:.0f} MiB) {copy_gbps:.2f} GB/s",
        "",
        "| path | shm save GB/s | shm load GB/s | UCX save GB/s | UCX load GB/s | shm save / copy | shm load / copy "
        "| shm / UCX save | shm / UCX load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    figures = {}
    rows = [(f"API save / load, EMS_CHUNK_BYTES={c}", f"save@{c}", f"load@{c}") for c in chunks]
    for label, save, load in rows + [("transport (PoolClient put / get_into, one call)", "put", "get_into")]:
        s_s, s_l = total / best["shm"][save] / 1e9, total / best["shm"][load] / 1e9
        u_s, u_l = total / best["ucx"][save] / 1e9, total / best["ucx"][load] / 1e9
        figures[label] = (s_s, s_l, u_s, u_l)
        lines.append(
            f"| {label} | {s_s:.2f} | {s_l:.2f} | {u_s:.2f} | {u_l:.2f} | {s_s / copy_gbps:.2f}x "
            f"| {s_l / copy_gbps:.2f}x | {s_s / u_s:.2f}x | {s_l / u_l:.2f}x |"
        )
    print("\n".join(lines))
    print()
    shown = [records[(m, f"{op}@{chunks[0]}")] for m in MODES for op in ("save", "load")]
    print(
        stage_table(shown).replace("| job |", f"| job (EMS_CHUNK_BYTES={chunks[0]}: shm save, shm load, UCX save, UCX load) |", 1)
    )
    plot(figures, copy_gbps, ROOT / "perf" / "shm.png")


def plot(figures: dict, copy_gbps: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = ["save", "load"]
    fig, axes = plt.subplots(1, len(figures), figsize=(5 * len(figures), 4))
    for ax, (title, (s_s, s_l, u_s, u_l)) in zip(axes, figures.items()):
        x = np.arange(2)
        ax.bar(x - 0.2, [s_s, s_l], 0.4, label="shared memory")
        ax.bar(x + 0.2, [u_s, u_l], 0.4, label="UCX (loopback)")
        ax.axhline(copy_gbps, color="gray", linestyle="--", label="plain copy")
        ax.set_xticks(x, labels)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
