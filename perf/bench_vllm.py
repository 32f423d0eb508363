"""EmsConnector in real vLLM engines: TTFT cold vs from the pool vs vLLM's prefix cache, co-running decodes with
and without the connector while loads happen, and the worst step time with a hung pool node.

    flock /tmp/ems-bench.lock .venv-vllm/bin/python perf/bench_vllm.py [--tokens 4000] [--competitor N] [--out perf/vllm.png]

Writes a random Llama (hidden 1024, 8 layers, 16 heads, 8 KV heads, vocab 4096) into a temporary folder; every
engine is its own process (tests/integrations/vllm_connector/vllm_engine.py) on one local pool node (`EmsConnector`, no pool
configured, `read_cache_capacity` 0 so that every lookup and load crosses the node).

1. TTFT: engine A serves the long prompt P cold and saves it. Engine B: prompt Q of the same length cold, then P
   from the pool at once (Q's saves still in flight); then, once quiet (its prefix cache reset, Q's saves done), P
   from the pool and P from vLLM's own prefix cache side by side: the goal's ratio. TTFT =
   `generate(max_tokens=1)` of one prompt. Pool-load GB/s: the bytes engine B loaded over the seconds its load
   jobs took (the job records of the connector's `async_load` calls, each from the call to its end: get + verify
   + scatter).
2. Co-running decodes: 16 requests sharing a `--prefix`-token prefix (distinct 64-token tails, 32 tokens each),
   submitted at once. With the connector (engine B, its prefix cache reset; the pool holds the prompts, saved by
   its warm-up round) each request first loads its blocks asynchronously while the others decode. Without it
   (engine C): the same prompts from vLLM's own prefix cache (warm: the like-for-like comparison, both skip the
   prefill), and computed (prefix cache reset). ITL = a request's (last token - first token) / (tokens - 1) from
   vLLM's per-request timestamps, averaged over the 16; throughput = generated tokens / wall time.
3. Hung node: engine B runs the 16 requests again (prefix cache reset) with its pool node SIGSTOPped: the worst
   step time against engine C's (which computes the same prompts: the hung node's lookups miss), with
   `lookup_timeout_ms` 300. The first round of engines B and C is a warm-up (not reported).
Prints a table, saves a bar plot, appends both to RESULTS.md with this command. `--competitor N`: a busy host, a
process of N spinning Python threads (`servers.start_competitor`) beside the engines from the first to the last.

    flock /tmp/ems-bench.lock .venv-vllm/bin/python perf/bench_vllm.py --pressure [--policy fail|recompute]

4. `--pressure` (only this): a small pool node (`--node`, 2 MiB) behind two engines of a tiny random Llama (16 KiB
   blocks) running side by side: the writer computes `--prompts` distinct prompts of `--blocks` full blocks one
   after the other (each saved, evicting the oldest), the reader asks for prompt k while the writer computes prompt
   k + `--lag` + 1 (the two follow each other's progress; `--batch N`: N prompts at once, round by round), so what
   it reads is being evicted under it. vLLM's `kv_load_failure_policy` is left at its default ("fail") unless
   `--policy` names one. Reports the reader's failed requests, its hits, whether its tokens
   are the writer's (computed without the pool), the blocks its lookups promised and its loads did not deliver, and
   both engines' "could not read the namespace epoch" lines.

    flock /tmp/heavy.lock .venv-vllm/bin/python perf/bench_vllm.py --round [--prefix 1024] [--out perf/vllm_steps.png]

5. `--round` (only this): the 16-request round of mode 2, with the connector (engine B: round 0 computes and saves
   the prompts, round 1, its prefix cache reset, loads them from the pool) and without (engine C: round 1 from
   vLLM's prefix cache), side by side: steps, throughput, ITL, TTFT and their ratios, and the connector's per-step
   record of B's round 1 (`EmsConnector.step_records`: lookups, loads, saves, their waits), summed in RESULTS.md
   and plotted step by step.

    flock /tmp/heavy.lock .venv-vllm/bin/python perf/bench_vllm.py --pd [--tokens 1500]

6. `--pd` (only this): disaggregated prefill/decode as a user runs it: two OpenAI servers of the bench Llama on one
   local pool node, a prefill server (`kv_role` `kv_producer`) and a decode server (`kv_consumer`), vLLM's
   multi-process mode. For each of `--pd-prompts` prompts of `--tokens` tokens: the prefill server computes it
   (`max_tokens` 1, as `pd_proxy` sends it), then the decode server gets it with the prefill response's
   `kv_transfer_params` at once (the proxy's path: it may wait for blocks still being saved) and, for another
   prompt, once the saves have landed (1 s later); then the prefill server gets the same prompt again (a hit in
   its own prefix cache). TTFT = the wall time of a `max_tokens` 1 request over HTTP, the same on every side; the
   ratio decode / prefix-cache hit is the goal's (<= 1.3), and prefill + decode is what a client of the proxy
   waits. The producer's `producer_response` is the connector's default unless `--pd-producer-response` names one.
   Both servers run with `OMP_WAIT_POLICY=PASSIVE` (unless the environment sets it): two engines share these
   cores, and an engine's OpenMP threads spinning after its forward slow the other engine's next step (measured:
   the prefix-cache hit right after the decode server's request took 285 ms with the spin, 66 ms without;
   perf/RESULTS.md, "P/D decode TTFT on a quiet host, with and without OpenMP's spin-wait").

    flock /tmp/heavy.lock .venv-vllm/bin/python perf/bench_vllm.py --fair [--fair-rounds 5] [--competitor N]

7. `--fair` (only this): the 16-request round measured so that both sides see the same moment (issue 45 item 0, as
   `perf/bench_serving.py` measures a serving run): engine A (the connector) first computes and saves one fresh
   prompt set per round (16 requests sharing a `--prefix`-token prefix, as in mode 2); then engine B (the
   connector, its prefix cache reset before each round: every set from the pool) and engine C (no connector: each
   set computed once, cold, then run again from vLLM's prefix cache, warm) are up at once and take turns round by
   round (a shared turns file: C cold, then B and C warm, which of the two goes first alternating), with the
   competitor, if any, beside both for the whole run. Round 0 is a warm-up. Per round: B / C-warm ITL,
   throughput, TTFT and steps; the figures are the medians over the rounds of those ratios, with their minimum and
   maximum. Prints a table, records the figures (`perf/results/vllm-fair-quiet.json`, `-busy.json`, or
   `-busy-pinned.json` with `--competitor-cpus`) and appends the table to RESULTS.md; the plot needs matplotlib (the
   vLLM venv has none: `--fair-from ROWS`, with the rows file the run printed, draws it and records the figures
   from another interpreter). `--competitor-cpus 1` with `VLLM_CPU_OMP_THREADS_BIND=0-1`: the competitor pinned to
   a core the engines' OpenMP threads are bound to, so every forward meets it (unpinned, whether an engine's two
   OpenMP threads share a core with the spinner is the OS's placement: a 10x difference in step time that falls on
   either engine from round to round).
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
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integrations", "vllm_connector"))
# the engines' OpenMP threads: unbound unless the environment names cores (`--fair --competitor-cpus`)
OMP_BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def engine(root: str, name: str, spec: dict) -> dict:
    spec_path, out_path = os.path.join(root, f"{name}.json"), os.path.join(root, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": OMP_BIND}
    with open(os.path.join(root, f"{name}.log"), "w") as log:
        subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "..", "tests", "integrations", "vllm_connector", "vllm_engine.py"),
                spec_path,
                out_path,
            ],
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    with open(out_path) as f:
        return json.load(f)


def ems_commit() -> str:
    """The commit of the `ems` the engines import (this interpreter's), with "+changes" when its tree differs."""
    import ems

    where = os.path.dirname(os.path.abspath(ems.__file__))
    run = {"capture_output": True, "text": True, "cwd": where, "check": False}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()  # type: ignore[call-overload]
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run).stdout.strip()  # type: ignore[call-overload]
    return f"{commit}{'+changes' if dirty else ''} ({where})"


