"""The walk of one save: which files' Python code runs during one V1 save through the public API (the embedded pool,
CPU tensors), in the order first visited, and how often the call moves from one file to another.

Contract: `python perf/walk_save.py [--root PATH]`. `--root`: the source tree to walk (a checkout of another commit,
its `ems`, `transport` and `kernels` on `PYTHONPATH` as that tree maps them; default: this tree). It saves two
blocks once (warm-up: registration and first-call work are not the walk), then profiles a second save of two other
blocks (`sys.setprofile`: every Python function called, in `ems/`, `transport/` and `kernels/` of the root) and
prints the files in the order first visited, their count and the number of file-to-file switches. C code (the
compiled host copy, numpy, torch) is not a file of the walk. Counts, not timings: nothing is appended to
perf/RESULTS.md (the walk recorded there comes with this command).
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
    ap.add_argument("--root", type=Path, default=HERE.parent, help="the source tree to walk (default: this one)")
    args = ap.parse_args()
    root = args.root.resolve()
    tops = [str(root / top) + os.sep for top in ("ems", "transport", "kernels")]
    for tests in (root / "tests", root / "tests" / "ems"):  # where the tree keeps its test helpers
        sys.path.insert(0, str(tests))
    from ems_testlib import make_cache

    from ems import CcConfig, Ems, EmsConfig

    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="walk"), pool_capacity="64MiB"))
    try:
        cc = Ems.get_cc()
        cc.register_kvcache(make_cache(layers=2, blocks=8, block_size=4))
        slots = list(range(8))
        cc.save(slots, [11, 12], [4, 4])  # warm-up
        seen: list[str] = []
        switches = [0]
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
                last[0] = name
            if name not in seen:
                seen.append(name)

        sys.setprofile(visit)
        result = cc.save(slots, [21, 22], [4, 4])
        sys.setprofile(None)
    finally:
        Ems.shutdown()
    print(f"root {root}: {result}")
    for i, name in enumerate(seen, 1):
        print(f"{i:2d}. {name}")
    print(f"{len(seen)} files, {switches[0]} file-to-file switches")


if __name__ == "__main__":
    main()
