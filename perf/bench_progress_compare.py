"""The client's progress model before and after, side by side in one run: this checkout's `UcxNode` against another
tree's (`--before DIR`), shared memory off (`--shm auto`: on), one node per round.

What it measures, in child processes that alternate between the two trees round by round (so load changes on this
shared host hit both alike): a 1-key exists (median of `--calls`), and the 62 MiB load of a 4,000-token prompt (124
values of 512 KiB, `UcxNode.get_into` into reused buffers) alone, beside a busy pure-Python thread (holding the GIL
but for the interpreter's switch interval) and beside a thread as busy that does not hold the GIL (hashing 1 MiB at a
time: the CPU a busy thread takes, without its GIL hand-overs); per tree, the best of each over all rounds.

`--before DIR`: a directory holding an importable `ems` package of the other tree, laid out as installed (its
`transport/` and `kernels/` copied to `ems/transport` and `ems/kernels`), e.g. for main:
    git archive main | tar -x -C /tmp/base && mkdir /tmp/base-site && cp -r /tmp/base/ems /tmp/base-site/ems &&
    cp -r /tmp/base/transport /tmp/base-site/ems/transport && cp -r /tmp/base/kernels /tmp/base-site/ems/kernels
The children for that tree run with it first on PYTHONPATH and this venv's editable finder for this checkout removed
(a `sitecustomize` written there), and so do the pool nodes they start.
Usage: python perf/bench_progress_compare.py --before DIR [--rounds N] [--calls N] [--shm off|auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import hashlib, json, statistics, sys, threading, time
sys.path.insert(0, sys.argv[1] + "/tests/pool")
import numpy as np
from pool_testlib import PoolProcess, make_values
try:
    from ems.transport.ucx.client import UcxNode
except ImportError:  # a tree from before the transport's split by medium (transport/ucx.py)
    from ems.transport.ucx import UcxNode

class Busy:
    def __init__(self, gil):
        self.gil, self.stop = gil, threading.Event()
        self.thread = threading.Thread(target=self.spin, daemon=True)
    def spin(self):
        data, n = bytes(1 << 20), 0
        while not self.stop.is_set():
            if self.gil:
                for _ in range(1000):
                    n += 1
            else:
                hashlib.sha256(data).digest()
    def __enter__(self):
        self.thread.start()
    def __exit__(self, *exc):
        self.stop.set(); self.thread.join()

calls = int(sys.argv[2])
node = PoolProcess("512MiB")
try:
    kwargs = {"connect_timeout_ms": 5000}
    try:
        from ems.transport.shm.client import ShmMode
        kwargs["shm"] = ShmMode(sys.argv[3])
    except ImportError:
        try:  # (before the split by medium)
            from ems.transport.shm_client import ShmMode
            kwargs["shm"] = ShmMode(sys.argv[3])
        except ImportError:
            pass
    client = UcxNode(node.address, **kwargs)
    n, size = 124, 512 << 10
    values = make_values(n, size - 40, seed=62)
    keys = [f"e{i}".encode() for i in range(n)]
    assert all(client.put(keys, values, 60))
    outs = [np.empty(size, np.uint8) for _ in range(n)]
    assert all(client.get_into(keys, outs, 60)) and bytes(outs[7]) == b"".join(values[7])
    for _ in range(20):
        client.exists([b"e1"], 5)
    times = []
    for _ in range(calls):
        start = time.perf_counter(); client.exists([b"e1"], 5); times.append(time.perf_counter() - start)
    def load():
        start = time.perf_counter(); client.get_into(keys, outs, 60); return time.perf_counter() - start
    best = {"alone": load(), "busy Python thread": float("inf"), "GIL-free busy thread": float("inf")}
    for _ in range(2):
        best["alone"] = min(best["alone"], load())
        with Busy(True):
            best["busy Python thread"] = min(best["busy Python thread"], load())
        with Busy(False):
            best["GIL-free busy thread"] = min(best["GIL-free busy thread"], load())
    print(json.dumps({"exists": statistics.median(times) * 1e6, **{k: n * size / v / 1e9 for k, v in best.items()}}))
finally:
    node.cleanup()
"""


def run_child(tree: str, before_site: Path | None, calls: int, shm: str) -> dict:
    env = dict(os.environ)
    if before_site is not None:
        env["PYTHONPATH"] = str(before_site)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), str(calls), shm],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{tree}: {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True, help="site directory of the other tree (docstring)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--shm", choices=("off", "auto"), default="off", help="auto: same-host shared memory on")
    args = parser.parse_args()
    site = args.before.resolve()
    transport = site / "ems" / "transport"
    if not (transport / "ucx" / "client.py").exists() and not (transport / "ucx.py").exists():
        raise SystemExit(f"{site}: no ems/transport/ucx/client.py (nor ucx.py, before the split; see the docstring)")
    # the other tree's children must not import this checkout through the editable install
    (site / "sitecustomize.py").write_text(
        "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
    )
    sys.path.insert(0, str(ROOT / "perf"))
    from benchlib import machine

    print(f"# {machine()}")
    results: dict = {"before": [], "after": []}
    for _ in range(args.rounds):
        results["before"].append(run_child("before", site, args.calls, args.shm))
        results["after"].append(run_child("after", None, args.calls, args.shm))
    keys = ["alone", "busy Python thread", "GIL-free busy thread"]
    print(
        f"\nClient progress model, before ({site}) and after (this checkout), shared memory {args.shm}, {args.rounds} "
        f"rounds in turn; exists: the best round's median of {args.calls}; loads: best of all rounds, GB/s\n"
    )
    print(
        "| client | exists µs | 62 MiB load alone | beside a busy Python thread | beside a GIL-free busy thread "
        "| busy Python / alone | busy Python / GIL-free busy |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        exists = min(r["exists"] for r in rows)
        best = {k: max(r[k] for r in rows) for k in keys}
        print(
            f"| {name} | {exists:.0f} | {best['alone']:.2f} | {best['busy Python thread']:.2f} "
            f"| {best['GIL-free busy thread']:.2f} | {best['busy Python thread'] / best['alone']:.2f}x "
            f"| {best['busy Python thread'] / best['GIL-free busy thread']:.2f}x |"
        )
    print("\nper round:", json.dumps(results))


if __name__ == "__main__":
    main()
