"""The walk of one call: which files' Python code runs during one warm V1 save or load through the public API, in
the order first visited, how often the call moves from one file to another and how often from one folder to another.

Contract: `python perf/walk_save.py [--pool embedded|nodes] [--op save|load] [--nodes N] [--keys K1,K2]
[--threads caller|all] [--read-cache on|off] [--functions] [--root PATH]`. `--pool embedded` (default): the pool in
this process (CPU tensors). `--pool nodes`: `--nodes` (default 2) real `ems.pool` node processes on 127.0.0.1 (the
client's process is the one walked). `--op`: the call walked. `--root`: the source tree to walk (a checkout of
another commit, its `ems`, `transport` and `kernels` on `PYTHONPATH` as that tree maps them; default: this tree). It
saves and loads two blocks once (warm-up: registration and first-call work are not the walk), then profiles a second
call of two other blocks (`--keys`, default 21,22: where they land decides which nodes serve the call;
`sys.setprofile`: every Python function called, in `ems/`, `transport/` and `kernels/` of the root) and prints the
files in the order first visited, their count, the number of file-to-file switches and folder-to-folder changes.
`--read-cache off` (with `--pool nodes`): the client keeps no read cache, so a load asks the nodes (with it on, the
default, a load of blocks this client has just saved is served from its read cache and never reaches them).
`--threads caller` (default) walks the calling thread; `--threads all` also every other thread of the process while
the call runs (the fan-out's per-node requests, the UCX progress loop), counted as one walk: the file counts then say
what the call costs the interpreter wherever it runs. C code (the compiled host copy, numpy, torch, UCX) is not a
file of the walk. `--functions` lists, under each file, the functions the call ran there. Counts, not timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", choices=("embedded", "nodes"), default="embedded")
    ap.add_argument("--op", choices=("save", "load"), default="save")
    ap.add_argument("--nodes", type=int, default=2, help="node processes with --pool nodes (default: 2)")
    ap.add_argument("--keys", default="21,22", help="the two hashes of the walked call (default: 21,22)")
    ap.add_argument("--threads", choices=("caller", "all"), default="caller", help="the threads walked (default: caller)")
    ap.add_argument("--read-cache", choices=("on", "off"), default="on", help="the client's read cache (default: on)")
    ap.add_argument("--functions", action="store_true", help="list each file's functions the call ran")
    ap.add_argument("--root", type=Path, default=HERE.parent, help="the source tree to walk (default: this one)")
    args = ap.parse_args()
    root = args.root.resolve()
    tops = [str(root / top) + os.sep for top in ("ems", "transport", "kernels")]
    for tests in (root / "tests", root / "tests" / "ems", root / "tests" / "pool"):  # the tree's test helpers
        sys.path.insert(0, str(tests))
    from ems_testlib import make_cache

    from ems import CcConfig, Ems, EmsConfig

    keys = [int(k) for k in args.keys.split(",")]
    seen: list[str] = []
    functions: dict[str, list[str]] = {}
    switches = [0, 0]  # files, folders
    last: list[str | None] = [None]
    walking = threading.Event()
    lock = threading.Lock()

    def visit(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not walking.is_set():
            return
        path = os.path.realpath(frame.f_code.co_filename)
        if not any(path.startswith(top) for top in tops):
            return
        name = os.path.relpath(path, root)
        with lock:
            if name != last[0]:
                switches[0] += 1
                if last[0] is None or os.path.dirname(name) != os.path.dirname(last[0]):
                    switches[1] += 1
                last[0] = name
            if name not in seen:
                seen.append(name)
            names = functions.setdefault(name, [])
            if frame.f_code.co_qualname not in names:
                names.append(frame.f_code.co_qualname)

    if args.threads == "all":
        threading.setprofile(visit)  # every thread started from here on (the client's threads start in Ems.init)
    nodes: list[Any] = []
    if args.pool == "nodes":
        from pool_testlib import PoolProcess

        nodes = [PoolProcess("64MiB") for _ in range(args.nodes)]
        cache: dict[str, Any] = {"read_cache_capacity": 0} if args.read_cache == "off" else {}
        config = EmsConfig(
            cc_config=CcConfig(rank_id=0, device_id=0, model_id="walk"), pool_nodes=[n.address for n in nodes], **cache
        )
    else:
        config = EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="walk"), pool_capacity="64MiB")
    Ems.init(config)
    try:
        cc = Ems.get_cc()
        cc.register_kvcache(make_cache(layers=2, blocks=8, block_size=4))
        slots = list(range(8))
        cc.save(slots, [11, 12], [4, 4])  # warm-up
        cc.load(slots, [11, 12], [4, 4])
        if args.op == "load":
            cc.save(slots, keys, [4, 4])
        call = cc.save if args.op == "save" else cc.load
        sys.setprofile(visit)
        walking.set()
        result = call(slots, keys, [4, 4])
        walking.clear()
        sys.setprofile(None)
    finally:
        Ems.shutdown()
        for node in nodes:
            node.kill()
    print(f"root {root}, {args.pool} pool, {args.op} of {keys}, {args.threads} threads, read cache {args.read_cache}: {result}")
    for i, name in enumerate(seen, 1):
        print(f"{i:2d}. {name}")
        if args.functions:
            print("      " + ", ".join(functions[name]))
    print(f"{len(seen)} files, {switches[0]} file-to-file switches, {switches[1]} folder changes")


if __name__ == "__main__":
    main()
