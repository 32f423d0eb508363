"""A second SGLang "server" in a process of its own: builds its own host pool and backend through SGLang's loader,
gets the pages it is told about from the pool, and prints what it got as JSON (per page: hit, and the SHA-256 of
the page's bytes in SGLang's flat form).

Usage: python second_server.py EXTRA_JSON LAYOUT KEY[,KEY...] [hybrid]

With `hybrid`, the server is a hybrid model's (SGLang's `HostPoolGroup`: the KV pool, a Mamba state pool with a
side state and an SWA pool of 2 layers, registered as SGLang's hybrid controller does): it also asks
`batch_exists_v2` for the Mamba state at the last page and the SWA window of the last 2 pages, gets them
(`batch_get_v2`) into Mamba slot 3 and SWA pages 6 and 7, and prints their digests.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
from sglang_testlib import (
    build,
    build_hybrid,
    fill,
    fill_mamba,
    host_pool,
    hybrid_group,
    mamba_host_pool,
    page_bytes,
    page_indices,
)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    extra, layout, keys = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    hybrid = sys.argv[4:] == ["hybrid"]
    host = host_pool(layout)
    fill(host, 99)  # (anything the get does not overwrite stays random)
    answer: dict = {}
    if hybrid:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        mamba, swa = mamba_host_pool("page_first_direct", side_state=True), host_pool("page_first", layers=2)
        fill_mamba(mamba, 98)
        fill(swa, 97)
        backend = build_hybrid(extra, hybrid_group(host, mamba=mamba, swa=swa))
        trailing = PoolHitPolicy.TRAILING_PAGES
        transfers = [
            PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=keys[-1:], hit_policy=trailing),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa, [6, 7]), keys=keys[-2:], hit_policy=trailing),
        ]
        hits = backend.batch_exists_v2(keys, transfers)
        got = backend.batch_get_v2(transfers)
        answer.update(
            exists_v2=[hits.kv_hit_pages, hits.restorable_prefix_pages],
            got_v2=[got[PoolName.MAMBA], got[PoolName.SWA]],
            mamba=digest(mamba.get_data_page(3)),
            swa=[digest(page_bytes(swa, p)) for p in (6, 7)],
        )
    else:
        backend = build(extra, host)
    pages = list(range(2, 2 + len(keys)))
    answer["exists"] = backend.batch_exists(keys)
    answer["got"] = backend.batch_get_v1(keys, page_indices(host, pages))
    answer["digests"] = [digest(page_bytes(host, p)) for p in pages]
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
