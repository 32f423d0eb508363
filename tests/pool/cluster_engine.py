"""An engine process for the cluster tests: `python cluster_engine.py CONFIG_JSON`, then one JSON command per stdin
line, one JSON reply per stdout line (first reply: `{"ready": true}`).

CONFIG: etcd, cluster, replicas, hash_base. The KV cache is seeded, so block b always has the same bytes (hash
`hash_base + b`). Each block is saved and loaded by its own call, so every block's outcome is seen:
* {"op": "save", "blocks": [...]} → {"saved": [0/1...], "errors": [...]}
* {"op": "load", "blocks": [...]} → {"result": ["hit" (byte-exact) | "miss" (slots untouched) | "wrong" | "error"]}
* {"op": "traffic", "seconds": s, "blocks": [...]} → save+load the blocks over and over: counts of calls, raised
  errors, wrong blocks
* {"op": "members"} → {"members": [...], "connected": bool};  {"op": "metrics"} → ContextCaching.metrics()
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: ems_testlib

from ems_testlib import make_cache, poison, slots_of_blocks, snapshot, tensors

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException

BS, BLOCKS = 4, 64
OPTION = CcKvOption(timeout=3000)


def main() -> None:
    config = json.loads(sys.argv[1])
    # white-box: the engine's membership watcher, for "members" to report whether its etcd watch is live
    import ems.cluster.remote_pool as remote_pool

    watchers: list = []

    class RecordedWatcher(remote_pool.MembershipWatcher):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            watchers.append(self)

    remote_pool.MembershipWatcher = RecordedWatcher  # type: ignore[misc]
    Ems.init(
        EmsConfig(
            cc_config=CcConfig(rank_id=0, device_id=0, model_id="cluster-model"),
            pool_etcd=config["etcd"],
            pool_cluster=config["cluster"],
            pool_replicas=config["replicas"],
            read_cache_capacity=0,
            connect_timeout_ms=2000,
        )
    )
    cc = Ems.get_cc()
    torch.manual_seed(99)
    cache = make_cache(layers=2, blocks=BLOCKS, block_size=BS, heads=2, head_size=16, dtype=torch.float16)
    original = snapshot(cache)
    cc.register_kvcache(cache)
    base = int(config.get("hash_base", 0))
    rows = torch.arange(BS)

    def restore() -> None:
        for t, o in zip(tensors(cache), original):
            t.copy_(o)

    def save(blocks: list[int]) -> tuple[list[int], list[str]]:
        restore()
        saved, errors = [], []
        for b in blocks:
            try:
                saved.append(cc.save(slots_of_blocks([b], BS), [base + b], [BS], OPTION).success)
            except EmsException as error:
                saved.append(0)
                errors.append(error.status_code().name)
        return saved, errors

    def load(blocks: list[int]) -> list[str]:
        poisoned = poison(cache)
        out = []
        for b in blocks:
            try:
                r = cc.load(slots_of_blocks([b], BS), [base + b], [BS], OPTION)
            except EmsException:
                out.append("error")
                continue
            want = original if r.success else poisoned
            exact = all(
                torch.equal(t[b, rows].view(torch.uint8), w[b, rows].view(torch.uint8)) for t, w in zip(tensors(cache), want)
            )
            out.append(("hit" if r.success else "miss") if exact else "wrong")
        return out

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if op == "members":
            reply = {
                "members": [n.address for n in Ems._pool.nodes],  # type: ignore[union-attr]
                "connected": bool(watchers and watchers[-1].connected),
            }
        elif op == "save":
            saved, errors = save(command["blocks"])
            reply = {"saved": saved, "errors": errors}
        elif op == "load":
            reply = {"result": load(command["blocks"])}
        elif op == "traffic":
            calls = errors = wrong = misses = 0
            end = time.monotonic() + command["seconds"]
            while time.monotonic() < end:
                saved, errs = save(command["blocks"])
                results = load(command["blocks"])
                calls += 2 * len(command["blocks"])
                errors += len(errs) + results.count("error")
                wrong += results.count("wrong")
                misses += results.count("miss")
            reply = {"calls": calls, "errors": errors, "wrong": wrong, "misses": misses}
        elif op == "metrics":
            reply = cc.metrics()
        else:
            reply = {"unknown": op}
        print(json.dumps(reply), flush=True)
    Ems.shutdown()


if __name__ == "__main__":
    main()
