"""Time to first token of a long prompt in real vLLM engines: computed cold vs served from the EMS pool.

    .venv-vllm/bin/python perf/bench_vllm.py [--tokens 4000] [--out perf/vllm.png] [--results perf/RESULTS.md]

Writes a random Llama (hidden 1024, 8 layers, 16 heads, 8 KV heads, vocab 4096) into a temporary folder. Engine A
(a process) serves a warm-up prompt, then the long prompt P cold, and saves its blocks to the host's local pool node
(`EmsConnector`, no pool configured). Engine B (a second process, same pool node) serves a warm-up prompt, a
different long prompt Q of the same length cold, then P, whose full blocks it loads from the pool. TTFT = the time
of `generate(max_tokens=1)` for one prompt. The ratio that matters is B's cold Q vs B's pooled P, measured side by
side in one engine. Prints a table, saves a bar plot, appends both to RESULTS.md with this command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integrations"))


def engine(root: str, name: str, spec: dict) -> dict:
    spec_path, out_path = os.path.join(root, f"{name}.json"), os.path.join(root, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with open(os.path.join(root, f"{name}.log"), "w") as log:
        subprocess.run([sys.executable, os.path.join(HERE, "..", "tests", "integrations", "vllm_engine.py"),
                        spec_path, out_path], check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    with open(out_path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--out", default=os.path.join(HERE, "vllm.png"))
    parser.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = parser.parse_args()
    from vllm_engine import make_tiny_llama

    from ems.integrations.local_pool import stop_local_pool

    root = tempfile.mkdtemp(prefix="ems-bench-vllm-")
    model = make_tiny_llama(os.path.join(root, "model"), hidden=1024, layers=8, heads=16, kv_heads=8, vocab=4096,
                            intermediate=2816, max_pos=args.tokens + 256)
    rng = random.Random(0)
    long_p = [rng.randrange(4096) for _ in range(args.tokens)]
    long_q = [rng.randrange(4096) for _ in range(args.tokens)]
    warm_a = [rng.randrange(4096) for _ in range(64)]
    warm_b = [rng.randrange(4096) for _ in range(64)]
    pool_dir = os.path.join(root, "pool")
    base = {"model": model, "prompts": [long_p, long_q, warm_a, warm_b], "max_tokens": 1, "connector": True,
            "extra": {"local_pool_dir": pool_dir, "local_pool_capacity": "1GiB"},
            "num_blocks": 2 * (args.tokens // 32) + 16, "max_model_len": args.tokens + 256,
            "max_num_batched_tokens": args.tokens + 256}
    load_before = os.getloadavg()[0]
    try:
        a = engine(root, "a", {**base, "rounds": [[2, 0]]})
        b = engine(root, "b", {**base, "rounds": [[3, 1, 0]]})
    finally:
        stop_local_pool(pool_dir)
    a_cold = a["rounds"][0][1]
    b_cold, b_pool = b["rounds"][0][1], b["rounds"][0][2]
    worker = b["stats"]["worker"]
    rows = [
        ("A: prompt P, cold (computes, saves)", a_cold),
        ("B: prompt Q, cold (computes)", b_cold),
        ("B: prompt P, from the pool", b_pool),
    ]
    print(f"{'engine / prompt':40} {'tokens':>7} {'cached':>7} {'TTFT s':>8}")
    for label, r in rows:
        print(f"{label:40} {args.tokens:7d} {r['num_cached_tokens']:7d} {r['seconds']:8.3f}")
    speedup = b_cold["seconds"] / b_pool["seconds"]
    load_gbps = worker["load_bytes"] / worker["load_seconds"] / 1e9 if worker["load_seconds"] else 0.0
    print(f"TTFT cold / pooled (engine B, side by side): {speedup:.1f}x; "
          f"loaded {worker['load_blocks']} blocks, {worker['load_bytes'] / 2**20:.1f} MiB at {load_gbps:.2f} GB/s")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.barh([label for label, _ in rows][::-1], [r["seconds"] for _, r in rows][::-1], color=["#2a7", "#c44", "#c44"])
    ax.set_xlabel(f"time to first token, s ({args.tokens}-token prompt)")
    ax.set_title(f"vLLM (CPU) + EmsConnector: TTFT cold vs from the pool, {speedup:.1f}x", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)

    import torch
    import vllm

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE,
                            check=False).stdout.strip()
    lines = [
        "",
        f"## vLLM: time to first token, cold vs from the pool ({time.strftime('%Y-%m-%d')}, cpu)",
        "",
        (
            f"Command: `.venv-vllm/bin/python perf/bench_vllm.py --tokens {args.tokens}` at commit {commit}. "
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs "
            f"(load average {load_before:.1f} at start: noisy), vllm {vllm.__version__} (CPU attention), torch "
            f"{torch.__version__}. Random Llama, hidden 1024, 8 layers, 16 heads, 8 KV heads, bf16, block 32; one "
            "run. Engine A and engine B are separate processes sharing the host's local pool node (started by the "
            "connector). TTFT = `generate(max_tokens=1)` of one prompt. Compare within engine B (side by side); "
            "engine A's cold time swings with the shared machine's load. Plot: `perf/vllm.png`."
        ),
        "",
        "| engine / prompt | tokens | cached tokens | TTFT s |",
        "|---|---|---|---|",
        *[f"| {label} | {args.tokens} | {r['num_cached_tokens']} | {r['seconds']:.3f} |" for label, r in rows],
        "",
        (
            f"Cold / pooled TTFT in engine B, side by side: **{speedup:.1f}x**. Engine B loaded "
            f"{worker['load_blocks']} blocks ({worker['load_bytes'] / 2**20:.1f} MiB) at {load_gbps:.2f} GB/s "
            "(`ContextCaching.load` from the pool node over UCX loopback: get + verify + scatter; the lookup is "
            "not timed); the block holding the prompt's last token is always computed."
        ),
        "",
    ]
    with open(args.results, "a") as f:
        f.write("\n".join(lines))
    print(f"plot: {args.out}; figures appended to {args.results}")


if __name__ == "__main__":
    main()
