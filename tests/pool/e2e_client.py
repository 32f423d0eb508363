"""A client process for test_e2e_api: `python e2e_client.py JSON` runs save / load / exists (and the token form's
save and load: `tsave`, `tload`) through `import ems`
and prints one JSON line with the results. The KV cache is seeded, so every process builds the same bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: ems_testlib

from ems_testlib import expected_after_load, make_cache, poison, slots_of_blocks, snapshot

from ems import CcConfig, CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsException


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("mla"):
        cc_config = None
        cc_v1 = CcConfig_v1(
            rank_id=args["rank"],
            device_id=0,
            model_id="e2e-model",
            tp_world_size=2,
            rank_in_tp_group=args["rank"],
            kvcache_type="MLA",
        )
    else:
        cc_config, cc_v1 = CcConfig(rank_id=0, device_id=0, model_id="e2e-model"), None
    out: dict = {}
    try:
        Ems.init(
            EmsConfig(
                access_id=args.get("access_id"),
                access_key=args.get("access_key"),
                cc_config=cc_config,
                cc_config_v1=cc_v1,
                pool_nodes=args["nodes"],
                connect_timeout_ms=3000,
            )
        )
    except EmsException as error:
        print(json.dumps({"init_error": error.status_code().name, "message": error.message()}), flush=True)
        return
    cc = Ems.get_cc()
    torch.manual_seed(1234)
    bs, blocks = 4, 12
    cache = make_cache(layers=2, blocks=blocks, block_size=bs, heads=2, head_size=16, dtype=torch.float16)
    original = snapshot(cache)
    cc.register_kvcache(cache)
    block_ids = list(range(blocks))
    hashes = [1000 + i for i in block_ids]
    slots = slots_of_blocks(block_ids, bs)
    option = CcKvOption(timeout=3000)
    tokens = [(7919 * i) % 32000 for i in range(len(slots))]  # 48 tokens, the same in every process
    for step in args["steps"]:
        if step == "save":
            r = cc.save(slots, hashes, [bs] * blocks, option)
            out["save"] = [r.success, r.total]
        elif step == "exists":
            r = cc.exists(hashes, option)
            out["exists"] = [r.success, r.total]
        elif step == "load":
            poisoned = poison(cache)
            r = cc.load(slots, hashes, [bs] * blocks, option)
            out["load"] = [r.success, r.total]
            expected = expected_after_load(original, poisoned, slots_of_blocks(block_ids[: r.success], bs))
            out["load_exact"] = all(
                torch.equal(t.view(torch.uint8), e.view(torch.uint8)) for t, e in zip([t for p in cache for t in p], expected)
            )
        elif step == "tsave":  # the token form: every token, keys derived from the token ids
            r = cc.save(slots, option=option, token_ids=tokens, mask=[1] * len(tokens))
            out["tsave"] = [r.success, r.total]
        elif step == "tload":  # the token form, the first 6 tokens held already: tokens 6.. written, nothing else
            poisoned = poison(cache)
            r = cc.load(slots, option=option, token_ids=torch.tensor(tokens, dtype=torch.int32), mask=[0] * 6 + [1] * 42)
            out["tload"] = [r.success, r.total]
            expected = expected_after_load(original, poisoned, slots[6 : 6 + r.success])
            out["tload_exact"] = all(
                torch.equal(t.view(torch.uint8), e.view(torch.uint8)) for t, e in zip([t for p in cache for t in p], expected)
            )
        elif step == "health":
            out["health"] = Ems.check_health()
        elif step == "shm":  # whether each node's calls went through a live shared-memory region
            from ems.transport.ucx.client import UcxNode

            nodes = [n for n in cc._pool.nodes if isinstance(n, UcxNode)]
            out["shm"] = [n.shm is not None and n.shm._region is not None and not n.shm._region.allocator.poisoned for n in nodes]
    print(json.dumps(out), flush=True)
    Ems.shutdown()


if __name__ == "__main__":
    main()
