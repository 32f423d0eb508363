"""An engine process for the cluster tests: `python cluster_engine.py CONFIG_JSON`, then one JSON command per stdin
line, one JSON reply per stdout line (first reply: `{"ready": true}`).

CONFIG: etcd (or nodes: a fixed list), cluster, replicas, hash_base; optional timeout_ms (3000), layers, blocks,
block_size, heads, head_size (the KV cache's geometry: 2 layers, 64 blocks of 4 tokens x 2 heads x 16 by default).
The KV cache is seeded, so block b always has the same bytes (hash `hash_base + b`). Each block is saved and loaded
by its own call, so every block's outcome is seen:
* {"op": "save", "blocks": [...]} → {"saved": [0/1...], "errors": [...]}
* {"op": "load", "blocks": [...]} → {"result": ["hit" (byte-exact) | "miss" (slots untouched) | "wrong" | "error"]}
* {"op": "traffic", "seconds": s, "blocks": [...]} → save+load the blocks over and over: counts of calls, raised
  errors, wrong blocks
* {"op": "members"} → {"members": [...], "connected": bool, "rebalancing": nodes seen joining or coming back in the
  last `ems.cluster.placement.REBALANCE_S`};  {"op": "metrics"} → ContextCaching.metrics()
* {"op": "holders", "blocks": [...]} → {"holders": [[addresses of the live nodes holding block b]...], "unreached":
  [addresses]} (each node asked directly, as this engine's tenant; a node whose call fails, e.g. a connection to a
  restarted node that has not reconnected yet, is asked again after the client's reconnect back-off, up to 4 times;
  one that never answers is listed in "unreached", its blocks counted as not held there)
* {"op": "bulk", "what": "save"|"load", "blocks": [...], "rounds": r, "base": h} → one call for all the blocks
  (hashes `h + b`), r times: {"seconds": [...], "success": [...], "stages": {stage: seconds} of the fastest,
  "shares": [[node address, start, seconds] of each node's requests (`FanOut.run`) in the fastest, from its start],
  "cpu": {thread name: CPU seconds of this process's threads of that name during the fastest (/proc schedstat)},
  "host_cpu": CPU seconds the whole machine spent busy (every process, the kernel's network work) during it}
* {"op": "timed", "what": "load"|"exists", "blocks": [...], "rounds": r} → per-call seconds of one-block calls,
  r rounds over the blocks: {"seconds": [...], "hits": n, "wrong": n, "missed": [blocks not hit, in call order]}
* {"op": "stages", "rounds": r} → seconds of each layer under one block's `exists`, r calls of each, interleaved:
  `api` (ContextCaching.exists), `pool` (the pool client: router, reads), `node` (UcxNode.exists), `wait` (the
  part of a `node` call spent waiting for UCX to complete its requests: posted to answered), `ping` (UcxNode.ping,
  a header each way)
* {"op": "scrape", "url": "http://..."} → {"text": ...} (a node's metrics, read from this engine's host)
* {"op": "probe", "rounds": r} → {"ping": [...], "exists": [...]}: seconds of the first node's client `ping` and
  `exists` of one key, r of each (the layers under `ContextCaching.exists`)
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: ems_testlib

from ems_testlib import make_cache, poison, slots_of_blocks, snapshot, tensors
from proc_cpu import host_busy_seconds, thread_schedstat_ns

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException


def main() -> None:
    config = json.loads(sys.argv[1])
    # white-box: the engine's membership watcher, for "members" to report whether its etcd watch is live
    import ems.backends.remote_pool as remote_pool

    watchers: list = []

    class RecordedWatcher(remote_pool.MembershipWatcher):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            watchers.append(self)

    remote_pool.MembershipWatcher = RecordedWatcher  # type: ignore[misc]
    Ems.init(
        EmsConfig(
            cc_config=CcConfig(rank_id=0, device_id=0, model_id="cluster-model"),
            pool_etcd=config.get("etcd"),
            pool_nodes=config.get("nodes"),
            pool_cluster=config.get("cluster", "default"),
            pool_replicas=config["replicas"],
            read_cache_capacity=0,
            connect_timeout_ms=2000,
        )
    )
    cc = Ems.get_cc()
    torch.manual_seed(99)
    BS, BLOCKS = int(config.get("block_size", 4)), int(config.get("blocks", 64))
    OPTION = CcKvOption(timeout=int(config.get("timeout_ms", 3000)), write_rcache=False)
    cache = make_cache(
        layers=int(config.get("layers", 2)),
        blocks=BLOCKS,
        block_size=BS,
        heads=int(config.get("heads", 2)),
        head_size=int(config.get("head_size", 16)),
        dtype=torch.float16,
    )
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

    def holders(cc, blocks: list[int]) -> tuple[list[list[str]], list[str]]:
        from ems.datapath.keys import v1_keys

        keys, _ = v1_keys(cc._v1_namespace, [base + b for b in blocks])
        out: list[list[str]] = [[] for _ in blocks]
        unreached: list[str] = []
        for node in Ems._pool.nodes:  # type: ignore[union-attr]
            for _ in range(4):
                try:
                    flags = node.exists(keys, 3.0)
                    break
                except EmsException:
                    time.sleep(0.6)  # past the client's reconnect back-off (0.5 s)
            else:
                unreached.append(node.address)
                continue
            for i, held in enumerate(flags):
                if held:
                    out[i].append(node.address)
        return out, unreached

    def thread_cpu() -> dict[str, tuple[str, int]]:
        """This process's threads: id -> (name, nanoseconds on a CPU so far); a Python thread by its Python name
        ("MainThread", an executor's "ThreadPoolExecutor-0_1"), any other ("native") by its id: UCX's progress
        and async threads, torch's."""
        import threading

        python = {t.native_id: t.name for t in threading.enumerate()}
        return {str(tid): (python.get(tid, f"native-{tid}"), ns) for tid, ns in thread_schedstat_ns().items()}

    def cpu_between(before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]]) -> dict[str, float]:
        """CPU seconds per thread name between two `thread_cpu` readings."""
        spent: dict[str, float] = {}
        for tid, (name, ns) in after.items():
            spent[name] = spent.get(name, 0.0) + (ns - before.get(tid, (name, 0))[1]) / 1e9
        return {name: s for name, s in sorted(spent.items(), key=lambda kv: -kv[1]) if s > 0}

    def bulk(what: str, blocks: list[int], rounds: int, first: int) -> dict:
        from ems.backends.fanout import FanOut
        from ems.records import JobKind

        restore()
        slots, hashes, offsets = slots_of_blocks(blocks, BS), [first + b for b in blocks], [BS] * len(blocks)
        seconds, success, best, stages, shares, cpu, host = [], [], float("inf"), {}, [], {}, 0.0
        plain_run = FanOut.run
        runs: list[list] = []

        def timed_run(self, node, *args, **kwargs):  # type: ignore[no-untyped-def]
            begin = time.perf_counter()
            try:
                return plain_run(self, node, *args, **kwargs)
            finally:
                runs.append([node.address, begin, time.perf_counter() - begin])

        FanOut.run = timed_run  # type: ignore[method-assign]
        try:
            for _ in range(rounds):
                runs.clear()
                cpu_before, host_before = thread_cpu(), host_busy_seconds()
                start = time.perf_counter()
                try:
                    r = (cc.save if what == "save" else cc.load)(slots, hashes, offsets, OPTION).success
                except EmsException:
                    r = -1
                t = time.perf_counter() - start
                cpu_after, host_after = thread_cpu(), host_busy_seconds()
                seconds.append(t)
                success.append(r)
                if t < best:
                    best = t
                    job = cc.jobs.last(JobKind.SAVE if what == "save" else JobKind.LOAD)
                    stages = {k.value: v.seconds for k, v in job.stages.items()} if job is not None else {}
                    shares = [[a, b - start, d] for a, b, d in runs]
                    cpu, host = cpu_between(cpu_before, cpu_after), host_after - host_before
        finally:
            FanOut.run = plain_run  # type: ignore[method-assign]
        return {"seconds": seconds, "success": success, "stages": stages, "shares": shares, "cpu": cpu, "host_cpu": host}

    def timed(what: str, blocks: list[int], rounds: int) -> dict:
        poisoned = poison(cache)
        seconds, hits, wrong, missed = [], 0, 0, []
        for _ in range(rounds):
            for b in blocks:
                start = time.perf_counter()
                try:
                    if what == "exists":
                        ok = cc.exists([base + b], OPTION).success
                    else:
                        ok = cc.load(slots_of_blocks([b], BS), [base + b], [BS], OPTION).success
                except EmsException:
                    ok = 0
                seconds.append(time.perf_counter() - start)
                hits += ok
                if not ok:
                    missed.append(b)
                if what == "load":
                    want = original if ok else poisoned
                    if not all(torch.equal(t[b].view(torch.uint8), w[b].view(torch.uint8)) for t, w in zip(tensors(cache), want)):
                        wrong += 1
        return {"seconds": seconds, "hits": hits, "wrong": wrong, "missed": missed}

    def stages(rounds: int) -> dict:
        """White-box: the layers under one block's exists, each timed alone (see the module docstring)."""
        from ems.backends.base import PoolCall
        from ems.datapath.keys import v1_keys
        from ems.transport.ucx.direct import DirectRuntime

        pool = Ems._pool
        node = pool.nodes[0]  # type: ignore[union-attr]
        key, route = v1_keys(cc._v1_namespace, [base])
        out: dict[str, list[float]] = {"api": [], "pool": [], "node": [], "wait": [], "ping": []}
        waits: list[float] = []
        plain_wait = DirectRuntime.wait

        def timed_wait(self, posted, deadline):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return plain_wait(self, posted, deadline)
            finally:
                waits.append(time.perf_counter() - start)

        for _ in range(rounds):
            start = time.perf_counter()
            cc.exists([base], OPTION)
            out["api"].append(time.perf_counter() - start)
            start = time.perf_counter()
            pool.exists(PoolCall(route, key, OPTION))  # type: ignore[union-attr]
            out["pool"].append(time.perf_counter() - start)
            DirectRuntime.wait = timed_wait  # type: ignore[method-assign]
            waits.clear()
            try:
                start = time.perf_counter()
                node.exists(key, 3.0)
                out["node"].append(time.perf_counter() - start)
            finally:
                DirectRuntime.wait = plain_wait  # type: ignore[method-assign]
            out["wait"].append(sum(waits))
            start = time.perf_counter()
            node.ping(3.0)
            out["ping"].append(time.perf_counter() - start)
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
                # nodes seen joining or coming back lately: reads also ask the nodes after a key's owners
                "rebalancing": Ems._pool.router.members.fallback(),  # type: ignore[union-attr]
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
        elif op == "holders":
            found, unreached = holders(cc, command["blocks"])
            reply = {"holders": found, "unreached": unreached}
        elif op == "bulk":
            reply = bulk(command["what"], command["blocks"], int(command.get("rounds", 1)), int(command.get("base", base)))
        elif op == "timed":
            reply = timed(command["what"], command["blocks"], int(command.get("rounds", 1)))
        elif op == "probe":  # per-call seconds of the layers under `exists`: the node client's ping and exists
            node = Ems._pool.nodes[0]  # type: ignore[union-attr]
            from ems.datapath.keys import v1_keys

            key = v1_keys(cc._v1_namespace, [base])[0]
            pings, exists = [], []
            for _ in range(int(command.get("rounds", 500))):
                start = time.perf_counter()
                node.ping(3.0)
                pings.append(time.perf_counter() - start)
                start = time.perf_counter()
                node.exists(key, 3.0)
                exists.append(time.perf_counter() - start)
            reply = {"ping": pings, "exists": exists}
        elif op == "stages":
            reply = stages(int(command.get("rounds", 500)))
        elif op == "scrape":
            with urllib.request.urlopen(command["url"], timeout=5) as r:
                reply = {"text": r.read().decode()}
        else:
            reply = {"unknown": op}
        print(json.dumps(reply), flush=True)
    Ems.shutdown()


if __name__ == "__main__":
    main()
