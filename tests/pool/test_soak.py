"""Soak (issue 7): several client processes doing mixed save / load / exists through the public API against three
real pool nodes with tiny capacity (eviction never stops), while one node is killed and restarted and another is
stopped (SIGSTOP) and resumed (SIGCONT) mid-run.

Asserted, with the bounds stated here:
* not one wrong byte: every block a load reports as hit equals what its hash names, every other byte of the named
  blocks is untouched (a miss is fine; `soak_client.py` holds the check);
* no call takes longer than its timeout plus CALL_MARGIN_S (async calls: from the call to `get_result`);
* client and node RSS, threads and fds, sampled through the run, grow by at most the bounds per 1,000 operations
  below (or, for short series, by the absolute slack), measured from the end of each process's own warm-up (its
  first quarter) to its last sample; the killed node is judged on its first life, the restarted one on its second;
* the run did real work: every client made calls, loads hit, and nodes evicted.

The figures are printed (run with `-s`) and, when EMS_SOAK_REPORT names a file, appended to it as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pool_testlib import PoolProcess, read_line

pytestmark = pytest.mark.slow

CLIENT = str(Path(__file__).resolve().parent / "soak_client.py")
CLIENTS = 3
NODE_CAPACITY = "4MiB"
READ_CACHE = "2MiB"  # each client's read cache: tiny too, so it is full (and evicting) after the warm-up
RUN_S = float(os.environ.get("EMS_SOAK_SECONDS", "45"))  # longer by hand: EMS_SOAK_SECONDS=600
TIMEOUT_MS = 1000
CALL_MARGIN_S = 1.5  # scheduling on a shared 2-core machine: three clients, three nodes and pytest
WARMUP_FRACTION = 0.4  # RSS settles after a few hundred ops per process (read cache, allocator, UCX)
# growth allowed per 1,000 operations after warm-up
CLIENT_RSS_MIB_PER_1000 = 4.0
NODE_RSS_MIB_PER_1000 = 4.0
THREADS_PER_1000 = 2.0
FDS_PER_1000 = 4.0
# and in absolute terms (reconnects after the kill may add a few fds or threads once)
SLACK_FDS = 6
SLACK_THREADS = 4


def proc_sample(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    if "VmRSS" not in fields:  # exited, not yet reaped: a zombie has no memory to sample
        raise ProcessLookupError(pid)
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def growth(samples: list[dict]) -> dict | None:
    """Per 1,000 ops, from the first sample after this series' own warm-up (its first WARMUP_FRACTION of ops) to its
    last: RSS MiB, threads, fds, and the same in absolute terms; None when the series is too short to judge."""
    lo, hi = samples[0]["ops"], samples[-1]["ops"]
    after = [s for s in samples if s["ops"] >= lo + WARMUP_FRACTION * (hi - lo)]
    if len(after) < 4 or after[-1]["ops"] - after[0]["ops"] < 100:
        return None
    first, last = after[0], after[-1]
    ops = last["ops"] - first["ops"]
    # a single late sample can catch an allocation in flight: take the lower of the last two
    end = min(after[-2:], key=lambda s: s["rss_kib"])
    d = {
        "rss_mib": (end["rss_kib"] - first["rss_kib"]) / 1024,
        "threads": last["threads"] - first["threads"],
        "fds": last["fds"] - first["fds"],
    }
    return {"ops": ops, **d, "per_1000": {k: v * 1000 / ops for k, v in d.items()}}


class NodeSampler(threading.Thread):
    """Samples each node process every 0.5 s, stamping samples with the clients' estimated op count so far."""

    def __init__(self, nodes: list[PoolProcess], start_at: float, stop_at: float, ops_rate: list[float]) -> None:
        super().__init__(daemon=True)
        self.nodes, self.start_at, self.stop_at, self.ops_rate = nodes, start_at, stop_at, ops_rate
        self.samples: dict[int, list[dict]] = {}  # pid -> samples
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            now = time.time()
            if now < self.start_at:
                continue
            for node in self.nodes:
                proc = node.proc
                if proc is None or proc.poll() is not None:
                    continue
                try:
                    sample = proc_sample(proc.pid)
                except (FileNotFoundError, ProcessLookupError):
                    continue
                sample["t"] = now - self.start_at
                self.samples.setdefault(proc.pid, []).append(sample)


