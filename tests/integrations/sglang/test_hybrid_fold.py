"""`hybrid.fold_hits` without SGLang: SGLang's `batch_exists_v2` fold of the KV prefix and each side pool's probe,
checked against a brute-force reading of SGLang's hit policies over every page's presence (`HiCacheFile`'s own
per-key fold), where the probe (a count from the first or from the last key) can see the answer."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from ems.integrations.sglang.hybrid import fold_hits


def transfer(name: str, policy: str = "all_pages", window: int = 0, group: int = 0) -> SimpleNamespace:
    return SimpleNamespace(name=name, hit_policy=policy, keys=[None] * window or None, group_pages=group)


def prober(present: dict[str, list[bool]]):
    """A probe over per-page presence: the count of present pages from the first (or from the last)."""

    def probe(t: SimpleNamespace, reverse: bool) -> int:
        pages = present.get(t.name, [])
        order = pages[::-1] if reverse else pages
        return next((i for i, p in enumerate(order) if not p), len(order))

    return probe


def brute(kv: int, transfers: list[SimpleNamespace], present: dict[str, list[bool]]) -> list[int]:
    """Restorable prefix lengths by SGLang's definitions (all_pages and trailing_pages, per page)."""
    ok = set(range(1, kv + 1))
    for t in transfers:
        pages = present.get(t.name, [False] * kv)
        if t.hit_policy == "all_pages":
            ok &= {p for p in range(1, kv + 1) if all(pages[:p])}
        else:
            n = max(1, len(t.keys or ()))
            ok &= {p for p in range(1, kv + 1) if all(pages[max(0, p - n) : p])}
    return sorted(ok)


def test_all_pages_and_trailing_windows():
    kv = 6
    present = {"swa": [True, True, True, True, False, False], "mamba": [False, False, True, False, True, True]}
    hits = fold_hits(kv, [transfer("swa")], prober(present))
    assert (hits.final_pages, hits.restorable, hits.pool_pages) == (4, [1, 2, 3, 4], {"swa": 4})
    hits = fold_hits(kv, [transfer("mamba", "trailing_pages", 1)], prober(present))
    assert (hits.final_pages, hits.restorable, hits.pool_pages) == (6, [5, 6], {"mamba": 6})
    hits = fold_hits(kv, [transfer("mamba", "trailing_pages", 2)], prober(present))
    assert (hits.final_pages, hits.restorable) == (6, [6])
    hits = fold_hits(kv, [transfer("swa"), transfer("mamba", "trailing_pages", 1)], prober(present))
    assert (hits.final_pages, hits.restorable, hits.pool_pages) == (0, [], {"swa": 4, "mamba": 6})
    # a pool that answers 0, an unknown policy: nothing restorable; "kv" is the KV pool itself
    assert fold_hits(kv, [transfer("indexer")], prober(present)).final_pages == 0
    assert fold_hits(kv, [transfer("swa", "other")], prober(present)).final_pages == 0
    assert fold_hits(kv, [transfer("kv")], prober({})).restorable == list(range(1, 7))
    assert fold_hits(0, [transfer("swa")], prober(present)) == fold_hits(0, [], prober({}))


def test_block_groups_report_without_gating():
    present = {"c4": [True] * 5 + [False]}
    hits = fold_hits(6, [transfer("c4", "block_groups", group=2)], prober(present))
    assert (hits.final_pages, hits.pool_pages) == (6, {"c4": 4})


def test_never_claims_what_is_not_there():
    """Over every presence pattern of 5 pages and windows 1..3: every restorable length the fold reports is one by
    SGLang's definition (a miss may be reported where a window ends before the run of present pages that ends the KV
    prefix, never a false hit), and where the longest restorable window lies in that run the answer is exact."""
    kv = 5
    for bits in itertools.product([False, True], repeat=kv):
        pages = list(bits)
        for window in (1, 2, 3):
            transfers = [transfer("mamba", "trailing_pages", window)]
            truth = brute(kv, transfers, {"mamba": pages})
            got = fold_hits(kv, transfers, prober({"mamba": pages})).restorable
            assert set(got) <= set(truth), (pages, window)
            run = prober({"mamba": pages})(transfers[0], True)
            if truth and (run == kv or max(truth) - window >= kv - run):
                assert max(got) == max(truth), (pages, window)
        transfers = [transfer("swa")]
        assert fold_hits(kv, transfers, prober({"swa": pages})).restorable == brute(kv, transfers, {"swa": pages})
