"""The end-to-end demo: an engine's view of EMS on the embedded pool, verified byte for byte.

A small but realistic model layout (GQA, fp16, several layers) and a stream of requests that share a system
prompt. Phase 1 (serving): each request loads the prefix the pool already holds, "computes" the rest (fills its
blocks with KV that is a pure function of the block hash) and saves the new blocks asynchronously, as an engine
does after a forward step. Phase 2 (verification): the engine's cache is wiped and every request is loaded into
freshly allocated, scattered blocks; every byte is compared with what was computed. The table reports blocks,
bytes, hit rate, save/load GB/s and a plain copy of the same bytes in the same run (the limit), and the copy
backend used.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
from tqdm import tqdm

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Prompt:
    tokens: np.ndarray  # int64 [n_tokens]
    hashes: list[int]  # chained prefix hash of each full block


def block_hashes(tokens: np.ndarray, block_size: int) -> list[int]:
    """vLLM-style chained prefix hashes over full blocks (deterministic across processes)."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = xxhash.xxh3_64_intdigest(parent + tokens[start : start + block_size].tobytes())
        hashes.append(digest)
        parent = digest.to_bytes(8, "little")
    return hashes


def make_prompts(count: int, prompt_blocks: int, shared_blocks: int, block_size: int, seed: int) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    system_prompt = rng.integers(0, 128_000, shared_blocks * block_size)
    requests = []
    for _ in range(count):
        own = rng.integers(0, 128_000, (prompt_blocks - shared_blocks) * block_size)
        tokens = np.concatenate([system_prompt, own])
        requests.append(Prompt(tokens, block_hashes(tokens, block_size)))
    return requests


class Engine:
    """A toy paged KV cache with a block allocator, laid out as vLLM lays it out."""

    def __init__(
        self,
        layers: int,
        blocks: int,
        block_size: int,
        heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.kvcache = [
            [torch.empty(blocks, block_size, heads, head_size, dtype=dtype, device=device) for _ in range(2)]
            for _ in range(layers)
        ]
        self.planes = [t for layer in self.kvcache for t in layer]
        self.num_blocks = blocks
        self.token_bytes = len(self.planes) * heads * head_size * torch.empty((), dtype=dtype).element_size()
        self.rng = np.random.default_rng(1)

    def allocate(self, n: int) -> np.ndarray:
        """n scattered block ids, as a long-running engine's free list hands them out."""
        return self.rng.choice(self.num_blocks, size=n, replace=False)

    def slots(self, block_ids: np.ndarray) -> list[int]:
        slots: list[int] = (block_ids[:, None] * self.block_size + np.arange(self.block_size)[None, :]).reshape(-1).tolist()
        return slots

    def expected(self, block_hash: int) -> torch.Tensor:
        """The KV of one block, `[planes, block_size, heads, head_size]`: a pure function of its hash."""
        gen = torch.Generator().manual_seed(block_hash & 0x7FFF_FFFF_FFFF_FFFF)
        shape = (len(self.planes), *self.planes[0].shape[1:])
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.planes[0].dtype)

    def compute(self, block_ids: np.ndarray, hashes: list[int]) -> None:
        """'Run the model': write each block's KV into the cache."""
        if len(hashes) == 0:
            return
        values = torch.stack([self.expected(h) for h in hashes], dim=1).to(self.planes[0].device)
        index = torch.from_numpy(block_ids).to(self.planes[0].device)
        for p, plane in enumerate(self.planes):
            plane[index] = values[p]

    def verify(self, block_ids: np.ndarray, hashes: list[int]) -> int:
        """How many blocks hold exactly the expected bytes."""
        values = torch.stack([self.expected(h) for h in hashes], dim=1)
        index = torch.from_numpy(block_ids).to(self.planes[0].device)
        good = torch.ones(len(hashes), dtype=torch.bool)
        for p, plane in enumerate(self.planes):
            got = plane[index].cpu().view(torch.uint8).reshape(len(hashes), -1)
            want = values[p].view(torch.uint8).reshape(len(hashes), -1)
            good &= (got == want).all(dim=1)
        return int(good.sum())

    def wipe(self) -> None:
        for plane in self.planes:
            plane.view(torch.uint8).fill_(0xA5)  # poison, not zeros: a skipped write shows