def make_bench_llama(path: str, max_pos: int) -> str:
    """The random Llama of modes 1-3 (hidden 1024, 8 layers, 8 KV heads: 1 MiB blocks of 32 tokens in bf16)."""
    from vllm_engine import make_tiny_llama

    return make_tiny_llama(path, hidden=1024, layers=8, heads=16, kv_heads=8, vocab=4096, intermediate=2816, max_pos=max_pos)


def start_engine(root: str, name: str, spec: dict, multiprocessing: bool = False) -> subprocess.Popen:
    """`engine`, started in the background (`finish_engine` waits for it)."""
    spec_path, out_path = os.path.join(root, f"{name}.json"), os.path.join(root, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    mp = "1" if multiprocessing else "0"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": mp, "VLLM_CPU_OMP_THREADS_BIND": OMP_BIND}
    script = os.path.join(HERE, "..", "tests", "integrations", "vllm_connector", "vllm_engine.py")
    with open(os.path.join(root, f"{name}.log"), "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, script, spec_path, out_path], stdout=log, stderr=subprocess.STDOUT, env=env)


def finish_engine(root: str, name: str, proc: subprocess.Popen, timeout_s: float = 900.0) -> dict:
    if proc.wait(timeout_s) != 0:
        raise RuntimeError(f"engine {name} exited {proc.returncode}: see {os.path.join(root, name + '.log')}")
    with open(os.path.join(root, f"{name}.out.json")) as f:
        return json.load(f)


def log_count(root: str, name: str, text: str) -> int:
    with open(os.path.join(root, f"{name}.log")) as f:
        return sum(text in line for line in f)


def pressure(args: argparse.Namespace) -> None:
    """Mode 4 (see the module docstring)."""
    from vllm_engine import make_tiny_llama

    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    root = tempfile.mkdtemp(prefix="ems-bench-pressure-")
    block = 32
    if args.model == "tiny":  # 16 KiB blocks
        model, vocab = make_tiny_llama(os.path.join(root, "model")), 512
    else:  # modes 1-3's model: 1 MiB blocks
        model, vocab = make_bench_llama(os.path.join(root, "model"), args.blocks * block + 256), 4096
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(args.blocks * block + 16)] for _ in range(args.prompts)]
    pool_dir = os.path.join(root, "pool")
    progress = {name: os.path.join(root, f"{name}.progress") for name in ("writer", "reader")}
    base: dict = {
        "model": model,
        "prompts": prompts,
        "rounds": [list(range(args.prompts))],
        "max_tokens": 4,
        # the connector's defaults, but for the node (and no read cache: every lookup and load asks the node)
        "extra": {"local_pool_dir": pool_dir, "read_cache_capacity": 0},
        "num_blocks": 4 * args.blocks + 16,
        "max_model_len": args.blocks * block + 64,
    }
    if args.policy:
        base["kv_load_failure_policy"] = args.policy
    load_before = os.getloadavg()[0]
    try:
        ensure_local_pool(pool_dir, args.node)
        follow = {"total": args.prompts}
        # in step: the reader asks for prompt k (round k) while the writer computes prompt (round) k + lag + 1
        rounds = [list(range(i, min(i + args.batch, args.prompts))) for i in range(0, args.prompts, args.batch)]
        spec = {**base, "rounds": rounds, **({"batch": True} if args.batch > 1 else {})}
        w_spec = {**spec, "follow": {**follow, "file": progress["reader"], "lag": -(args.lag + 2) * args.batch}}
        r_spec = spec
        r_follow = {**follow, "file": progress["writer"], "lag": args.lag * args.batch}
        writer = start_engine(root, "writer", {**w_spec, "progress_file": progress["writer"]}, args.mp)
        reader = start_engine(root, "reader", {**r_spec, "progress_file": progress["reader"], "follow": r_follow}, args.mp)
        w = finish_engine(root, "writer", writer)
        r = finish_engine(root, "reader", reader)
    finally:
        stop_local_pool(pool_dir)
    expected = {x["prompt"]: x.get("tokens") or x["samples"][0] for rnd in w["rounds"] for x in rnd}
    reads = [x for rnd in r["rounds"] for x in rnd]
    failed = [x for x in reads if x.get("finish_reason") == "error"]
    served = [x for x in reads if x.get("finish_reason") != "error"]
    same = sum((x.get("tokens") or x["samples"][0]) == expected[x["prompt"]] for x in served)
    hits = [x for x in served if x["num_cached_tokens"] > 0]
    worker, scheduler = r["stats"].get("worker", {}), r["stats"].get("scheduler", {})
    epoch_lines = {n: log_count(root, n, "could not read the namespace epoch") for n in ("writer", "reader")}
    row = {
        "requests": len(reads),
        "failed": len(failed),
        "hits": len(hits),
        "hit_rate": sum(x["num_cached_tokens"] for x in hits) / max(1, len(reads) * args.blocks * block),
        "same_tokens": same,
        "promised": scheduler.get("lookup_hit_blocks", 0),
        "loaded": worker.get("load_blocks", 0),
        "load_failed": worker.get("load_failed_blocks", 0),
        "epoch_lines": epoch_lines,
        "failing_lines": log_count(root, "reader", "due to KV load failure"),
    }
    print(json.dumps(row))
    commit = ems_commit()
    policy = args.policy or "vLLM's default (fail)"
    model_words = "tiny, 16 KiB" if args.model == "tiny" else "hidden 1024, 8 layers, 1 MiB"
    lines = [
        "",
        f"## vLLM: two engines on a {args.node} node, one filling it while the other reads ({time.strftime('%Y-%m-%d')})",
        "",
        (
            f"Command: `flock /tmp/ems-bench.lock .venv-vllm/bin/python perf/bench_vllm.py {' '.join(sys.argv[1:])}` "
            f"at commit {commit}; {os.cpu_count()} cores shared with other jobs (load average {load_before:.1f} at "
            f"start). Random Llama ({model_words} blocks), {args.blocks} full blocks a prompt, {args.batch} at once; "
            f"kv_load_failure_policy: {policy}. Logs: {root}."
        ),
        "",
        "| reader requests | failed | with hits | hit rate (prompt tokens) | same tokens as the writer | blocks promised | "
        "loaded | promised, not loaded | epoch-read failures (writer, reader) |",
        "|---|---|---|---|---|---|---|---|---|",
        (
            f"| {row['requests']} | {row['failed']} | {row['hits']} | {row['hit_rate']:.2f} | {same} of {len(served)} | "
            f"{row['promised']} | {row['loaded']} | {row['load_failed']} | {epoch_lines['writer']}, {epoch_lines['reader']} |"
        ),
        "",
    ]
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n".join(lines))


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def batch_row(label: str, rnd: list[dict], generated: int) -> dict:
    steps = rnd[0]["step_s"]
    return {
        "label": label,
        "steps": len(steps),
        "itl_s": mean([r["itl_s"] for r in rnd]),
        "ttft_s": mean([r["ttft_s"] for r in rnd]),
        "max_step_s": max(steps, default=0.0),
        "wall_s": rnd[0]["wall_s"],
        "tokens_per_s": generated / rnd[0]["wall_s"],
        "cached": sum(r["num_cached_tokens"] for r in rnd),
        "max_used_blocks": rnd[0].get("max_used_blocks", 0),
        "decode_step_ms": 1000 * median_decode_step(rnd),
    }


