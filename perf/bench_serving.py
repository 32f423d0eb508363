"""vLLM's own serving benchmark (`vllm.benchmarks.serve`, its `prefix_repetition` dataset) against real OpenAI
servers: a fresh server loading from the pool against vLLM's prefix cache warm and cold, both up at once, under the
same optional CPU competitor, round by round (issue 45, items 0 and 5).

    .venv-vllm/bin/python perf/bench_serving.py [--rounds 5] [--rounds-64 2] [--competitor both] [--quick]

Setup (one run): a random Llama written with transformers (hidden 512, 8 layers, 8 heads, 8 KV heads, vocab 4096)
served in float32, block size 32, with a word-level tokenizer (two characters a token) whose text decodes and
re-encodes to the same tokens (so the dataset's prompts are exactly as long as asked); one pool node (`python -m
ems.pool`); three OpenAI servers (`python -m vllm.entrypoints.openai.api_server`, `perf/servers.py`), every one up
for the whole run:
* A, with the README's `--kv-transfer-config` (`EmsConnector`, `pool_nodes` the node): fills the pool;
* B, the same connector (`perf/serving_steps.py`: `EmsConnector` whose per-step record the benchmark can read):
  serves each prompt set once, every prompt's blocks from the pool (its prefix cache has never seen them);
* C, no connector: serves each prompt set twice, cold (computes it) and warm (every prompt a local prefix hit).
For each competitor setting (`--competitor`: off, on or both; on = one process of `--competitor-threads` Python
threads spinning beside the servers for the whole setting), for each round, for each concurrency (`--concurrency`,
default 1, 4, 16, 64; 64 for only `--rounds-64` rounds): a fresh prompt set (the dataset's seed differs), filled by
A (then its saves are waited for), seen cold by C, then pooled by B and warm by C, the two in alternating order
round by round. Before each run the servers and the node are let go quiet (`servers.wait_quiet`: a vLLM server's
workers spin for a second after its last step, and C cold runs right before the pair, so B would otherwise start
every round beside C's spin). Each run is `vllm.benchmarks.serve` in this process (streaming completions, `--ignore-eos`,
`--request-rate inf`, `--max-concurrency` the concurrency, `--num-prompts` `--prompts` of it).

Figures: per round, pooled / warm of mean TTFT, mean TPOT and output throughput (and pooled / cold); the figure is
the median over rounds, printed with the minimum and maximum. Goals (issue 45): pooled TTFT <= 1.2x, TPOT <= 1.2x,
throughput >= 0.9x the warm prefix cache's at concurrency 1, 4 and 16, with and without the competitor; 64 reported.

Where the time goes: from the benchmark's per-token times (its `start_times`, `ttfts`, `itls`; this process's
`time.perf_counter`, the servers' `time.monotonic`: the same clock on Linux), each running request's token gaps
split into gaps in which another request was admitted (its first token came) and gaps without; compared between B
(a pooled admission) and C warm (a local hit's). B's per-step record over its runs (scheduler: lookups and their
seconds, the step's own waits; worker: loads started and finished, call and wait seconds, in-step loads, steps by
whether a load started, or while calls were in flight) and the CPU seconds of each server, the pool node and the
competitor over each run, and of B's and C's threads by name.

Prints a table, saves a plot (`--out`, default perf/serving.png), records the figures (perf/results.py, bench
`serving`) and appends a section to perf/RESULTS.md (`--results ''`: neither). Every run's raw rows (summaries,
per-request times, B's per-step record) go to `rows.json` in the run's folder; `--from-rows PATH` summarizes them
again without servers, plots and records: the vLLM venv may have no matplotlib, so a run there prints the rows'
path and another Python (with matplotlib and this package's dependencies) finishes:

    .venv-vllm/bin/python perf/bench_serving.py --results ''   # measures; prints rows: /tmp/ems-bench-serving-.../rows.json
    .venv/bin/python perf/bench_serving.py --from-rows /tmp/ems-bench-serving-.../rows.json
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integrations", "vllm_connector"))
sys.path.insert(0, ROOT)  # the `ems` of this tree, as the servers (started from it with -m) import it

METRICS = ("ttft", "tpot", "throughput")  # per round: mean TTFT, mean TPOT, output throughput
GOALS = {"ttft": ("<=", 1.2), "tpot": ("<=", 1.2), "throughput": (">=", 0.9)}
GOAL_CONCURRENCY = (1, 4, 16)
VOCAB = 4096
BLOCK = 32


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (a fresh prompt set each) per concurrency")
    parser.add_argument("--rounds-64", type=int, default=2, help="rounds at concurrency 64 (at most --rounds)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated --max-concurrency values")
    parser.add_argument("--prompts", default="1:8,4:12,16:32,64:64", help="concurrency:prompts per run")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--competitor", choices=("off", "on", "both"), default=None, help="default: both (--quick: off)")
    parser.add_argument("--competitor-threads", type=int, default=2, help="Python threads spinning in the competitor")
    parser.add_argument("--capacity", default="2GiB", help="the pool node's capacity")
    parser.add_argument("--quick", action="store_true", help="1 round, concurrency 4, 8 prompts, 1024-token prefixes")
    parser.add_argument("--out", default=os.path.join(HERE, "serving.png"))
    parser.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"), help="'': record and append nothing")
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--from-rows", default="", help="a run's rows.json: summarize it again (no servers)")
    parser.add_argument(
        "--b-config",
        default="{}",
        help="JSON: connector settings of B added to its kv_connector_extra_config (e.g. '{\"in_step_ms\": 100}')",
    )
    args = parser.parse_args(argv)
    try:
        args.b_config = json.loads(args.b_config)
    except json.JSONDecodeError as exc:
        parser.error(f"--b-config: not JSON: {exc}")
    if not isinstance(args.b_config, dict):
        parser.error("--b-config: a JSON object of connector settings")
    if args.quick:
        args.rounds, args.rounds_64, args.concurrency, args.prompts = 1, 0, "4", "4:8"
        args.prefix_len, args.num_prefixes, args.output_len = 1024, 2, 8
    args.competitor = args.competitor or ("off" if args.quick else "both")
    args.concurrency_list = [int(c) for c in args.concurrency.split(",") if c]
    args.prompts_by_concurrency = {int(k): int(v) for k, v in (p.split(":") for p in args.prompts.split(",") if p)}
    for c in args.concurrency_list:
        if c <= 0:
            parser.error(f"--concurrency: {c} is not a positive number")
        if c not in args.prompts_by_concurrency:
            parser.error(f"--prompts names no prompt count for concurrency {c}")
        if args.prompts_by_concurrency[c] % args.num_prefixes:  # the dataset makes prompts // prefixes per prefix
            parser.error(
                f"--prompts: {args.prompts_by_concurrency[c]} prompts for concurrency {c}: not a multiple of --num-prefixes"
            )
    if args.rounds < 1 or not 0 <= args.rounds_64 <= args.rounds:
        parser.error("--rounds must be >= 1 and --rounds-64 within 0..--rounds")
    if args.competitor_threads < 1:
        parser.error("--competitor-threads must be >= 1")
    args.settings = {"off": ["off"], "on": ["on"], "both": ["off", "on"]}[args.competitor]
    return args


# ---------------------------------------------------------------- figures (pure: tests/test_perf_serving.py)


@dataclass
class Run:
    """One benchmark run of one server: its summary and its per-request times (this process's perf_counter)."""

    ttft_ms: float
    tpot_ms: float
    throughput: float  # output tokens/s
    p99_itl_ms: float
    completed: int
    start: float = 0.0
    end: float = 0.0
    requests: list[tuple[float, float, list[float]]] = field(default_factory=list)  # (start, ttft s, itls s)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds over the run, by process
    threads_s: dict[str, float] = field(default_factory=dict)  # of B's and C's processes, by server and thread name
    loaded_blocks: float = 0.0  # B: blocks its loads brought from the pool during the run
    quiet_wait_s: float = 0.0  # waited before the run for the servers and the node to go quiet (`servers.wait_quiet`)

    @classmethod
    def from_result(cls, result: dict[str, Any], start: float, end: float) -> Run:
        requests = [
            (s, t, list(i))
            for s, t, i, e in zip(result["start_times"], result["ttfts"], result["itls"], result["errors"], strict=False)
            if not e
        ]
        return cls(
            result["mean_ttft_ms"],
            result["mean_tpot_ms"],
            result["output_throughput"],
            result.get("p99_itl_ms", 0.0),
            result["completed"],
            start,
            end,
            requests,
        )

    def metric(self, name: str) -> float:
        return {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "throughput": self.throughput}[name]


def round_ratios(pooled: Run, anchor: Run) -> dict[str, float]:
    """One round's pooled / anchor ratio of each metric (NaN where the anchor is 0)."""
    return {m: pooled.metric(m) / anchor.metric(m) if anchor.metric(m) else float("nan") for m in METRICS}


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    rounds: int


def spread(values: Sequence[float]) -> Spread:
    kept = [v for v in values if v == v]
    if not kept:
        return Spread(float("nan"), float("nan"), float("nan"), 0)
    return Spread(statistics.median(kept), min(kept), max(kept), len(kept))


def gaps_by_admission(requests: Sequence[tuple[float, float, list[float]]]) -> tuple[list[float], list[float]]:
    """Every request's token gaps (s), split into those during which another request's first token came (an
    admission: its prefill ran in a step of that gap) and the others."""
    firsts = sorted(start + ttft for start, ttft, _ in requests)
    with_admission: list[float] = []
    without: list[float] = []
    for start, ttft, itls in requests:
        own, t = start + ttft, start + ttft
        for gap in itls:
            lo, hi = bisect.bisect_right(firsts, t), bisect.bisect_right(firsts, t + gap)
            others = hi - lo - (1 if t < own <= t + gap else 0)
            (with_admission if others > 0 else without).append(gap)
            t += gap
    return with_admission, without


def step_table(worker: list[dict], scheduler: list[dict], windows: Sequence[tuple[float, float]]) -> dict[str, float]:
    """B's per-step record inside `windows` (its measured runs), summed: where its steps' time went."""

    def inside(r: dict) -> bool:
        return any(a <= r["at_s"] <= b for a, b in windows)

    work = [r for r in worker if inside(r)]
    sched = [r for r in scheduler if inside(r)]
    durations = []  # a step's time: from the previous worker record's end, when the engine did not idle between
    ordered = sorted(worker, key=lambda r: r["at_s"])
    previous = {id(b): a for a, b in itertools.pairwise(ordered)}
    for r in work:
        before = previous.get(id(r))
        if before is not None and inside(before) and r["at_s"] - before["at_s"] < 2.0:
            durations.append((r["at_s"] - before["at_s"], r["loads_started"] > 0 or r["in_step_loads"] > 0, r["inflight"] > 0))
    with_loads = [d for d, loads, _ in durations if loads]
    without = [d for d, loads, _ in durations if not loads]
    in_flight = [d for d, _, busy in durations if busy]
    quiet = [d for d, _, busy in durations if not busy]
    return {
        "steps": len(work),
        "step_ms_with_load_start": 1000 * statistics.median(with_loads) if with_loads else float("nan"),
        "steps_with_load_start": len(with_loads),
        "step_ms_other": 1000 * statistics.median(without) if without else float("nan"),
        "step_ms_calls_in_flight": 1000 * statistics.median(in_flight) if in_flight else float("nan"),
        "step_ms_no_calls_in_flight": 1000 * statistics.median(quiet) if quiet else float("nan"),
        "loads_started": sum(r["loads_started"] for r in work),
        "loads_done": sum(r["loads_done"] for r in work),
        "load_ms_mean": 1000 * sum(r["load_s"] for r in work) / max(1, sum(r["loads_done"] for r in work)),
        "worker_call_s": sum(r["call_s"] for r in work),
        "worker_wait_s": sum(r["wait_s"] for r in work),
        "in_step_loads": sum(r["in_step_loads"] for r in work),
        "in_step_load_s": sum(r["in_step_load_s"] for r in work),
        # (records of trees before these fields: none counted)
        "in_step_late": sum(r.get("in_step_loads_late", 0) for r in work),
        "in_step_late_blocks": sum(r.get("in_step_late_blocks", 0) for r in work),
        "loads_deferred": sum(r.get("loads_deferred", 0) for r in sched),  # put off to the next step
        "steps_with_calls_in_flight": sum(r["inflight"] > 0 for r in work),
        "lookups_sent": sum(r["lookups_sent"] for r in sched),
        "lookup_s": sum(r["lookup_s"] for r in sched),
        "scheduler_wait_s": sum(r["wait_s"] for r in sched),
        "in_step_lookup_s": sum(r["in_step_lookup_s"] for r in sched),
        "steps_waiting_for_lookups": sum(r["lookups_waiting"] > 0 for r in sched),
    }


# ---------------------------------------------------------------- the servers


def write_model(path: str, max_pos: int) -> str:
    """The random Llama and a word-level tokenizer in one folder: token i is two characters of a 64-character
    alphabet, text is tokens side by side (split every two characters), so a prompt's text has exactly the
    characters vLLM's server allows for its tokens (the longest token's length each)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from vllm_engine import make_tiny_llama

    make_tiny_llama(path, hidden=512, layers=8, heads=8, kv_heads=8, vocab=VOCAB, intermediate=1408, max_pos=max_pos)
    alphabet = string.ascii_letters + string.digits + "+/"
    words = {alphabet[i // 64] + alphabet[i % 64]: i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(words, unk_token="aa"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="aa").save_pretrained(path)
    return path


def start_pool(capacity: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """`python -m ems.pool` on a free port of 127.0.0.1: the process and its address (from its ready line)."""
    log = open(log_path, "w")  # noqa: SIM115 - the node keeps writing to it
    proc = subprocess.Popen(
        [sys.executable, "-m", "ems.pool", "--listen", "127.0.0.1:0", "--capacity", capacity],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    log.close()
    if proc.stdout is None:
        raise RuntimeError("no stdout pipe to the pool node")
    line = proc.stdout.readline().strip()  # "ems-pool ready on HOST:PORT", or "" when it exited
    if not line.startswith("ems-pool ready on "):
        proc.kill()
        raise RuntimeError(f"the pool node did not start ({line!r}; see {log_path})")
    return proc, line.rsplit(" ", 1)[1]


class Bench:
    """The three servers, the pool node and the competitor of one run."""

    def __init__(self, args: argparse.Namespace, root: str) -> None:
        self.args, self.root = args, root
        self.max_len = args.prefix_len + args.suffix_len + args.output_len + 64
        self.model = write_model(os.path.join(root, "model"), self.max_len + 64)
        per_prompt = -(-(args.suffix_len + args.output_len) // BLOCK) + 1
        most = max(args.prompts_by_concurrency[c] for c in args.concurrency_list)
        # a prompt set's blocks, and half as many again: C keeps the set it saw cold for its warm run
        self.num_blocks = (args.num_prefixes * -(-args.prefix_len // BLOCK) + most * per_prompt + 64) * 3 // 2
        self.steps_dir = os.path.join(root, "steps")
        os.makedirs(self.steps_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.competitor: subprocess.Popen | None = None
        self.dump_seq = 0

    def start(self) -> None:
        from servers import api_server_argv, free_port, server_env, start_server, wait_healthy

        pool, address = start_pool(self.args.capacity, os.path.join(self.root, "pool.log"))
        self.procs["pool"] = pool
        self.pool_address = address
        pythonpath = os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        for name in ("A", "B", "C"):
            transfer = None
            env = server_env(PYTHONPATH=pythonpath)
            if name != "C":  # the README's configuration; B's class also hands out its per-step record
                transfer = {
                    "kv_connector": "EmsConnector" if name == "A" else "RecordingEmsConnector",
                    "kv_connector_module_path": "ems.integrations.vllm" if name == "A" else "serving_steps",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"pool_nodes": [address]},
                }
                if name == "B":
                    env["EMS_BENCH_STEPS_DIR"] = self.steps_dir
                    transfer["kv_connector_extra_config"].update(self.args.b_config)
            port = free_port()
            argv = api_server_argv(self.model, port, self.max_len, self.num_blocks, transfer, "float32", tokenizer=True)
            self.procs[name] = start_server(argv, os.path.join(self.root, f"{name}.log"), env)
            self.urls[name] = f"http://127.0.0.1:{port}"
        for name in ("A", "B", "C"):
            wait_healthy(self.urls[name], self.procs[name])

    def stop(self) -> None:
        from vllm_engine import stop_processes

        self.set_competitor(False)
        stop_processes([p for n, p in self.procs.items() if n != "pool"])
        stop_processes([self.procs["pool"]])

    def set_competitor(self, on: bool) -> None:
        if on and self.competitor is None:
            from servers import start_competitor

            self.competitor = start_competitor(self.args.competitor_threads)
        elif not on and self.competitor is not None:
            from vllm_engine import stop_processes

            stop_processes([self.competitor], 5.0)
            self.competitor = None

    def cpu(self) -> dict[str, float]:
        from servers import tree_cpu_seconds

        out = {name: tree_cpu_seconds(p.pid) for name, p in self.procs.items()}
        if self.competitor is not None:
            out["competitor"] = tree_cpu_seconds(self.competitor.pid)
        return out

    def serve(self, name: str, concurrency: int, seed: int) -> Run:
        """One run of vLLM's serving benchmark against server `name`."""
        from servers import counter, threads_cpu_seconds, wait_quiet
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        a = self.args
        argv = [
            "--backend", "vllm", "--base-url", self.urls[name], "--endpoint", "/v1/completions",
            "--model", self.model, "--tokenizer", self.model, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(a.prefix_len), "--prefix-repetition-suffix-len", str(a.suffix_len),
            "--prefix-repetition-num-prefixes", str(a.num_prefixes), "--prefix-repetition-output-len", str(a.output_len),
            "--num-prompts", str(a.prompts_by_concurrency[concurrency]), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--seed", str(seed), "--ignore-eos", "--temperature", "0",
            "--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-detailed",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        ]  # fmt: skip
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        bench_args = parser.parse_args(argv)
        loaded = counter(self.urls[name], "vllm:ems_load_blocks_total") if name == "B" else 0.0

        def threads() -> dict[str, float]:
            return {f"{s}: {t}": v for s in ("B", "C") for t, v in threads_cpu_seconds(self.procs[s].pid, tree=True).items()}

        # the servers and the node idle first: each run starts on the same quiet cores (the competitor excepted),
        # not inside the previous server's spin (B would always meet C's: C cold runs right before the pair)
        quiet_wait_s = wait_quiet([p.pid for p in self.procs.values()])
        threads_before = threads()
        cpu_before, start = self.cpu(), time.perf_counter()
        result = main(bench_args)
        end, cpu_after = time.perf_counter(), self.cpu()
        threads_after = threads()
        run = Run.from_result(result, start, end)
        run.cpu_s = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
        run.threads_s = {k: v - threads_before.get(k, 0.0) for k, v in threads_after.items()}
        run.quiet_wait_s = quiet_wait_s
        if name == "B":
            time.sleep(0.2)
            run.loaded_blocks = counter(self.urls[name], "vllm:ems_load_blocks_total") - loaded
        if run.completed != a.prompts_by_concurrency[concurrency]:
            errors = sorted({e for e in result.get("errors", []) if e})
            raise RuntimeError(f"server {name}: {run.completed} of {a.prompts_by_concurrency[concurrency]} done: {errors}")
        return run

    def wait_saves(self, timeout_s: float = 60.0) -> float:
        """After A's fill: ask A for one token until its saved-block counter stops moving (its saves landed; the
        counter moves with the steps, so each poll runs one)."""
        from servers import counter, post

        deadline, last = time.monotonic() + timeout_s, -1.0
        while time.monotonic() < deadline:
            post(self.urls["A"], {"model": self.model, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0})
            time.sleep(0.5)
            saved: float = counter(self.urls["A"], "vllm:ems_save_blocks_total")
            if saved == last:
                return saved
            last = saved
        return last

    def step_records(self) -> dict[str, list[dict]]:
        """B's per-step record (both halves), as `perf/serving_steps.py` writes it on request."""
        self.dump_seq += 1
        with open(os.path.join(self.steps_dir, "request.tmp"), "w") as f:
            f.write(str(self.dump_seq))
        os.replace(os.path.join(self.steps_dir, "request.tmp"), os.path.join(self.steps_dir, "request"))
        out: dict[str, list[dict]] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(out) < 2:
            for half in ("scheduler", "worker"):
                try:
                    with open(os.path.join(self.steps_dir, f"{half}.json")) as f:
                        data = json.load(f)
                except (OSError, ValueError):
                    continue
                if data["seq"] == self.dump_seq:
                    out[half] = data["records"]
            time.sleep(0.2)
        return out


# ---------------------------------------------------------------- the run


def measure(args: argparse.Namespace, bench: Bench) -> list[dict]:
    """Every (setting, round, concurrency): A fills, C cold, then B pooled and C warm in alternating order."""
    rows: list[dict] = []
    records: dict[str, dict[float, dict]] = {"scheduler": {}, "worker": {}}
    for s_index, setting in enumerate(args.settings):
        bench.set_competitor(setting == "on")
        time.sleep(1.0 if setting == "on" else 0.0)
        for r in range(args.rounds):
            for c_index, c in enumerate(args.concurrency_list):
                if c == 64 and r >= args.rounds_64:
                    continue
                seed = args.seed + 1000 * s_index + 100 * r + c_index
                fill = bench.serve("A", c, seed)
                saved = bench.wait_saves()
                cold = bench.serve("C", c, seed)
                order = ("B", "C") if r % 2 == 0 else ("C", "B")
                runs = {name: bench.serve(name, c, seed) for name in order}
                row = {
                    "setting": setting,
                    "round": r,
                    "concurrency": c,
                    "seed": seed,
                    "order": "".join(order),
                    "fill": fill,
                    "saved_blocks": saved,
                    "cold": cold,
                    "pooled": runs["B"],
                    "warm": runs["C"],
                }
                rows.append(row)
                vs_warm, vs_cold = round_ratios(runs["B"], runs["C"]), round_ratios(runs["B"], cold)
                print(
                    json.dumps(
                        {
                            "setting": setting,
                            "round": r,
                            "concurrency": c,
                            "order": row["order"],
                            "pooled_over_warm": {k: round(v, 3) for k, v in vs_warm.items()},
                            "pooled_over_cold": {k: round(v, 3) for k, v in vs_cold.items()},
                            "ttft_ms": [round(x.ttft_ms, 1) for x in (runs["B"], runs["C"], cold)],
                            "tpot_ms": [round(x.tpot_ms, 1) for x in (runs["B"], runs["C"], cold)],
                            "tok_s": [round(x.throughput, 1) for x in (runs["B"], runs["C"], cold)],
                            "loaded_blocks": runs["B"].loaded_blocks,
                            "quiet_wait_s": [round(runs[n].quiet_wait_s, 2) for n in ("B", "C")],
                        }
                    ),
                    flush=True,
                )
            for half, recs in bench.step_records().items():  # the deque keeps the last 4096 steps: read each round
                records[half].update({rec["at_s"]: rec for rec in recs})
        bench.set_competitor(False)
    merged = {half: [recs[at] for at in sorted(recs)] for half, recs in records.items()}
    for row in rows:
        row["records"] = merged
    return rows


def save_rows(rows: list[dict], meta: dict[str, Any], path: str) -> None:
    """The raw rows (every run's summary and per-request times, B's per-step record) and the run's `meta` (its
    arguments, machine, commit, minutes) as JSON (`--from-rows`)."""
    plain = [{k: asdict(v) if isinstance(v, Run) else v for k, v in row.items() if k != "records"} for row in rows]
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": plain, "records": rows[0]["records"] if rows else {}}, f)


def load_rows(path: str) -> tuple[list[dict], dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    rows = []
    for row in data["rows"]:
        for key in ("fill", "cold", "pooled", "warm"):
            row[key] = Run(**{**row[key], "requests": [tuple(x) for x in row[key]["requests"]]})
        row["records"] = data["records"]
        rows.append(row)
    return rows, data["meta"]


def summarize(args: argparse.Namespace, rows: list[dict]) -> dict[tuple[str, int], dict[str, Any]]:
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for setting in args.settings:
        for c in args.concurrency_list:
            mine = [r for r in rows if r["setting"] == setting and r["concurrency"] == c]
            if not mine:
                continue
            warm = {m: spread([round_ratios(r["pooled"], r["warm"])[m] for r in mine]) for m in METRICS}
            cold = {m: spread([round_ratios(r["pooled"], r["cold"])[m] for r in mine]) for m in METRICS}
            absolute = {
                side: {m: statistics.median(r[side].metric(m) for r in mine) for m in METRICS}
                for side in ("pooled", "warm", "cold")
            }
            gaps: dict[str, tuple[list[float], list[float]]] = {}
            for side in ("pooled", "warm"):
                admitted: list[float] = []
                other: list[float] = []
                for r in mine:
                    a, o = gaps_by_admission(r[side].requests)
                    admitted += a
                    other += o
                gaps[side] = (admitted, other)
            cpu = {
                side: {k: statistics.median(r[side].cpu_s.get(k, 0.0) for r in mine) for k in mine[0][side].cpu_s}
                for side in ("pooled", "warm")
            }
            threads = {}
            for side in ("pooled", "warm"):
                names = {n for r in mine for n in r[side].threads_s}
                per = {n: statistics.median(r[side].threads_s.get(n, 0.0) for r in mine) for n in names}
                threads[side] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
            records = mine[0]["records"]
            steps = step_table(records["worker"], records["scheduler"], [(r["pooled"].start, r["pooled"].end) for r in mine])
            # rounds in which an in-step load of B ran past its bound (recomputed where it also ran out of its grace), against
            # the others
            late_rounds = [
                step_table(records["worker"], records["scheduler"], [(r["pooled"].start, r["pooled"].end)])["in_step_late"] > 0
                for r in mine
            ]
            by_lateness = {
                late: [round_ratios(r["pooled"], r["warm"])["ttft"] for r, was in zip(mine, late_rounds) if was is late]
                for late in (True, False)
            }
            out[(setting, c)] = {
                "rounds": len(mine),
                "vs_warm": warm,
                "vs_cold": cold,
                "absolute": absolute,
                "gaps": gaps,
                "cpu": cpu,
                "threads": threads,
                "steps": steps,
                "late_rounds": sum(late_rounds),
                "ttft_late_rounds": statistics.median(by_lateness[True]) if by_lateness[True] else float("nan"),
                "ttft_other_rounds": statistics.median(by_lateness[False]) if by_lateness[False] else float("nan"),
                "loaded_blocks": statistics.median(r["pooled"].loaded_blocks for r in mine),
                "loaded_short": sum(r["pooled"].loaded_blocks < pool_blocks(args, c) for r in mine),
                "pool_blocks": pool_blocks(args, c),
                "p99_itl_ms": {side: statistics.median(r[side].p99_itl_ms for r in mine) for side in ("pooled", "warm")},
            }
    return out


def pool_blocks(args: argparse.Namespace, concurrency: int) -> int:
    """The blocks a run of B can load from the pool: each prefix's full blocks once, then each prompt's full blocks
    past its prefix but the one holding its last token (the connector never claims that one)."""
    prefix = args.prefix_len // BLOCK
    per_prompt = (args.prefix_len + args.suffix_len - 1) // BLOCK - prefix
    return int(args.num_prefixes * prefix + args.prompts_by_concurrency[concurrency] * per_prompt)


def ms(values: Sequence[float], q: float) -> float:
    from benchlib import percentile

    return 1000 * percentile(values, q) if values else float("nan")


def report(args: argparse.Namespace, summary: dict[tuple[str, int], dict[str, Any]], machine: str, root: str) -> list[str]:
    """The tables (printed, and the RESULTS.md section's body)."""
    lines = [
        "| competitor | concurrency | rounds | TTFT pooled / warm | TPOT pooled / warm | throughput pooled / warm | "
        "TTFT pooled / cold | throughput pooled / cold | mean TTFT ms (pooled, warm, cold) | mean TPOT ms (pooled, "
        "warm, cold) | tok/s (pooled, warm, cold) | blocks B loaded (median) of those in the pool (rounds short) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(s: Spread, op: str, target: float, goal: bool) -> str:
        text = f"{s.median:.2f}x ({s.low:.2f}–{s.high:.2f})"
        if goal:
            met = s.median <= target if op == "<=" else s.median >= target
            text = f"**{text}**" if not met else text
        return text

    for (setting, c), s in summary.items():
        goal = c in GOAL_CONCURRENCY
        w, k, ab = s["vs_warm"], s["vs_cold"], s["absolute"]
        lines.append(
            f"| {setting} | {c} | {s['rounds']} | {cell(w['ttft'], *GOALS['ttft'], goal)} | "
            f"{cell(w['tpot'], *GOALS['tpot'], goal)} | {cell(w['throughput'], *GOALS['throughput'], goal)} | "
            f"{k['ttft'].median:.2f}x ({k['ttft'].low:.2f}–{k['ttft'].high:.2f}) | "
            f"{k['throughput'].median:.2f}x ({k['throughput'].low:.2f}–{k['throughput'].high:.2f}) | "
            + ", ".join(f"{ab[side]['ttft']:.0f}" for side in ("pooled", "warm", "cold"))
            + " | "
            + ", ".join(f"{ab[side]['tpot']:.1f}" for side in ("pooled", "warm", "cold"))
            + " | "
            + ", ".join(f"{ab[side]['throughput']:.0f}" for side in ("pooled", "warm", "cold"))
            + f" | {s['loaded_blocks']:.0f} of {s['pool_blocks']} ({s['loaded_short']} short) |"
        )
    lines += [
        "",
        "Running requests' token gaps (ms, all rounds): in a gap during which another request was admitted (its "
        "first token came) and in the others; B's admissions load from the pool, C-warm's are local prefix hits. The "
        "server streams tokens in batches when its output loop falls behind (gaps of ~0 ms), so the mean, which a "
        "batch does not change, is the figure to compare.",
        "",
        "| competitor | concurrency | B: admission gaps (n, mean, p90) | C warm: admission gaps | B: other gaps "
        "(n, mean, p90) | C warm: other gaps | p99 ITL ms (B, C warm) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (setting, c), s in summary.items():
        g = s["gaps"]

        def gap_cell(values: list[float]) -> str:
            mean = 1000 * sum(values) / len(values) if values else float("nan")
            return f"{len(values)}, {mean:.1f}, {ms(values, 0.9):.1f}"

        lines.append(
            f"| {setting} | {c} | {gap_cell(g['pooled'][0])} | {gap_cell(g['warm'][0])} | {gap_cell(g['pooled'][1])} | "
            f"{gap_cell(g['warm'][1])} | {s['p99_itl_ms']['pooled']:.1f}, {s['p99_itl_ms']['warm']:.1f} |"
        )
    lines += [
        "",
        "B's per-step record over its measured runs (all rounds; `EmsConnector.step_records`), and CPU seconds over "
        "a run (median of rounds) of each process: B's run, then C-warm's run.",
        "",
        "| competitor | concurrency | steps | step ms with a load started / other (median) | step ms with calls in "
        "flight / none (median) | loads started, "
        "finished, mean load ms | worker call s / wait s | in-step loads (s), late (blocks recomputed), put off a step "
        "| rounds with "
        "a late in-step load: TTFT pooled / warm in them, in the others (medians) | lookups sent, lookup-thread s, "
        "scheduler wait s | CPU s in B's run | CPU s in C-warm's run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (setting, c), s in summary.items():
        t = s["steps"]
        cpu = {side: ", ".join(f"{k} {v:.2f}" for k, v in sorted(s["cpu"][side].items())) for side in ("pooled", "warm")}
        lines.append(
            f"| {setting} | {c} | {t['steps']} | {t['step_ms_with_load_start']:.1f} ({t['steps_with_load_start']}) / "
            f"{t['step_ms_other']:.1f} | {t['step_ms_calls_in_flight']:.1f} ({t['steps_with_calls_in_flight']}) / "
            f"{t['step_ms_no_calls_in_flight']:.1f} | {t['loads_started']}, {t['loads_done']}, {t['load_ms_mean']:.1f} | "
            f"{t['worker_call_s']:.3f} / {t['worker_wait_s']:.3f} | {t['in_step_loads']} ({t['in_step_load_s']:.3f}), "
            f"{t['in_step_late']} ({t['in_step_late_blocks']}), {t['loads_deferred']} | "
            f"{s['late_rounds']} of {s['rounds']}: "
            f"{s['ttft_late_rounds']:.2f}x, {s['ttft_other_rounds']:.2f}x | "
            f"{t['lookups_sent']}, {t['lookup_s']:.3f}, {t['scheduler_wait_s']:.3f} | {cpu['pooled']} | {cpu['warm']} |"
        )
    lines += [
        "",
        "CPU seconds by thread name (median over rounds, the 8 largest) of B's and C's processes over B's run (from "
        "the pool) and over C's warm run. vLLM names its processes (VLLM::EngineCore, VLLM::Worker) and threads "
        "inherit the name, so an entry is in effect a process: the connector's threads count in B's.",
        "",
        "| competitor | concurrency | over B's run | over C's warm run |",
        "|---|---|---|---|",
    ]
    for (setting, c), s in summary.items():
        cells = [", ".join(f"{name} {v:.2f}" for name, v in list(s["threads"][side].items())[:8]) for side in ("pooled", "warm")]
        lines.append(f"| {setting} | {c} | {cells[0]} | {cells[1]} |")
    return lines


def plot(args: argparse.Namespace, summary: dict[tuple[str, int], dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    titles = {"ttft": "mean TTFT", "tpot": "mean TPOT", "throughput": "output throughput"}
    for ax, m in zip(axes, METRICS, strict=True):
        for setting, color in (("off", "tab:blue"), ("on", "tab:red")):
            keys = [(setting, c) for c in args.concurrency_list if (setting, c) in summary]
            if not keys:
                continue
            xs = [str(c) for _, c in keys]
            med = [summary[k]["vs_warm"][m].median for k in keys]
            err = [
                [summary[k]["vs_warm"][m].median - summary[k]["vs_warm"][m].low for k in keys],
                [summary[k]["vs_warm"][m].high - summary[k]["vs_warm"][m].median for k in keys],
            ]
            label = f"pooled / warm, competitor {setting}"
            ax.errorbar(xs, med, yerr=err, color=color, marker="o", capsize=4, label=label)
            cold = [summary[k]["vs_cold"][m].median for k in keys]
            ax.plot(xs, cold, color=color, linestyle=":", marker="x", label=f"pooled / cold, competitor {setting}")
        op, target = GOALS[m]
        ax.axhline(target, color="k", linewidth=0.8, linestyle="--", label=f"goal {op} {target}")
        ax.set_title(f"{titles[m]}: pooled / prefix cache (median, min–max)", fontsize=9)
        ax.set_xlabel("concurrency")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
        ax.set_ylabel("ratio")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


def record_figures(
    args: argparse.Namespace, summary: dict[tuple[str, int], dict[str, Any]], machine: str, command: str, commit: str
) -> str:
    from results import Figure, Goal, Run, record

    figures = []
    plot_path = os.path.relpath(args.out, ROOT)
    for (setting, c), s in summary.items():
        for m in METRICS:
            w = s["vs_warm"][m]
            op, target = GOALS[m]
            figures.append(
                Figure(
                    f"pooled / warm prefix cache, {m}, concurrency {c}, competitor {setting}",
                    w.median,
                    "x",
                    goal=Goal(op, target) if c in GOAL_CONCURRENCY else None,
                    plot=plot_path,
                    note=(
                        f"median of {w.rounds} rounds' ratios (min {w.low:.3f}, max {w.high:.3f}); medians: pooled "
                        f"{s['absolute']['pooled'][m]:.1f}, warm {s['absolute']['warm'][m]:.1f}, cold "
                        f"{s['absolute']['cold'][m]:.1f} ({'tok/s' if m == 'throughput' else 'ms'}); pooled / cold "
                        f"{s['vs_cold'][m].median:.3f}"
                    ),
                )
            )
    run = Run("serving", command, figures, commit=commit.split(" ")[0], machine=machine)  # the measured commit
    return str(record(run))


def shown_arguments(argv: list[str]) -> list[str]:
    """A run's arguments as its recorded command shows them: without `--results` and its value (a run with no
    arguments shows none)."""
    before = ["", *argv][: len(argv)]
    return [arg for arg, previous in zip(argv, before, strict=True) if "--results" not in (arg, previous)]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from bench_vllm import ems_commit
    from benchlib import machine as describe_machine

    again = bool(args.from_rows)
    if args.from_rows:  # the run's own arguments, this call's outputs
        rows, meta = load_rows(args.from_rows)
        root = os.path.dirname(os.path.abspath(args.from_rows))
        args = parse_args([*meta["argv"], "--out", args.out, "--results", args.results])
    else:
        meta = {
            "argv": list(sys.argv[1:] if argv is None else argv),
            "machine": describe_machine(),
            "commit": ems_commit(),
        }
        started = time.monotonic()
        root = tempfile.mkdtemp(prefix="ems-bench-serving-")
        bench = Bench(args, root)
        try:
            bench.start()
            rows = measure(args, bench)
        finally:
            bench.stop()
        meta["minutes"] = (time.monotonic() - started) / 60
        save_rows(rows, meta, os.path.join(root, "rows.json"))
        print(f"rows: {os.path.join(root, 'rows.json')}; logs: {root}; {meta['minutes']:.1f} min")
    summary = summarize(args, rows)
    lines = report(args, summary, meta["machine"], root)
    print("\n".join(lines))
    try:
        plot(args, summary)
    except ImportError:  # the vLLM venv may have no matplotlib
        print(f"no matplotlib here: plot and record with `python perf/bench_serving.py --from-rows {root}/rows.json`")
        return
    print(f"plot: {args.out}")
    if not args.results:
        return
    command = " ".join(["flock /tmp/heavy.lock .venv-vllm/bin/python perf/bench_serving.py", *shown_arguments(meta["argv"])])
    print(f"results: {record_figures(args, summary, meta['machine'], command, meta['commit'])}")
    header = [
        "",
        f"## vLLM's serving benchmark: pooled vs the prefix cache, both servers up at once ({time.strftime('%Y-%m-%d')}, cpu)",
        "",
        (
            f"Command: `{command.strip()}` at commit {meta['commit']}, {meta['minutes']:.0f} min"
            + (
                " (the vLLM venv has no matplotlib: `python perf/bench_serving.py --from-rows ROWS` drew the plot and "
                "recorded the figures)"
                if again
                else ""
            )
            + f". Machine: {meta['machine']}. "
            f"`vllm.benchmarks.serve`, `prefix_repetition` ({args.num_prefixes} prefixes of {args.prefix_len} tokens, "
            f"{args.suffix_len}-token suffixes, {args.output_len} output tokens, `--ignore-eos`), prompts per run "
            f"{args.prompts}; random Llama (hidden 512, 8 layers, float32, block 32); servers A (fills the pool), B "
            "(from the pool) and C (no connector: cold, then warm) up at once on one `python -m ems.pool` node; per "
            "round a fresh prompt set, B and C-warm in alternating order; competitor: one process of "
            f"{args.competitor_threads} spinning Python threads. Cells: median of the rounds' ratios (min–max); "
            "bold: a goal missed (TTFT, TPOT <= 1.2x, throughput >= 0.9x at concurrency 1, 4, 16). Plot: "
            f"`{os.path.relpath(args.out, ROOT)}`; figures: `perf/results/serving.json`."
        ),
        "",
    ]
    with open(args.results, "a") as f:
        f.write("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()
