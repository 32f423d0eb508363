"""The token form's cost, side by side with the hash form it replaces, in one run.

    flock /tmp/heavy.lock python perf/bench_tokens.py [--reps 30]

A token-form call derives every block's key from the tokens before it (a chained XXH3-128 over the int64 token
bytes, `ems.datapath.tokens`), so its fixed cost grows with the sequence, not with what it moves. Two tables:

1. Key derivation for n tokens: the compiled loop (`chain_digests`), the Python fallback (one xxhash call per block)
   and, as the limit, one XXH3-128 over all n tokens' bytes at once (no chaining).
2. Calls on the embedded pool (CPU): a decode step's one-block save at the end of an n-token sequence (its
   arguments as lists, as the SDK's sample passes them, or as tensors), and a prefill's load of the whole sequence
   (lists), by tokens vs by hashes the engine already holds (the hash form's cost, which does no hashing of its own;
   its one-block save passes only that block's slots).

Medians of `--reps` calls, interleaved. Prints the tables and appends them with this command to perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from benchlib import machine
from ems_testlib import make_cache

from ems import CcConfig, CcResult, Ems, EmsConfig
from ems.datapath.tokens import chain_digests, chain_digests_in_python

BLOCK = 16


def median_us(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median µs of each function, the functions interleaved round by round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def keys_table(reps: int) -> list[str]:
    rows = [
        f"| tokens (blocks of {BLOCK}) | compiled chain µs | Python chain µs | one XXH3-128 of all bytes µs | Python / compiled "
        "| compiled / one hash |",
        "|---|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(0)
    for n in (1_000, 16_000, 128_000):
        tokens = rng.integers(0, 150_000, n, dtype=np.int64)
        raw = tokens.tobytes()
        t = median_us(
            {
                "compiled": lambda: chain_digests(tokens, BLOCK),
                "python": lambda: chain_digests_in_python(tokens, BLOCK),
                "one": lambda: xxhash.xxh3_128_digest(raw),
            },
            reps,
        )
        rows.append(
            f"| {n} | {t['compiled']:.0f} | {t['python']:.0f} | {t['one']:.0f} | {t['python'] / t['compiled']:.1f}x "
            f"| {t['compiled'] / t['one']:.1f}x |"
        )
    return rows


def calls_table(reps: int) -> list[str]:
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="bench-tokens"), pool_capacity="256MiB"))
    cc = Ems.get_cc()
    assert cc is not None
    blocks = 131_072 // BLOCK  # room for 128k tokens (32 MiB)
    cache = make_cache(layers=1, blocks=blocks, block_size=BLOCK, heads=1, head_size=64, dtype=torch.float16)
    cc.register_kvcache(cache)
    rows = [
        "| call (embedded pool, 1 layer, 4 KiB per block) | tokens | by tokens µs | by hashes µs | tokens / hashes |",
        "|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(1)
    for n in (1_024, 16_384, 131_072):
        tokens = rng.integers(0, 150_000, n).tolist()
        slots = list(range(n))
        hashes = list(range(10**6 * n, 10**6 * n + n // BLOCK))
        last = n - BLOCK  # the decode step's block: the last full one
        step_mask = [0] * last + [1] * BLOCK
        assert cc.save(slots, token_ids=tokens, mask=[1] * n) == CcResult(n, n)
        assert cc.save(slots, hashes, [BLOCK] * len(hashes)).success == len(hashes)
        as_tensors = {"token_ids": torch.tensor(tokens), "mask": torch.tensor(step_mask)}
        slot_tensor = torch.tensor(slots)
        t = median_us(
            {
                "step_tokens": lambda: cc.save(slots, token_ids=tokens, mask=step_mask),
                "step_tensors": lambda: cc.save(slot_tensor, **as_tensors),
                "step_hashes": lambda: cc.save(slots[last:], hashes[-1:], [BLOCK]),
            },
            reps,
        )
        for name, form in (("step_tokens", "lists"), ("step_tensors", "tensors")):
            rows.append(
                f"| one-block save at the end of the sequence, {form} | {n} | {t[name]:.0f} | {t['step_hashes']:.0f} "
                f"| {t[name] / t['step_hashes']:.1f}x |"
            )
        t = median_us(
            {
                "load_tokens": lambda: cc.load(slots, token_ids=tokens, mask=[1] * n),
                "load_hashes": lambda: cc.load(slots, hashes, [BLOCK] * len(hashes)),
            },
            max(3, reps // 3),
        )
        rows.append(
            f"| load of the whole sequence | {n} | {t['load_tokens']:.0f} | {t['load_hashes']:.0f} "
            f"| {t['load_tokens'] / t['load_hashes']:.2f}x |"
        )
    Ems.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        f"## The token form's cost: key derivation and calls, by tokens vs by hashes ({time.strftime('%Y-%m-%d')}, cpu)",
        "",
        f"Command: `python perf/bench_tokens.py --reps {args.reps}`. Machine: {machine()}. Medians, interleaved.",
        "",
        *keys_table(args.reps),
        "",
        *calls_table(args.reps),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), "a", encoding="utf-8") as f:
        f.write("\n" + text)


if __name__ == "__main__":
    main()
