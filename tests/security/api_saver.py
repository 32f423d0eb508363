"""A tenant's engine for the security tests: `python api_saver.py JSON` saves one KV block of about 1 MiB through
the public API (`import ems`) `times` times under the same hash (new bytes each time, so the node overwrites it),
then loads it back, and prints one JSON line: the value length on the wire, the block's bytes as hex digests of
each save, and whether the load was byte-exact."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: ems_testlib

from ems_testlib import fill_random, make_cache, slots_of_blocks, tensors

from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.store.value_format import HEADER_SIZE

LAYERS, BLOCK_SIZE, HEADS, HEAD_SIZE = 16, 16, 8, 128  # one block: 16 layers x K,V x 16 x 8 x 128 x fp16 = 1 MiB


def main() -> None:
    args = json.loads(sys.argv[1])
    Ems.init(
        EmsConfig(
            access_id=args["access_id"],
            access_key=args["access_key"],
            cc_config=CcConfig(rank_id=0, device_id=0, model_id="sec-model"),
            pool_nodes=args["nodes"],
            connect_timeout_ms=3000,
        )
    )
    cc = Ems.get_cc()
    cache = make_cache(layers=LAYERS, blocks=2, block_size=BLOCK_SIZE, heads=HEADS, head_size=HEAD_SIZE)
    cc.register_kvcache(cache)
    slots = slots_of_blocks([0], BLOCK_SIZE)
    option = CcKvOption(timeout=5000)
    out: dict = {"saves": [], "digests": []}
    gen = torch.Generator().manual_seed(args.get("seed", 7))
    for _ in range(args["times"]):
        for t in tensors(cache):
            fill_random(t[0], gen)
        out["saves"].append(cc.save(slots, [4242], [BLOCK_SIZE], option).success)
        out["digests"].append(
            hashlib.sha256(b"".join(t[0].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors(cache))).hexdigest()
        )
    block_bytes = sum(t[0].numel() * t.element_size() for t in tensors(cache))
    out["value_len"] = HEADER_SIZE + block_bytes
    expected = [t[0].clone() for t in tensors(cache)]
    for t in tensors(cache):
        t[0].zero_()
    out["load"] = cc.load(slots, [4242], [BLOCK_SIZE], option).success
    out["load_exact"] = all(torch.equal(t[0].view(torch.uint8), e.view(torch.uint8)) for t, e in zip(tensors(cache), expected))
    print(json.dumps(out), flush=True)
    Ems.shutdown()


if __name__ == "__main__":
    main()