def plain_copy_gbps(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """GB/s of one contiguous copy of `nbytes`: bytes copied / time, the same measure as the save and load rows."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ems demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="model layers (default 16)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer (GQA; default 8)")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--cache-blocks", type=int, default=1024, help="blocks in the engine's paged cache")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt-blocks", type=int, default=48, help="full blocks per prompt")
    p.add_argument("--shared-blocks", type=int, default=32, help="blocks of the system prompt every request shares")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--device", default="cpu", help="cpu, cuda:0 or npu:0")
    p.add_argument(
        "--kernel-backend", default=None, help="auto, triton, host, torch or memcpy (default: EMS_KERNEL_BACKEND or auto)"
    )
    p.add_argument("--pool-capacity", default="2GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if args.shared_blocks > args.prompt_blocks:
        raise SystemExit("--shared-blocks must be <= --prompt-blocks")
    Ems.init(
        EmsConfig(
            cc_config=CcConfig(rank_id=0, device_id=device.index or 0, model_id="demo-gqa"),
            pool_capacity=args.pool_capacity,
            kernel_backend=args.kernel_backend,
        )
    )
    cc = Ems.get_cc()
    if cc is None:
        raise SystemExit("Ems.get_cc() returned None")
    engine = Engine(args.layers, args.cache_blocks, args.block_size, args.kv_heads, args.head_size, DTYPES[args.dtype], device)
    engine.wipe()
    cc.register_kvcache(engine.kvcache)
    requests = make_prompts(args.requests, args.prompt_blocks, args.shared_blocks, args.block_size, args.seed)
    if args.prompt_blocks > args.cache_blocks:
        raise SystemExit("--prompt-blocks must fit in --cache-blocks")
    option = CcKvOption(timeout=10_000)
    bs = args.block_size
    asked = hit = saved = 0
    save_s = 0.0
    progress = not args.no_progress and sys.stderr.isatty()

    # Phase 1: serving. Load the cached prefix, compute the rest, save the new blocks asynchronously.
    for req in tqdm(requests, desc="serving", disable=not progress):
        block_ids = engine.allocate(len(req.hashes))
        slots = engine.slots(block_ids)
        result = cc.load(slots, req.hashes, [bs] * len(req.hashes), option)
        asked += result.total
        hit += result.success
        new = slice(result.success, None)
        engine.compute(block_ids[new], req.hashes[new])
        if result.success < len(req.hashes):
            start = time.perf_counter()
            future = cc.async_save(slots[result.success * bs :], req.hashes[new], [bs] * len(req.hashes[new]), option)
            saved_result = cc.get_result(future)
            save_s += time.perf_counter() - start
            saved += saved_result.success
            if saved_result.success != saved_result.total:
                print(f"warning: saved only {saved_result.success}/{saved_result.total} blocks", file=sys.stderr)
    serve_hit, serve_asked = hit, asked

    # Phase 2: verification. Wipe the cache; load every request into fresh blocks and compare every byte.
    engine.wipe()
    verified = loaded = 0
    verify_load_s = 0.0
    for req in tqdm(requests, desc="verifying", disable=not progress):
        block_ids = engine.allocate(len(req.hashes))
        start = time.perf_counter()
        result = cc.load(engine.slots(block_ids), req.hashes, [bs] * len(req.hashes), option)
        verify_load_s += time.perf_counter() - start
        loaded += result.success
        verified += engine.verify(block_ids[: result.success], req.hashes[: result.success])
    total_blocks = sum(len(r.hashes) for r in requests)
    block_bytes = bs * engine.token_bytes
    copy_gbps = plain_copy_gbps(block_bytes * len(requests[0].hashes), device)
    save_gbps = saved * block_bytes / save_s / 1e9 if save_s else 0.0
    load_gbps = loaded * block_bytes / verify_load_s / 1e9 if verify_load_s else 0.0
    rows = [
        ("model layout", f"{args.layers} layers x [K,V] x {args.kv_heads} heads x {args.head_size} {args.dtype}, block {bs}"),
        ("device / copy backend", f"{device} / {cc.kernel_backend}"),
        ("requests / blocks asked", f"{len(requests)} / {serve_asked}"),
        ("prefix hit rate (serving)", f"{serve_hit}/{serve_asked} = {serve_hit / max(serve_asked, 1):.1%}"),
        ("blocks saved / bytes", f"{saved} / {saved * block_bytes / 2**20:.1f} MiB"),
        ("save GB/s (async_save + get_result)", f"{save_gbps:.2f}"),
        ("load GB/s (verification loads)", f"{load_gbps:.2f}"),
        ("plain copy GB/s, same bytes (limit)", f"{copy_gbps:.2f}"),
        ("save / load vs plain copy", f"{save_gbps / copy_gbps:.2f} / {load_gbps / copy_gbps:.2f}"),
        (
            "blocks loaded after the wipe",
            f"{loaded}/{total_blocks} (the rest was evicted: a miss, never wrong)"
            if loaded < total_blocks
            else f"{loaded}/{total_blocks}",
        ),
        ("loaded blocks verified byte-exact", f"{verified}/{loaded}"),
    ]
    width = max(len(k) for k, _ in rows)
    settings = Ems.settings()
    print(
        "EMS demo (embedded pool)"
        if settings is None or settings.embedded
        else f"EMS demo (pool backend {settings.pool_backend.value})"
    )
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    ok = verified == loaded > 0
    print("RESULT: OK, every loaded byte verified" if ok else "RESULT: FAILED verification")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except EmsException as exc:
        print(f"EMS error: {exc}", file=sys.stderr)
        return 1
    finally:
        Ems.shutdown()


if __name__ == "__main__":
    sys.exit(main())
