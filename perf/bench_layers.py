"""The vLLM connector's layer-wise transfers (`transfer_granularity: "layer"`) against its step-wise ones, in real
vLLM engines on this host: TTFT and throughput of a round that computes and saves, and of rounds that load in the
step.

    flock /tmp/heavy.lock /work/venv-vllm/bin/python perf/bench_layers.py [--prompts 4] [--tokens 1024] [--repeats 2]

The random Llama of perf/bench_vllm.py (hidden 1024, 8 layers, bf16: 1 MiB blocks of 32 tokens), one local pool
node, `read_cache_capacity` 0 (every load crosses the node) and `step_policy` "in_step" (each pool hit loads inside
the step that computes the request: the path where a layer's attention can wait for that layer only). One engine per
granularity and repeat, in turn (step, layer, step, layer, ...), each running four batch rounds of `--prompts`
prompts of `--tokens` tokens (4 output tokens): 0, a new namespace epoch, computes and saves set P (warm-up); 1 and
2, vLLM's prefix cache reset (and P's saves landed), load P from the pool in the step; 3, the prefix cache reset,
computes and saves set Q (new to the pool). TTFT: the mean of vLLM's per-request first-token times; throughput:
prompt tokens computed or loaded per second of the round's wall time. The table gives each side's median over
repeats and the median (min-max) of the per-repeat ratios layer / step; the recorded figures are the medians, the
step-wise one the anchor. Prints a table, saves a bar plot (`--out`; `--plot-from` draws it from the recorded
figures where vLLM's environment has no matplotlib), records the figures (perf/results/bench_layers.json).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integrations", "vllm_connector"))

from bench_vllm import engine, make_bench_llama  # noqa: E402

GRANULARITIES = ("step", "layer")


def measure(root: str, model: str, name: str, granularity: str, prompts: list[list[int]], n: int) -> dict[str, float]:
    """One engine's rounds (see the module docstring): its save round's and load rounds' TTFT and throughput."""
    p, q = list(range(n)), list(range(n, 2 * n))
    spec = {
        "model": model,
        "prompts": prompts,
        "rounds": [p, p, p, q],
        "batch": True,
        "log_stats": True,
        "max_tokens": 4,
        "num_blocks": 4 * n * (len(prompts[0]) // 32 + 2),
        "max_model_len": len(prompts[0]) + 64,
        "max_num_batched_tokens": 8192,
        "gpu_memory_utilization": 0.5,
        "extra": {
            "local_pool_dir": os.path.join(root, "pool"),
            "local_pool_capacity": "4GiB",
            "read_cache_capacity": 0,
            "step_policy": "in_step",
            "in_step_ms": 10000,
            "timeout_ms": 10000,
            "lookup_timeout_ms": 5000,
            "transfer_granularity": granularity,
        },
        "before_round": {
            "0": {"reset_connector": True},
            "1": {"reset_prefix_cache": True, "wait_saves": True},
            "2": {"reset_prefix_cache": True},
            "3": {"reset_prefix_cache": True},
        },
    }
    out = engine(root, name, spec)
    rounds = out["rounds"]
    tokens = n * len(prompts[0])
    for r in rounds[1] + rounds[2]:  # the load rounds: every full prompt block from the pool
        if r["num_cached_tokens"] < len(prompts[0]) - 32:
            raise RuntimeError(f"{name}: prompt {r['prompt']} took {r['num_cached_tokens']} tokens from the pool")
    if out["stats"]["worker"]["load_failed_blocks"]:
        raise RuntimeError(f"{name}: {out['stats']['worker']['load_failed_blocks']} blocks failed to load")

    def ttft(rnd: list[dict]) -> float:
        return statistics.mean(r["ttft_s"] for r in rnd)

    return {
        "save_ttft_s": ttft(rounds[3]),
        "save_tok_s": tokens / rounds[3][0]["wall_s"],
        "load_ttft_s": statistics.mean(ttft(rounds[i]) for i in (1, 2)),
        "load_tok_s": statistics.mean(tokens / rounds[i][0]["wall_s"] for i in (1, 2)),
    }


def plot(path: str, ratios: dict[str, float]) -> None:
    try:
        import matplotlib
    except ImportError:  # (vLLM's environment may not have it: `--plot-from` draws it from the recorded figures)
        print(f"no plot: matplotlib is not installed here (python perf/bench_layers.py --plot-from {RECORDED})")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(ratios)
    ax.bar(names, [ratios[k] for k in names], color=["#4c72b0", "#55a868", "#4c72b0", "#55a868"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("layer / step")
    ax.set_title("transfer_granularity layer vs step (vLLM CPU engine)")
    for i, k in enumerate(names):
        ax.text(i, ratios[k], f"{ratios[k]:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


RECORDED = "perf/results/bench_layers.json"


def plot_from(path: str, out: str) -> None:
    """The plot of a recorded run (its figures' ratios)."""
    import json

    with open(path) as f:
        figures = json.load(f)["figures"]
    plot(out, {f["name"].removeprefix("layer-wise "): f["value"] / f["anchor_value"] for f in figures})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "layers.png"))
    parser.add_argument("--record", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--workdir", help="keep the engines' specs, outputs and logs here (default: a temporary folder)")
    parser.add_argument("--plot-from", help="only draw the plot of a recorded run (e.g. " + RECORDED + ")")
    args = parser.parse_args()
    if args.plot_from:
        plot_from(args.plot_from, args.out)
        return
    rng = random.Random(45)
    prompts = [[rng.randrange(4096) for _ in range(args.tokens)] for _ in range(2 * args.prompts)]
    runs: dict[str, list[dict[str, float]]] = {g: [] for g in GRANULARITIES}
    with tempfile.TemporaryDirectory(prefix="ems-layers-") as tmp:
        root = args.workdir or tmp
        os.makedirs(root, exist_ok=True)
        model = make_bench_llama(os.path.join(root, "model"), args.tokens + 128)
        try:
            for repeat in range(args.repeats):
                for g in GRANULARITIES:
                    runs[g].append(measure(root, model, f"{g}-{repeat}", g, prompts, args.prompts))
                    print(f"repeat {repeat} {g}: {runs[g][-1]}", file=sys.stderr)
        finally:
            from ems.integrations.local_pool import stop_local_pool

            stop_local_pool(os.path.join(root, "pool"))
    keys = ("save_ttft_s", "save_tok_s", "load_ttft_s", "load_tok_s")
    ratios = {k: statistics.median(lay[k] / step[k] for step, lay in zip(runs["step"], runs["layer"])) for k in keys}
    medians = {g: {k: statistics.median(r[k] for r in runs[g]) for k in keys} for g in GRANULARITIES}
    print(f"\n{args.prompts} prompts x {args.tokens} tokens, {args.repeats} repeats (medians; ratio: median of layer/step)\n")
    print("| figure | step | layer | layer / step (min-max) |")
    print("|---|---|---|---|")
    for k in keys:
        each = [lay[k] / step[k] for step, lay in zip(runs["step"], runs["layer"])]
        print(
            f"| {k} | {medians['step'][k]:.3f} | {medians['layer'][k]:.3f} | {ratios[k]:.2f} ({min(each):.2f}-{max(each):.2f}) |"
        )
    plot(args.out, ratios)
    if args.record:
        from results import Figure, Run, command_line, record

        note = (
            f"{args.prompts} prompts x {args.tokens} tokens, {args.repeats} repeats in turn, vLLM CPU engine, step_policy in_step"
        )
        plotted = os.path.relpath(args.out, os.path.join(HERE, ".."))
        figures = [
            Figure(
                f"layer-wise {k}",
                medians["layer"][k],
                "tok/s" if "tok" in k else "s",
                f"step-wise {k}",
                medians["step"][k],
                plot=plotted,
                note=note,
            )
            for k in keys
        ]
        print(f"recorded: {record(Run('bench_layers', command_line(), figures))}")


if __name__ == "__main__":
    main()