def test_soak_three_nodes_kill_restart_pause_resume(tmp_path):
    nodes = [PoolProcess(NODE_CAPACITY) for _ in range(3)]
    clients: list[subprocess.Popen] = []
    try:
        addresses = [n.address for n in nodes]
        for seed in range(CLIENTS):
            args = {
                "seed": 100 + seed,
                "nodes": addresses,
                "timeout_ms": TIMEOUT_MS,
                "connect_timeout_ms": 1000,
                "read_cache_capacity": READ_CACHE,
            }
            clients.append(
                subprocess.Popen(
                    [sys.executable, CLIENT, json.dumps(args)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in clients:  # each imports torch and connects (slow on a busy machine)
            line = read_line(proc, 90.0)
            assert line.strip() == "ready", (line, proc.poll())
        start_at = time.time() + 1.0
        stop_at = start_at + RUN_S
        for proc in clients:
            proc.stdin.write(json.dumps({"start_at": start_at, "stop_at": stop_at}) + "\n")
            proc.stdin.flush()
        sampler = NodeSampler(nodes, start_at, stop_at, [])
        sampler.start()
        killed, paused = nodes[0], nodes[1]
        events: list[str] = []

        def at(offset: float) -> None:
            time.sleep(max(0.0, start_at + offset - time.time()))

        at(0.3 * RUN_S)
        killed.kill()
        events.append(f"t={time.time() - start_at:.1f}s node {killed.address} killed")
        at(0.3 * RUN_S + 3)
        killed.restart()
        events.append(f"t={time.time() - start_at:.1f}s node {killed.address} restarted")
        at(0.55 * RUN_S)
        paused.pause()
        events.append(f"t={time.time() - start_at:.1f}s node {paused.address} stopped")
        at(0.55 * RUN_S + 4)
        paused.resume()
        events.append(f"t={time.time() - start_at:.1f}s node {paused.address} resumed")

        results = []
        for proc in clients:
            out, err = proc.communicate(timeout=RUN_S + 60)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert proc.returncode == 0 and lines, (out[-2000:], err[-4000:])
            results.append(json.loads(lines[-1]))
        sampler.stop.set()
        sampler.join()
        node_alive = [n.proc.poll() is None for n in nodes]
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for node in nodes:
            node.cleanup()

    total_ops = sum(r["ops"] for r in results)
    # node samples carry time, not ops: convert with the run's average op rate
    rate = total_ops / RUN_S
    node_growth = []
    for pid, samples in sampler.samples.items():
        for s in samples:
            s["ops"] = int(s["t"] * rate)
        judged = growth(samples)
        if judged is not None:
            node_growth.append({"pid": pid, **judged})
    client_growth = [g for g in (growth(r["samples"]) for r in results) if g is not None]
    assert len(client_growth) == CLIENTS and len(node_growth) >= 3, (client_growth, node_growth)
    longest = max(r["longest_call_s"] for r in results)
    figures = {
        "clients": CLIENTS,
        "run_s": RUN_S,
        "ops": total_ops,
        "ops_by_kind": {k: sum(r[k] for r in results) for k in ("save", "load", "exists", "async")},
        "blocks_saved": sum(r["blocks_saved"] for r in results),
        "blocks_loaded": sum(r["blocks_loaded"] for r in results),
        "blocks_checked": sum(r["blocks_checked"] for r in results),
        "wrong_bytes": sum(r["wrong_bytes"] for r in results),
        "errors": {k: sum(r["errors"].get(k, 0) for r in results) for r in results for k in r["errors"]},
        "longest_call_s": round(longest, 3),
        "timeout_s": TIMEOUT_MS / 1000,
        "margin_s": CALL_MARGIN_S,
        "client_growth_per_1000_ops": [{k: round(v, 2) for k, v in g["per_1000"].items()} for g in client_growth],
        "node_growth_per_1000_ops": [{k: round(v, 2) for k, v in g["per_1000"].items()} for g in node_growth],
        "client_final": [r["samples"][-1] for r in results],
        "node_final": [{k: round(v, 1) for k, v in samples[-1].items()} for samples in sampler.samples.values()],
        "events": events,
        "nodes_alive_at_end": node_alive,
    }
    print("\nsoak figures:", json.dumps(figures, indent=1))
    if os.environ.get("EMS_SOAK_SAMPLES"):
        Path(os.environ["EMS_SOAK_SAMPLES"]).write_text(
            json.dumps({"clients": [r["samples"] for r in results], "nodes": list(sampler.samples.values())})
        )
    if os.environ.get("EMS_SOAK_REPORT"):
        with open(os.environ["EMS_SOAK_REPORT"], "a", encoding="utf-8") as f:
            f.write(json.dumps(figures) + "\n")

    assert figures["wrong_bytes"] == 0 and sum(r["wrong_blocks"] for r in results) == 0
    assert all(r["ops"] > 50 for r in results), [r["ops"] for r in results]
    assert figures["blocks_loaded"] > 0 and figures["blocks_saved"] > 0
    assert longest <= TIMEOUT_MS / 1000 + CALL_MARGIN_S, figures
    assert all(node_alive), figures
    for g in client_growth:
        assert g["per_1000"]["rss_mib"] <= CLIENT_RSS_MIB_PER_1000 or g["rss_mib"] <= 2 * CLIENT_RSS_MIB_PER_1000, g
        assert g["threads"] <= SLACK_THREADS or g["per_1000"]["threads"] <= THREADS_PER_1000, g
        assert g["fds"] <= SLACK_FDS or g["per_1000"]["fds"] <= FDS_PER_1000, g
    for g in node_growth:
        assert g["per_1000"]["rss_mib"] <= NODE_RSS_MIB_PER_1000 or g["rss_mib"] <= 2 * NODE_RSS_MIB_PER_1000, g
        assert g["threads"] <= SLACK_THREADS or g["per_1000"]["threads"] <= THREADS_PER_1000, g
        assert g["fds"] <= SLACK_FDS or g["per_1000"]["fds"] <= FDS_PER_1000, g
