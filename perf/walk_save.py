"""The walk of one call: which files' Python code runs during one warm V1 save or load through the public API, in
the order first visited, how often the call moves from one file to another and how often from one folder to another.

Contract: `python perf/walk_save.py [--pool embedded|nodes] [--op save|load] [--nodes N] [--root PATH]`. `--pool
embedded` (default): the pool in this process (CPU tensors). `--pool nodes`: `--nodes` (default 2) real `ems.pool`
node processes on 127.0.0.1 (the client's process is the one walked). `--op`: the call walked. `--root`: the source
tree to walk (a checkout of another commit, its `ems`, `transport` and `kernels` on `PYTHONPATH` as that tree maps
them; default: this tree). It saves and loads two blocks once (warm-up: registration and first-call work are not the
walk), then profiles a second call of two other blocks (`sys.setprofile`: every Python function called, in `ems/`,
`transport/` and `kernels/` of the root) and prints the files in the order first visited, their count, the number of
file-to-file switches and folder-to-folder changes. Functions on other threads (the UCX progress loop) are not the
call's walk. C code (the compiled host copy, numpy, torch, UCX) is not a file of the walk. Counts, not timings.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", choices=("embedded", "nodes"), default="embedded")
    ap.add_argument("--op", choices=("save", "load"), default="save")
    ap.add_argument("--nodes", type=int, default=2, help="node processes with --pool nodes (default: 2)")
    ap.add_argument("--root", type=Path, default=HERE.parent, help="the source tree to walk (default: this one)")
    args = ap.parse_args()
    root = args.root.resolve()
    tops = [str(root / top) + os.sep for top in ("ems", "transport", "kernels")]
    for tests in (root / "tests", root / "tests" / "ems", root / "tests" / "pool"):  # the tree's test helpers
        sys.path.insert(0, str(tests))
    from ems_testlib import make_cache

    from ems import CcConfig, Ems, EmsConfig

    nodes: list[Any] = []
    if args.pool == "nodes":
        from pool_testlib import PoolProcess

        nodes = [PoolProcess("64MiB") for _ in range(args.nodes)]
        config = EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="walk"), pool_nodes=[n.address for n in nodes])
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
            cc.save(slots, [21, 22], [4, 4])
        seen: list[str] = []
        switches = [0, 0]  # files, folders
        last: list[str | None] = [None]

        def visit(frame: FrameType, event: str, arg: Any) -> None:
            if event != "call":
                return
            path = os.path.realpath(frame.f_code.co_filename)
            if not any(path.startswith(top) for top in tops):
                return
            name = os.path.relpath(path, root)
            if name != last[0]:
                switches[0] += 1
                if last[0] is None or os.path.dirname(name) != os.path.dirname(last[0]):
                    switches[1] += 1
                last[0] = name
            if name not in seen:
                seen.append(name)

        call = cc.save if args.op == "save" else cc.load
        sys.setprofile(visit)
        result = call(slots, [21, 22], [4, 4])
        sys.setprofile(None)
    finally:
        Ems.shutdown()
        for node in nodes:
            node.kill()
    print(f"root {root}, {args.pool} pool, {args.op}: {result}")
    for i, name in enumerate(seen, 1):
        print(f"{i:2d}. {name}")
    print(f"{len(seen)} files, {switches[0]} file-to-file switches, {switches[1]} folder changes")


if __name__ == "__main__":
    main()