def median_decode_step(rnd: list[dict]) -> float:
    """The median of the round's last 16 steps (decode steps: every request has had its first token by then)."""
    tail = sorted(rnd[0]["step_s"][-16:])
    return tail[len(tail) // 2] if tail else 0.0


def step_summary(steps: list[float], records: dict) -> dict:
    """The 16-request round's per-step record (the connector's `step_records`), summed: where the steps went."""
    sched, work = records.get("scheduler", []), records.get("worker", [])
    return {
        "engine_steps": len(steps),
        "idle_steps": sum(r["scheduled_tokens"] == 0 for r in sched),
        "steps_with_lookups_waiting": sum(r["lookups_waiting"] > 0 for r in sched),
        "load_waits": sum(r.get("load_waits", 0) for r in sched),
        "loads_deferred": sum(r.get("loads_deferred", 0) for r in sched),  # put off to the next step
        "lookup_batches": sum(r["lookup_batches"] for r in sched),
        "lookup_s": sum(r["lookup_s"] for r in sched),
        "scheduler_wait_s": sum(r["wait_s"] for r in sched),
        "loads_sent": sum(r["loads_sent"] for r in sched),
        "steps_with_loads_in_flight": sum(r["inflight"] > 0 for r in work),
        "loads_queued_max": max((r["loads_queued"] for r in work), default=0),
        "load_s_mean": sum(r["load_s"] for r in work) / max(1, sum(r["loads_done"] for r in work)),
        "worker_call_s": sum(r["call_s"] for r in work),
        "worker_wait_s": sum(r["wait_s"] for r in work),
        "step_s": sum(steps),
    }


def plot_round(out: str, plotted: str, records: dict, steps: list[float]) -> None:
    """The round's per-step record, step by step (step time, tokens, lookups waiting, calls in flight, loads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sched, work = records.get("scheduler", []), records.get("worker", [])
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    axes[0].bar(range(len(steps)), [1000 * x for x in steps], color="tab:blue")
    axes[0].set_ylabel("step ms")
    axes[1].plot([r["scheduled_tokens"] for r in sched], label="tokens scheduled")
    axes[1].set_ylabel("tokens")
    axes[1].legend(loc="upper right")
    axes[2].plot([r["lookups_waiting"] for r in sched], label="requests waiting for a lookup")
    axes[2].plot([r.get("load_waits", 0) for r in sched], label="of which for another request's load")
    axes[2].plot([r["inflight"] for r in work], label="worker calls in flight (loads, saves)")
    axes[2].plot([r["loads_done"] for r in work], label="asynchronous loads finished")
    axes[2].plot([r.get("in_step_loads", 0) for r in work], label="in-step loads")
    axes[2].set_ylabel("count")
    axes[2].set_xlabel(f"engine step (16 requests from the pool, with the connector, step_policy {plotted})")
    axes[2].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


ROUND_NEW_TOKENS = 32  # tokens each request of the 16-request round generates


def round_spec(model: str, prompts: list[list[int]], prefix: int, pool_dir: str) -> dict:
    """The engine spec of the 16-request round (modes 5 and 7): batch rounds of 16 requests sharing a `prefix`-token
    prefix with 64-token tails, vLLM's per-request timestamps, room for one round's blocks, the local pool node at
    `pool_dir` (no read cache: every lookup and load crosses the node)."""
    return {
        "model": model,
        "prompts": prompts,
        "batch": True,
        "max_tokens": ROUND_NEW_TOKENS,
        "log_stats": True,
        "extra": {"local_pool_dir": pool_dir, "read_cache_capacity": 0, "lookup_timeout_ms": 300},
        "kv_load_failure_policy": "recompute",
        "num_blocks": 16 * ((prefix + 64 + ROUND_NEW_TOKENS) // 32 + 2) + 16,
        "max_model_len": prefix + 256,
        "max_num_batched_tokens": prefix + 256,
    }


def round_only(args: argparse.Namespace) -> None:
    """Mode 5 (`--round`): only the 16-request round, with the connector (engine B, once per `--step-policies`: the
    prompts from the pool) and without (engine C: from vLLM's prefix cache), side by side, with the connector's
    per-step record of each B's round and each engine's CPU seconds by thread."""
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    policies = [p for p in args.step_policies.split(",") if p]
    root = tempfile.mkdtemp(prefix="ems-bench-round-")
    model = make_bench_llama(os.path.join(root, "model"), args.prefix + 256)
    rng = random.Random(0)
    prefix = [rng.randrange(4096) for _ in range(args.prefix)]
    many = [prefix + [rng.randrange(4096) for _ in range(64)] for _ in range(16)]
    pool_dir = os.path.join(root, "pool")
    new_tokens = ROUND_NEW_TOKENS
    base = {**round_spec(model, many, args.prefix, pool_dir), "rounds": [list(range(16)), list(range(16))]}
    extra = base["extra"]
    load_before = os.getloadavg()[0]
    bs: dict[str, dict] = {}
    try:
        ensure_local_pool(pool_dir, "2GiB")
        # C: round 0 computes; round 1 from vLLM's prefix cache
        c = engine(root, "c", {**base, "connector": False})
        # B, per step policy: round 0 computes and saves the prompts; round 1 (its prefix cache reset) loads them
        # from the pool (every B's epoch is its own: a reset before round 0 makes the pool's earlier blocks misses)
        for policy in policies:
            bs[policy] = engine(
                root,
                f"b-{policy}",
                {
                    **base,
                    "extra": {**extra, "step_policy": policy},
                    "before_round": {"0": {"reset_connector": True}, "1": {"reset_prefix_cache": True}},
                },
            )
    finally:
        stop_local_pool(pool_dir)
    generated = 16 * new_tokens
    prefix_cache = batch_row("16 requests, without the connector (vLLM's prefix cache)", c["rounds"][1], generated)
    computed = batch_row("16 requests, without the connector (computed)", c["rounds"][0], generated)
    rows, lines_by_policy, summaries = [], [], {}
    for policy, b in bs.items():
        row = batch_row(f"16 requests, with the connector (from the pool), step_policy {policy}", b["rounds"][1], generated)
        rows.append(row)
        records = b.get("step_records", {}).get("1", {})
        summary = step_summary(b["rounds"][1][0]["step_s"], records)
        summaries[policy] = (summary, records)
        ratios = {
            "steps": row["steps"] / prefix_cache["steps"],
            "throughput": row["tokens_per_s"] / prefix_cache["tokens_per_s"],
            "itl": row["itl_s"] / prefix_cache["itl_s"],
            "ttft": row["ttft_s"] / prefix_cache["ttft_s"],
        }
        print(json.dumps({"policy": policy, **row}))
        print(json.dumps({"policy": policy, "ratios": ratios}))
        print(json.dumps({"policy": policy, "summary": summary}))
        print(json.dumps({"policy": policy, "cpu_s": b["rounds"][1][0].get("cpu_s", {})}))
        lines_by_policy += [
            (
                f"step_policy `{policy}`, with / without the connector: steps **{ratios['steps']:.2f}x** (goal <= 1.1), "
                f"throughput **{ratios['throughput']:.2f}x** (goal >= 0.9), mean ITL **{ratios['itl']:.2f}x** "
                f"(goal <= 1.1), mean TTFT {ratios['ttft']:.2f}x. Its per-step record (`EmsConnector.step_records`, "
                "summed): "
                + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
                + ". CPU seconds of the round by thread: "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(b["rounds"][1][0].get("cpu_s", {}).items()) if v >= 0.01)
                + "."
            ),
            "",
        ]
    cpu_c = c["rounds"][1][0].get("cpu_s", {})
    print(json.dumps({"policy": "none (prefix cache)", "cpu_s": cpu_c}))
    rows += [prefix_cache, computed]
    for row in rows[-2:]:
        print(json.dumps(row))
    plotted = policies[-1]
    try:
        import matplotlib
    except ImportError:  # the figures still go to RESULTS.md
        matplotlib = None
    if matplotlib is not None:
        plot_round(args.out, plotted, summaries[plotted][1], bs[plotted]["rounds"][1][0]["step_s"])
    commit = ems_commit()
    lines = [
        "",
        f"## vLLM: the 16-request round and its per-step record ({time.strftime('%Y-%m-%d')}, cpu)",
        "",
        (
            f"Command: `flock /tmp/heavy.lock .venv-vllm/bin/python perf/bench_vllm.py {' '.join(sys.argv[1:])}` at "
            f"commit {commit}; {os.cpu_count()} cores shared with other jobs (load average {load_before:.1f} at start). "
            f"Random Llama (hidden 1024, 8 layers, bf16, block 32); 16 requests sharing a {args.prefix}-token prefix "
            f"(64-token tails, {new_tokens} tokens each) submitted at once; engine B's prompts from the pool (its "
            "prefix cache reset after its first round saved them; one engine B per step policy), engine C's from "
            f"vLLM's prefix cache; one run, side by side. Plot (step_policy {plotted}): "
            f"`{os.path.relpath(args.out, HERE)}`."
        ),
        "",
        "| round | steps | throughput tok/s | mean ITL ms | mean TTFT ms | worst step ms | decode step ms (median of "
        "the last 16) | KV blocks in use (most) |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['label']} | {r['steps']} | {r['tokens_per_s']:.0f} | {1000 * r['itl_s']:.1f} | "
            f"{1000 * r['ttft_s']:.0f} | {1000 * r['max_step_s']:.0f} | {r['decode_step_ms']:.1f} | "
            f"{r['max_used_blocks']} |"
            for r in rows
        ),
        "",
        *lines_by_policy,
        "Without the connector, CPU seconds of the round by thread: "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu_c.items()) if v >= 0.01)
        + ".",
        "",
    ]
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n".join(lines))


def pd_bench(args: argparse.Namespace) -> None:
    """Mode 6 (`--pd`): decode-server TTFT from the pool against a prefix-cache hit of the same prompt."""
    from servers import api_server_argv, counter, free_port, post, server_env, start_server, wait_healthy
    from vllm_engine import stop_servers

    root = tempfile.mkdtemp(prefix="ems-bench-pd-")
    max_len = args.tokens + 256
    model = make_bench_llama(os.path.join(root, "model"), max_len)
    pool_dir = os.path.join(root, "pool")

    def serve(role: str, port: int) -> subprocess.Popen:
        transfer = {
            "kv_connector": "EmsConnector",
            "kv_connector_module_path": "ems.integrations.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"local_pool_dir": pool_dir, "read_cache_capacity": 0},
        }
        if args.pd_producer_response and role == "kv_producer":
            transfer["kv_connector_extra_config"]["producer_response"] = args.pd_producer_response
        # two engines on the same cores: OpenMP's spin-wait after one engine's forward slows the other's next step
        # (server_env sets OMP_WAIT_POLICY=PASSIVE unless the environment sets it)
        argv = api_server_argv(model, port, max_len, 4 * (max_len // 32 + 2), transfer)
        return start_server(argv, os.path.join(root, f"{role}.log"), server_env())

    rng = random.Random(7)
    prompts = [[rng.randrange(4096) for _ in range(args.tokens)] for _ in range(2 * args.pd_prompts + 1)]
    ports = {"kv_producer": free_port(), "kv_consumer": free_port()}
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    procs: dict[str, subprocess.Popen] = {}
    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    try:
        procs["kv_producer"] = serve("kv_producer", ports["kv_producer"])
        wait_healthy(urls["kv_producer"], procs["kv_producer"])  # it starts the local pool node
        procs["kv_consumer"] = serve("kv_consumer", ports["kv_consumer"])
        wait_healthy(urls["kv_consumer"], procs["kv_consumer"])

        def body(prompt: list[int], params: dict | None = None) -> dict:
            out = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
            return {**out, "kv_transfer_params": params} if params else out

        post(urls["kv_producer"], body(prompts[-1]))  # warm-up: the first request of each server, and its load
        params = post(urls["kv_producer"], body(prompts[-1]))[0].get("kv_transfer_params")
        post(urls["kv_consumer"], body(prompts[-1], params))
        for i in range(args.pd_prompts):
            proxy_prompt, quiet_prompt = prompts[2 * i], prompts[2 * i + 1]
            first, prefill_s = post(urls["kv_producer"], body(proxy_prompt))
            out_proxy, decode_proxy_s = post(urls["kv_consumer"], body(proxy_prompt, first.get("kv_transfer_params")))
            first_q, _ = post(urls["kv_producer"], body(quiet_prompt))
            time.sleep(1.0)  # its saves have landed
            out_quiet, decode_quiet_s = post(urls["kv_consumer"], body(quiet_prompt, first_q.get("kv_transfer_params")))
            _, hit_s = post(urls["kv_producer"], body(quiet_prompt))  # the same prompt, a prefix-cache hit
            cached = [o["usage"].get("prompt_tokens_details") for o in (out_proxy, out_quiet)]
            rows.append(
                {
                    "prefill_s": prefill_s,
                    "decode_proxy_s": decode_proxy_s,
                    "total_proxy_s": prefill_s + decode_proxy_s,
                    "decode_quiet_s": decode_quiet_s,
                    "prefix_hit_s": hit_s,
                    "cached": cached,
                }
            )
            print(json.dumps(rows[-1]))
        time.sleep(1.0)  # the servers record a step's statistics as they hand out its outputs
        save_waits = counter(urls["kv_consumer"], "vllm:ems_lookup_save_waits_total")
        hits = counter(urls["kv_consumer"], "vllm:ems_lookup_hit_blocks_total")
        print(json.dumps({"decode_save_waits": save_waits, "decode_hit_blocks": hits}))
    finally:
        stop_servers(procs.values(), pool_dir)

    def med(key: str) -> float:
        values = sorted(r[key] for r in rows)
        return values[len(values) // 2]

    def per_prompt(key: str) -> str:
        return ", ".join(f"{1000 * r[key]:.0f}" for r in rows)

    ratio_proxy, ratio_quiet = med("decode_proxy_s") / med("prefix_hit_s"), med("decode_quiet_s") / med("prefix_hit_s")
    print(json.dumps({"decode_proxy_over_hit": ratio_proxy, "decode_quiet_over_hit": ratio_quiet}))
    lines = [
        "",
        f"## vLLM: P/D decode TTFT vs a prefix-cache hit ({time.strftime('%Y-%m-%d')}, cpu)",
        "",
        (
            f"Command: `flock /tmp/heavy.lock .venv-vllm/bin/python perf/bench_vllm.py {' '.join(sys.argv[1:])}` at "
            f"commit {ems_commit()}; {os.cpu_count()} cores shared with other jobs (load average {load_before:.1f} at "
            f"start). Bench Llama (hidden 1024, 8 layers, bf16, block 32), {args.tokens}-token prompts, two OpenAI "
            "servers (prefill `kv_producer`, decode `kv_consumer`, vLLM's multi-process mode) on one local pool node; "
            f"producer_response {args.pd_producer_response or 'the default'}; OMP_WAIT_POLICY "
            f"{os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}; medians of {len(rows)} prompts; TTFT = a `max_tokens` 1 "
            "request's wall time over HTTP."
        ),
        "",
        "| TTFT | median ms |",
        "|---|---|",
        f"| prefill server computes the prompt | {1000 * med('prefill_s'):.0f} |",
        f"| decode server, right after the prefill response (the proxy's path) | {1000 * med('decode_proxy_s'):.0f} |",
        f"| decode server, once the saves have landed | {1000 * med('decode_quiet_s'):.0f} |",
        f"| the same prompt again on one engine (prefix-cache hit) | {1000 * med('prefix_hit_s'):.0f} |",
        f"| prefill + decode on the proxy's path (what its client waits) | {1000 * med('total_proxy_s'):.0f} |",
        "",
        f"Per prompt (ms), the proxy's path: {per_prompt('decode_proxy_s')}; prefill: {per_prompt('prefill_s')}. The "
        f"decode server's lookups asked again for blocks on their way (`save_waits`, the whole run with its warm-up): "
        f"{save_waits:.0f}; blocks its lookups hit: {hits:.0f}.",
        "",
        f"Decode / prefix-cache hit: **{ratio_proxy:.2f}x** on the proxy's path, **{ratio_quiet:.2f}x** once the saves "
        "have landed (goal <= 1.3).",
        "",
    ]
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n".join(lines))


FAIR_GOALS = {"itl": ("<=", 1.1), "throughput": (">=", 0.9)}  # the 16-request round's goals (issue 45)
FAIR_METRICS = ("itl", "throughput", "ttft", "steps")


def fair_turns(rounds: int) -> tuple[dict[str, dict], dict[str, dict]]:
    """The turns of `--fair`: engine B's and engine C's `before_round` (C runs each set twice: cold, then warm).
    Round r's turns are 3r (C cold), then B and C warm in the order that alternates with r."""
    b_before: dict[str, dict] = {}
    c_before: dict[str, dict] = {}
    for r in range(rounds):
        b_turn, c_warm_turn = (3 * r + 1, 3 * r + 2) if r % 2 == 0 else (3 * r + 2, 3 * r + 1)
        b_before[str(r)] = {"reset_prefix_cache": True, "turn": b_turn}
        c_before[str(2 * r)] = {"turn": 3 * r}
        c_before[str(2 * r + 1)] = {"turn": c_warm_turn}
    return b_before, c_before


def fair_rows(b: dict, c: dict, rounds: int, generated: int) -> list[dict]:
    """Per measured round (round 0 is the warm-up): B's round from the pool, C's cold and warm rounds."""
    rows = []
    for r in range(1, rounds):
        pooled = batch_row("pooled", b["rounds"][r], generated)
        cold = batch_row("cold", c["rounds"][2 * r], generated)
        warm = batch_row("warm", c["rounds"][2 * r + 1], generated)
        rows.append({"round": r, "b_first": r % 2 == 0, "pooled": pooled, "warm": warm, "cold": cold})
    return rows


def fair_ratios(row: dict) -> dict[str, float]:
    pooled, warm = row["pooled"], row["warm"]
    return {
        "itl": pooled["itl_s"] / warm["itl_s"],
        "throughput": pooled["tokens_per_s"] / warm["tokens_per_s"],
        "ttft": pooled["ttft_s"] / warm["ttft_s"],
        "steps": pooled["steps"] / warm["steps"],
    }


def fair_report(args: argparse.Namespace, run: dict) -> None:
    """The table of a `--fair` run's rows (`run`: what the run wrote), its figures recorded, its plot if it can."""
    from bench_serving import spread
    from results import Figure, Goal, Run, record

    rows = run["rows"]
    ratios = [fair_ratios(row) for row in rows]
    spreads = {m: spread([x[m] for x in ratios]) for m in FAIR_METRICS}
    pinned = run.get("competitor_cpus")
    busy = f"competitor {run['competitor']}" if run["competitor"] else "no competitor"
    if run["competitor"] and pinned:
        busy += f" pinned to CPU {pinned}, engines' OpenMP threads bound to {run.get('omp_bind')}"
    table = [
        "| round | first | pooled ITL ms | warm ITL ms | cold ITL ms | ITL pooled / warm | throughput pooled / warm "
        "| TTFT pooled / warm | steps pooled / warm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, x in zip(rows, ratios):
        table.append(
            f"| {row['round']} | {'B' if row['b_first'] else 'C'} | {1000 * row['pooled']['itl_s']:.1f} | "
            f"{1000 * row['warm']['itl_s']:.1f} | {1000 * row['cold']['itl_s']:.1f} | {x['itl']:.2f} | "
            f"{x['throughput']:.2f} | {x['ttft']:.2f} | {x['steps']:.2f} |"
        )
    table.append(
        "| median (min–max) | | | | | "
        + " | ".join(f"**{spreads[m].median:.2f}** ({spreads[m].low:.2f}–{spreads[m].high:.2f})" for m in FAIR_METRICS)
        + " |"
    )
    print("\n".join(table))
    bench = f"vllm-fair-{('busy-pinned' if pinned else 'busy') if run['competitor'] else 'quiet'}"
    out = args.out if args.out != os.path.join(HERE, "vllm.png") else os.path.join(HERE, f"{bench}.png")
    plotted = None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no matplotlib here: `python perf/bench_vllm.py --fair-from {run['rows_file']}` plots and records it")
    else:
        fig, ax = plt.subplots(figsize=(8, 4))
        for m, mark in (("itl", "o-"), ("throughput", "s-"), ("ttft", "^-")):
            ax.plot([row["round"] for row in rows], [x[m] for x in ratios], mark, label=f"{m} pooled / warm")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")  # (a busy host's rounds span 0.1x to 10x)
        ax.set_xlabel(f"round (a fresh prompt set each; {busy})")
        ax.set_ylabel("ratio, pooled / vLLM's prefix cache")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plotted = os.path.relpath(out, os.path.join(HERE, ".."))
    figures = [
        Figure(
            f"16-request round, pooled / prefix cache (warm), {m}, {busy}",
            spreads[m].median,
            "x",
            goal=Goal(*FAIR_GOALS[m]) if m in FAIR_GOALS else None,
            plot=plotted,
            note=f"median of {spreads[m].rounds} rounds' ratios (min {spreads[m].low:.3f}, max {spreads[m].high:.3f})",
        )
        for m in FAIR_METRICS
    ]
    recorded = Run(bench, run["command"], figures, commit=run["commit"].split(" ")[0], machine=run["machine"])
    print(f"figures: {record(recorded)}")
    if args.results:
        with open(args.results, "a") as f:
            f.write(
                "\n".join(
                    [
                        "",
                        f"## vLLM: the 16-request round, both engines up at once, {busy} ({run['date']}, cpu)",
                        "",
                        f"Command: `{run['command']}` at commit {run['commit']}; {run['machine']}. "
                        f"{len(rows)} rounds after a warm-up, each a fresh set of 16 "
                        f"requests sharing a {run['prefix']}-token prefix (32 tokens each): B from the pool, C cold then warm "
                        "(vLLM's prefix cache); cells: this round's pooled / warm ratio; the last row their median "
                        "(min–max). Goals: ITL <= 1.1x, throughput >= 0.9x.",
                        "",
                        *table,
                        "",
                    ]
                )
            )


def fair_bench(args: argparse.Namespace) -> None:
    """Mode 7 (`--fair`): see the module docstring."""
    from bench_serving import shown_arguments
    from benchlib import machine
    from servers import start_competitor
    from vllm_engine import stop_processes

    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    rounds = args.fair_rounds + 1  # round 0: the warm-up
    root = tempfile.mkdtemp(prefix="ems-bench-fair-")
    model = make_bench_llama(os.path.join(root, "model"), args.prefix + 256)
    rng = random.Random(0)
    prompts: list[list[int]] = []
    for _ in range(rounds):  # a fresh set a round: 16 requests sharing a prefix of their own
        prefix = [rng.randrange(4096) for _ in range(args.prefix)]
        prompts += [prefix + [rng.randrange(4096) for _ in range(64)] for _ in range(16)]
    sets = [list(range(16 * r, 16 * r + 16)) for r in range(rounds)]
    pool_dir, turns = os.path.join(root, "pool"), os.path.join(root, "turns")
    new_tokens = ROUND_NEW_TOKENS
    base = {**round_spec(model, prompts, args.prefix, pool_dir), "turns_file": turns}
    b_before, c_before = fair_turns(rounds)
    load_before = os.getloadavg()[0]
    described = machine()  # (its load average: at the run's start)
    competitor = None
    procs: list[subprocess.Popen] = []
    try:
        ensure_local_pool(pool_dir, "2GiB")
        engine(root, "a", {**base, "connector": True, "rounds": sets})  # every set into the pool, before B and C
        competitor = start_competitor(args.competitor, args.competitor_cpus) if args.competitor else None
        procs = [
            start_engine(root, "b", {**base, "connector": True, "rounds": sets, "before_round": b_before}),
            start_engine(
                root, "c", {**base, "connector": False, "rounds": [s for s in sets for _ in (0, 1)], "before_round": c_before}
            ),
        ]
        while all(p.poll() in (None, 0) for p in procs) and any(p.poll() is None for p in procs):
            time.sleep(1.0)  # (one that fails stops the run: the other would wait for its turns)
        b, c = finish_engine(root, "b", procs[0], 60.0), finish_engine(root, "c", procs[1], 60.0)
    finally:
        stop_processes([p for p in procs if p.poll() is None])
        if competitor is not None:
            stop_processes([competitor], grace_s=5.0)
        stop_local_pool(pool_dir)
    run = {
        "rows": fair_rows(b, c, rounds, 16 * new_tokens),
        "competitor": args.competitor,
        "competitor_cpus": args.competitor_cpus,
        "omp_bind": OMP_BIND,
        "command": (f"VLLM_CPU_OMP_THREADS_BIND={OMP_BIND} " if OMP_BIND != "nobind" else "")
        + " ".join(["python perf/bench_vllm.py", *shown_arguments(sys.argv[1:])]),
        "commit": ems_commit(),
        "machine": described,
        "date": time.strftime("%Y-%m-%d"),
        "load_before": load_before,
        "prefix": args.prefix,
        "rows_file": os.path.join(root, "fair-rows.json"),
    }
    with open(run["rows_file"], "w") as f:
        json.dump(run, f)
    print(f"rows: {run['rows_file']}")
    fair_report(args, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--out", default=os.path.join(HERE, "vllm.png"))
    parser.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"), help="'' : append nothing")
    parser.add_argument("--pressure", action="store_true", help="only mode 4: two engines on a small node")
    parser.add_argument("--node", default="2MiB", help="--pressure: the pool node's capacity")
    parser.add_argument("--prompts", type=int, default=40, help="--pressure: distinct prompts")
    parser.add_argument("--blocks", type=int, default=20, help="--pressure: full blocks a prompt")
    parser.add_argument("--lag", type=int, default=2, help="--pressure: prompts the writer is ahead")
    parser.add_argument("--mp", action="store_true", help="--pressure: vLLM's multi-process mode (no counters)")
    parser.add_argument("--batch", type=int, default=1, help="--pressure: prompts each engine runs at once")
    parser.add_argument("--model", choices=("tiny", "bench"), default="tiny", help="--pressure: the model")
    parser.add_argument("--policy", choices=("fail", "recompute"), help="--pressure: kv_load_failure_policy")
    parser.add_argument(
        "--competitor",
        type=int,
        default=0,
        help="modes 1-3 and 7: a process of N spinning Python threads beside the engines for the whole run (a busy host)",
    )
    parser.add_argument("--round", action="store_true", help="only mode 5: the 16-request round, its per-step record")
    parser.add_argument("--step-policies", default="async,auto", help="--round: one engine with the connector per step_policy")
    parser.add_argument("--fair", action="store_true", help="only mode 7: the 16-request round, both engines up at once")
    parser.add_argument("--fair-rounds", type=int, default=5, help="--fair: rounds measured (after a warm-up)")
    parser.add_argument(
        "--competitor-cpus",
        help="--fair: pin the competitor to these CPUs (a taskset -c list); with VLLM_CPU_OMP_THREADS_BIND set to the "
        "cores (e.g. 0-1) every forward then meets it, whichever engine runs (no placement luck)",
    )
    parser.add_argument("--fair-from", help="--fair: a run's rows file (table, plot and figures from it; no engines)")
    parser.add_argument("--pd", action="store_true", help="only mode 6: P/D decode TTFT vs a prefix-cache hit")
    parser.add_argument("--pd-prompts", type=int, default=3, help="--pd: prompts measured")
    parser.add_argument(
        "--pd-producer-response", choices=("after_save", "immediate"), help="--pd: the producer's producer_response"
    )
    args = parser.parse_args()
    if args.fair_from:
        with open(args.fair_from) as f:
            fair_report(args, json.load(f))
        return
    if args.fair:
        fair_bench(args)
        return
    if args.pd:
        pd_bench(args)
        return
    if args.round:
        round_only(args)
        return
    if args.pressure:
        pressure(args)
        return
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    root = tempfile.mkdtemp(prefix="ems-bench-vllm-")
    model = make_bench_llama(os.path.join(root, "model"), args.tokens + 256)
    rng = random.Random(0)
    long_p = [rng.randrange(4096) for _ in range(args.tokens)]
    long_q = [rng.randrange(4096) for _ in range(args.tokens)]
    prefix = [rng.randrange(4096) for _ in range(args.prefix)]
    shared = [prefix + [rng.randrange(4096) for _ in range(64)] for _ in range(16)]
    prompts = [long_p, long_q, *shared]
    p, q, many = 0, 1, list(range(2, 18))
    pool_dir = os.path.join(root, "pool")
    new_tokens = 32
    base = {
        "model": model,
        "prompts": prompts,
        "max_tokens": 1,
        "connector": True,
        "extra": {
            "local_pool_dir": pool_dir,
            "local_pool_capacity": "2GiB",
            "read_cache_capacity": 0,
            "lookup_timeout_ms": 300,
            "breaker_cooldown_s": 1.0,
            "timeout_ms": 5000,
        },
        "kv_load_failure_policy": "recompute",
        "num_blocks": 2 * (args.tokens // 32) + 16,
        "max_model_len": args.tokens + 256,
        "max_num_batched_tokens": args.tokens + 256,
    }
    batch = {"batch": True, "max_tokens": new_tokens, "log_stats": True}
    load_before = os.getloadavg()[0]
    from servers import start_competitor
    from vllm_engine import stop_processes

    competitor = start_competitor(args.competitor) if args.competitor else None
    try:
        node = ensure_local_pool(pool_dir, "2GiB")
        a = engine(root, "a", {**base, "rounds": [[p], [many[0]]]})  # P, and the shared prefix, into the pool
        # P from the pool right after computing Q (Q's saves still in flight), then, once the engine is quiet (its
        # prefix cache reset, Q's saves done), P from the pool and P from vLLM's prefix cache side by side
        b_ttft = engine(root, "b-ttft", {**base, "rounds": [[q, p], [p, p]], "before_round": {"1": {"reset_prefix_cache": True}}})
        b = engine(
            root,
            "b",
            {
                **base,
                **batch,
                "rounds": [many, many, many],
                "before_round": {
                    "0": {"reset_prefix_cache": True},
                    "1": {"reset_prefix_cache": True},
                    "2": {"reset_prefix_cache": True, "sigstop_pid": node.pid},
                },
            },
        )
        c = engine(
            root,
            "c",
            {
                **base,
                **batch,
                "connector": False,
                "rounds": [many, many, many],
                "before_round": {"1": {"reset_prefix_cache": True}},
            },
        )
    finally:
        stop_local_pool(pool_dir)
        if competitor is not None:
            stop_processes([competitor], 5.0)
    a_cold = a["rounds"][0][0]
    (b_cold, b_pool_busy), (b_pool, b_prefix) = b_ttft["rounds"]
    ttft_rows = [
        ("A: prompt P, cold (computes, saves)", a_cold),
        ("B: prompt Q, cold (computes)", b_cold),
        ("B: prompt P, from the pool, right after Q (Q's saves in flight)", b_pool_busy),
        ("B: prompt P, from the pool (engine quiet)", b_pool),
        ("B: prompt P, from vLLM's prefix cache", b_prefix),
    ]
    generated = 16 * new_tokens
    with_connector = batch_row("16 requests, with the connector (from the pool)", b["rounds"][1], generated)
    without_cached = batch_row("16 requests, without the connector (vLLM's prefix cache)", c["rounds"][2], generated)
    without = batch_row("16 requests, without the connector (computed)", c["rounds"][1], generated)
    hung = batch_row("16 requests, with the connector, pool node SIGSTOPped", b["rounds"][2], generated)
    worker = b_ttft["stats"]["worker"]
    print(f"{'engine / prompt':64} {'tokens':>7} {'cached':>7} {'TTFT s':>8}")
    for label, r in ttft_rows:
        print(f"{label:64} {args.tokens:7d} {r['num_cached_tokens']:7d} {r['seconds']:8.3f}")
    speedup = b_cold["seconds"] / b_pool["seconds"]
    pooled_vs_prefix = b_pool["seconds"] / b_prefix["seconds"]
    busy_vs_prefix = b_pool_busy["seconds"] / b_prefix["seconds"]
    load_gbps = worker["load_bytes"] / worker["load_seconds"] / 1e9 if worker["load_seconds"] else 0.0

    def gbps(r: dict) -> float:  # one request's load jobs
        return r.get("load_bytes", 0) / r["load_seconds"] / 1e9 if r.get("load_seconds") else 0.0

    quiet_gbps, busy_gbps = gbps(b_pool), gbps(b_pool_busy)
    print(
        f"TTFT cold / pooled (engine B): {speedup:.1f}x; pooled / prefix cache, side by side "
        f"{pooled_vs_prefix:.2f}x (goal <= 1.2; right after Q: {busy_vs_prefix:.2f}x); loaded {worker['load_blocks']} blocks, "
        f"{worker['load_bytes'] / 2**20:.1f} MiB in {worker['load_seconds']:.3f} s of load jobs: {load_gbps:.2f} GB/s; "
        f"the quiet load {quiet_gbps:.2f} GB/s (goal >= 2), the one right after Q {busy_gbps:.2f} GB/s"
    )
    load_stages = b_ttft["stats"].get("jobs", {}).get("load", {}).get("stages", {})
    stage_lines = [
        f"| {stage} | {runs} | {nbytes / 2**20:.1f} | {1e3 * seconds:.1f} |"
        for stage, (nbytes, seconds, runs) in load_stages.items()
    ]
    print("\nEngine B's load jobs, by stage (summed over its jobs; pipeline stages overlap):")
    print("\n".join(["| stage | runs | MiB | ms |", "|---|---|---|---|", *stage_lines]))
    batch_rows = [with_connector, without_cached, without, hung]
    print(f"{'round':58} {'steps':>5} {'ITL s':>7} {'TTFT s':>7} {'max step s':>10} {'tok/s':>7} {'cached':>7}")
    for row in batch_rows:
        print(
            f"{row['label']:58} {row['steps']:5d} {row['itl_s']:7.4f} {row['ttft_s']:7.3f} {row['max_step_s']:10.3f} "
            f"{row['tokens_per_s']:7.1f} {row['cached']:7d}"
        )
    itl_ratio = with_connector["itl_s"] / without_cached["itl_s"]
    throughput_ratio = with_connector["tokens_per_s"] / without_cached["tokens_per_s"]
    print(
        f"mean ITL with (pool) / without (prefix cache) the connector: {itl_ratio:.2f} (goal <= 1.10); throughput "
        f"{throughput_ratio:.2f} (goal >= 0.90); worst step, hung node / computing without the connector: "
        f"{hung['max_step_s']:.3f} s / {without['max_step_s']:.3f} s"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 3.4))
    ax.barh(
        [label for label, _ in ttft_rows][::-1],
        [r["seconds"] for _, r in ttft_rows][::-1],
        color=["#27a", "#2a7", "#c44", "#c44"],
    )
    ax.set_xlabel(f"time to first token, s ({args.tokens}-token prompt)")
    ax.set_title(f"TTFT: cold / from the pool {speedup:.1f}x", fontsize=10)
    bar_labels = ["with connector (pool)", "without (prefix cache)", "without (computed)", "hung node"][::-1]
    ax2.barh(
        bar_labels,
        [r["itl_s"] * 1000 for r in batch_rows][::-1],
        color=["#c80", "#2a7", "#7a2", "#27a"],
        label="mean ITL",
    )
    ax2.barh(
        bar_labels,
        [r["max_step_s"] * 1000 for r in batch_rows][::-1],
        color="none",
        edgecolor="k",
        label="worst step",
    )
    ax2.set_xlabel("ms (16 concurrent requests): mean ITL, and the worst engine step")
    ax2.set_title(f"mean ITL with / without the connector {itl_ratio:.2f}", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)

    import torch
    import vllm

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE, check=False
    ).stdout.strip()
    competing = f" --competitor {args.competitor}" if args.competitor else ""
    busy_host = (
        f" A busy host: a process of {args.competitor} spinning Python threads beside the engines for the whole run."
        if args.competitor
        else ""
    )
    lines = [
        "",
        f"## vLLM: TTFT cold / pool / prefix cache, co-running decodes, a hung node ({time.strftime('%Y-%m-%d')}, cpu)",
        "",
        (
            f"Command: `flock /tmp/ems-bench.lock .venv-vllm/bin/python perf/bench_vllm.py --tokens {args.tokens} "
            f"--prefix {args.prefix}{competing}` at commit {commit}. Machine: {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores shared with other jobs (load average {load_before:.1f} at start: noisy), vllm "
            f"{vllm.__version__} (CPU attention), torch {torch.__version__}. Random Llama, hidden 1024, 8 layers, 16 "
            "heads, 8 KV heads, bf16, block 32; one run; every engine its own process on one local pool node (read "
            "cache off). Asynchronous loads and lookups (batched per step, off the scheduler's thread), saves copied "
            f"out off the step; lookup timeout 300 ms.{busy_host} Plot: `perf/vllm.png`."
        ),
        "",
        "| engine / prompt | tokens | cached tokens | TTFT s |",
        "|---|---|---|---|",
        *[f"| {label} | {args.tokens} | {r['num_cached_tokens']} | {r['seconds']:.3f} |" for label, r in ttft_rows],
        "",
        (
            f"In engine B: cold / pooled TTFT **{speedup:.1f}x**; pooled / vLLM prefix cache, side by side once "
            f"quiet, **{pooled_vs_prefix:.2f}x** (goal: at most 1.2; P from the pool right after computing Q, its "
            f"saves in flight: {busy_vs_prefix:.2f}x). Engine B loaded {worker['load_blocks']} blocks "
            f"({worker['load_bytes'] / 2**20:.1f} MiB): **{load_gbps:.2f} GB/s** over its load jobs' time "
            f"({worker['load_seconds']:.3f} s: the job records of its `async_load` calls, each from the call to its "
            f"end: get + verify + scatter); the quiet load alone **{quiet_gbps:.2f} GB/s** (goal: at least 2), the "
            f"one right after Q {busy_gbps:.2f} GB/s."
        ),
        "",
        "Engine B's load jobs by stage (summed over its jobs; a pipelined load's stages overlap):",
        "",
        "| stage | runs | MiB | ms |",
        "|---|---|---|---|",
        *stage_lines,
        "",
        f"16 requests sharing a {args.prefix}-token prefix (64-token tails, {new_tokens} tokens each), submitted at "
        "once; ITL and TTFT from vLLM's per-request timestamps, averaged over the 16:",
        "",
        "| round | steps | mean ITL s | mean TTFT s | worst step s | tokens/s | cached tokens |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {r['label']} | {r['steps']} | {r['itl_s']:.4f} | {r['ttft_s']:.3f} | {r['max_step_s']:.3f} | "
            f"{r['tokens_per_s']:.1f} | {r['cached']} |"
            for r in batch_rows
        ],
        "",
        (
            f"Mean ITL with the connector (blocks from the pool) / without (the same blocks from vLLM's prefix "
            f"cache): **{itl_ratio:.2f}** (goal: at most 1.10); throughput: **{throughput_ratio:.2f}** (goal: at "
            f"least 0.90). Worst step with the node SIGSTOPped: **{hung['max_step_s']:.3f} s** "
            f"(engine C computing the same prompts without the connector: {without['max_step_s']:.3f} s; the hung "
            "node's lookups miss, so engine B computes them too; loads and saves time out after 5 s, so a blocking "
            "path would show at least that)."
        ),
        "",
    ]
    with open(args.results, "a") as f:
        f.write("\n".join(lines))
    print(f"plot: {args.out}; figures appended to {args.results}")


if __name__ == "__main__":
    main()
