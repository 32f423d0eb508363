"""One client process of the soak test (test_soak.py): `python soak_client.py JSON` connects, prints `ready`, reads
`{"start_at": ..., "stop_at": ...}` (epoch seconds) from stdin, runs mixed save / load / exists through `import ems`
against the given pool nodes from start to stop, and prints one JSON line of figures.

Every block's content is a pure function of its hash (`block_content`), so any process can check any block it
loads, whoever saved it: a loaded block that differs by one byte is a wrong block; a miss is fine. Each call's
duration is compared with its timeout. The process samples its own RSS, threads and open fds as it goes.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: ems_testlib

from ems_testlib import make_cache, tensors

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException

BLOCK_SIZE = 4
BLOCKS = 64
HASHES = 12_000  # hash universe: ~24 MB of values against three 4 MiB nodes, so eviction never stops
MIX = np.uint64(0x9E3779B97F4A7C15)


def tokens_of(h: int) -> int:
    """Tokens a block of hash h holds (every process agrees)."""
    return 2 if h % 5 == 0 else BLOCK_SIZE


def block_content(hashes: list[int], shape: tuple[int, ...]) -> np.ndarray:
    """uint8 `[n, *shape]`: the bytes block `hashes[i]` holds, a pure function of the hash (vectorised)."""
    count = int(np.prod(shape))
    with np.errstate(over="ignore"):
        x = (np.arange(1, count + 1, dtype=np.uint64)[None, :] * MIX) ^ (np.asarray(hashes, np.uint64)[:, None] * MIX)
        x ^= x >> np.uint64(29)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
    return (x & np.uint64(0xFF)).astype(np.uint8).reshape(len(hashes), *shape)


def sample_resources() -> dict:
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
    }


class Client:
    def __init__(self, args: dict) -> None:
        self.rng = random.Random(args["seed"])
        self.timeout_ms = args["timeout_ms"]
        self.option = CcKvOption(timeout=self.timeout_ms)
        Ems.init(
            EmsConfig(
                cc_config=CcConfig(rank_id=0, device_id=0, model_id="soak-model"),
                pool_nodes=args["nodes"],
                connect_timeout_ms=args["connect_timeout_ms"],
                read_cache_capacity=args["read_cache_capacity"],
            )
        )
        self.cc = Ems.get_cc()
        torch.manual_seed(args["seed"])
        self.cache = make_cache(layers=2, blocks=BLOCKS, block_size=BLOCK_SIZE, heads=2, head_size=32)
        self.cc.register_kvcache(self.cache)
        # each plane as raw bytes [blocks, block_size, row_bytes]
        self.planes = [t.view(torch.uint8).reshape(BLOCKS, BLOCK_SIZE, -1) for t in tensors(self.cache)]
        self.block_shape = (len(self.planes), BLOCK_SIZE, self.planes[0].shape[-1])
        self.figures = {
            "ops": 0,
            "save": 0,
            "load": 0,
            "exists": 0,
            "async": 0,
            "blocks_saved": 0,
            "blocks_loaded": 0,
            "blocks_checked": 0,
            "wrong_bytes": 0,
            "wrong_blocks": 0,
            "errors": {},
            "longest_call_s": 0.0,
            "samples": [],
        }

    # ---- blocks ----

    def write_blocks(self, block_ids: list[int], hashes: list[int]) -> None:
        content = torch.from_numpy(block_content(hashes, self.block_shape))
        ids = torch.tensor(block_ids)
        for p, plane in enumerate(self.planes):
            plane[ids] = content[:, p]

    def request(self, block_ids: list[int], hashes: list[int]) -> tuple[tuple, dict]:
        tokens = [tokens_of(h) for h in hashes]
        if self.rng.random() < 0.5:
            slots = [b * BLOCK_SIZE + t for b, n in zip(block_ids, tokens) for t in range(n)]
            return (slots, hashes, tokens, self.option), {}
        return (), {
            "hashes": hashes,
            "chunk_descs": [[(b * BLOCK_SIZE, n) for b, n in zip(block_ids, tokens)]],
            "option": self.option,
        }

    def chain(self) -> list[int]:
        """1 to 32 hashes, often a run of neighbours (as prefix chains are), sometimes scattered."""
        n = self.rng.randint(1, 32)
        if self.rng.random() < 0.7:
            start = self.rng.randrange(HASHES - n)
            return list(range(start, start + n))
        return self.rng.sample(range(HASHES), n)

    # ---- calls ----

    def timed(self, op: str, call):
        started = time.monotonic()
        try:
            if self.rng.random() < 0.3 and op != "exists":
                self.figures["async"] += 1
                fn = self.cc.async_save if op == "save" else self.cc.async_load
                result = self.cc.get_result(call(fn))
            else:
                fn = {"save": self.cc.save, "load": self.cc.load, "exists": self.cc.exists}[op]
                result = call(fn)
        except EmsException as error:  # an unreachable pool: allowed, counted
            name = error.status_code().name
            self.figures["errors"][name] = self.figures["errors"].get(name, 0) + 1
            result = None
        elapsed = time.monotonic() - started
        self.figures["longest_call_s"] = max(self.figures["longest_call_s"], elapsed)
        self.figures[op] += 1
        self.figures["ops"] += 1
        return result

    def save(self) -> None:
        hashes = self.chain()
        block_ids = self.rng.sample(range(BLOCKS), len(hashes))
        self.write_blocks(block_ids, hashes)
        args, kwargs = self.request(block_ids, hashes)
        result = self.timed("save", lambda fn: fn(*args, **kwargs))
        if result is not None:
            self.figures["blocks_saved"] += result.success

    def load(self) -> None:
        hashes = self.chain()
        block_ids = self.rng.sample(range(BLOCKS), len(hashes))
        ids = torch.tensor(block_ids)
        for plane in self.planes:  # poison: what a load leaves alone must still hold exactly this
            plane[ids] = torch.randint(0, 256, plane[ids].shape, dtype=torch.uint8)
        before = [plane[ids].clone() for plane in self.planes]
        args, kwargs = self.request(block_ids, hashes)
        result = self.timed("load", lambda fn: fn(*args, **kwargs))
        hits = result.success if result is not None else 0
        self.figures["blocks_loaded"] += hits
        want = block_content(hashes, self.block_shape)
        for i, h in enumerate(hashes):
            n = tokens_of(h)
            for p, plane in enumerate(self.planes):
                got = plane[block_ids[i]].numpy()
                expected = before[p][i].numpy().copy()
                if i < hits:
                    expected[:n] = want[i, p, :n]
                wrong = int((got != expected).sum())
                if wrong:
                    self.figures["wrong_bytes"] += wrong
                    self.figures["wrong_blocks"] += 1
            self.figures["blocks_checked"] += 1

    def exists(self) -> None:
        hashes = self.chain()
        self.timed("exists", lambda fn: fn(hashes, self.option))

    def run(self, start_at: float, stop_at: float) -> dict:
        while time.time() < start_at:
            time.sleep(0.01)
        self.figures["samples"].append({"ops": 0, **sample_resources()})
        while time.time() < stop_at:
            roll = self.rng.random()
            if roll < 0.4:
                self.save()
            elif roll < 0.8:
                self.load()
            else:
                self.exists()
            if self.figures["ops"] % 50 == 0:
                self.figures["samples"].append({"ops": self.figures["ops"], **sample_resources()})
        self.figures["samples"].append({"ops": self.figures["ops"], **sample_resources()})
        return self.figures


def main() -> None:
    args = json.loads(sys.argv[1])
    client = Client(args)
    print("ready", flush=True)
    times = json.loads(sys.stdin.readline())  # the run starts when every client is ready
    figures = client.run(times["start_at"], times["stop_at"])
    print(json.dumps(figures), flush=True)
    Ems.shutdown()


if __name__ == "__main__":
    main()
