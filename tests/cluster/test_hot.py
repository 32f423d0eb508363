"""Hot units (`ems.cluster.hot.HotUnits`) and their copy groups (`ranked_by_hash(..., copy=)`): a unit read far more
than its share gets bounded extra copies on other nodes, a cold unit none, and a unit that cools loses them."""

from __future__ import annotations

import numpy as np
import pytest

from ems.cluster.hot import MIN_CALLS, HotUnits, spread
from ems.cluster.rendezvous import UNIT_WIDTH, node_seeds, ranked_by_hash

NODES = 256


def _reads(hot: HotUnits, now: float, hot_unit: int, cold: range, rounds: int = 50) -> None:
    for r in range(rounds):
        units = np.concatenate([np.full(256, hot_unit), np.repeat(np.array(list(cold)), 4)[r::rounds]])
        hot.read(units.astype(np.uint64), now=now)


def test_a_hot_unit_gets_bounded_copies_a_cold_one_none_and_they_go_when_it_cools():
    hot = HotUnits(half_life_s=10.0, max_copies=16)
    _reads(hot, 0.0, 7, range(1000, 3000))
    copies = hot.copies(np.array([7, 1500], dtype=np.uint64), NODES)
    assert copies[0] == 16 and copies[1] == 1  # bounded by max_copies; a cold unit has only its own group
    # much later, only the cold units are read: the hot one's rate decays and its copies go
    _reads(hot, 1000.0, 1500, range(3000, 5000))
    assert hot.copies(np.array([7], dtype=np.uint64), NODES)[0] == 1


def test_tracking_is_bounded():
    hot = HotUnits(max_units=100)
    hot.read(np.arange(1000, dtype=np.uint64), now=0.0)
    assert len(hot._rates) <= 100


def test_copy_groups_are_other_nodes_and_the_copy_spread_stays_in_range():
    seeds = node_seeds([f"h{i}:1" for i in range(NODES)])
    hashes = np.arange(1, 257, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    units = np.full(hashes.size, 12345, dtype=np.uint64)
    groups = [set(np.unique(ranked_by_hash(hashes, seeds, 2, units, copy=np.full(hashes.size, c))).tolist()) for c in range(5)]
    assert all(len(g) <= UNIT_WIDTH for g in groups)
    assert all(groups[a].isdisjoint(groups[b]) for a in range(5) for b in range(a + 1, 5))
    assert groups[0] == set(np.unique(ranked_by_hash(hashes, seeds, 2, units)).tolist())  # copy 0: the unit's own
    picked = spread(np.array([1, 3, 5]), 7)
    assert picked.tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        ranked_by_hash(hashes, seeds, UNIT_WIDTH + 1, units, copy=np.ones(hashes.size, dtype=np.int64))


def test_read_copies_counts_and_answers_as_read_then_copies():
    a, b = HotUnits(half_life_s=10.0), HotUnits(half_life_s=10.0)
    for t in range(20):
        units = np.concatenate([np.full(64, 7), np.arange(1000 + 8 * t, 1008 + 8 * t)]).astype(np.uint64)
        got = a.read_copies(units, NODES, now=float(t))
        b.read(units, now=float(t))
        want = b.copies(units, NODES)
        assert (np.ones_like(want) if got is None else got).tolist() == want.tolist()
    assert got is not None and got[0] > 1 and got[-1] == 1  # the hot unit has copies, a cold one none
    cold = np.arange(5000, 5004, dtype=np.uint64)
    assert a.read_copies(cold, NODES, now=20.0) is None  # a call of cold units: no copies, nothing to do
    assert a.read_copies(np.full(4, 7, dtype=np.uint64), 2 * UNIT_WIDTH - 1, now=20.0) is None  # one group: none


def test_decay_survives_long_idle_gaps_and_tracking_stays_bounded():
    hot = HotUnits(half_life_s=1.0, max_units=64)
    hot.read(np.full(100, 7, dtype=np.uint64), now=0.0)
    for step in range(1, 40):  # gaps of many half-lives: the scores are renormalised, never overflow
        now = step * 50.0
        hot.read(np.arange(step * 100, step * 100 + 100, dtype=np.uint64), now=now)
        assert hot.tracked() <= 64
        assert np.isfinite(hot._total) and all(np.isfinite(r) for r in hot._rates.values())
    assert hot.copies(np.array([7], dtype=np.uint64), NODES)[0] == 1  # cooled long ago
    for _ in range(4):
        hot.read(np.full(250, 9, dtype=np.uint64), now=2000.0)
    assert hot.copies(np.array([9], dtype=np.uint64), NODES)[0] > 1  # a new hot unit after the gaps


def test_a_clients_first_reads_make_no_unit_hot():
    hot = HotUnits(min_reads=256)
    assert hot.read_copies(np.full(64, 7, dtype=np.uint64), NODES, now=0.0) is None  # all of its reads, but few
    for _ in range(3):
        hot.read(np.full(64, 7, dtype=np.uint64), now=0.0)
    assert hot.copies(np.array([7], dtype=np.uint64), NODES)[0] > 1  # 256 reads: hot
    hot.read(np.full(1, 8, dtype=np.uint64), now=60.0)  # two half-lives later: 64 reads' worth left, cold again
    assert hot.copies(np.array([7], dtype=np.uint64), NODES)[0] == 1


def test_a_long_prompt_read_once_is_not_hot():
    """A 512-block prompt's load reads its 2 units 256 times each in one call: not hot (one engine's one prompt);
    the same units read by MIN_CALLS calls are (a prompt every request shares)."""
    hot = HotUnits()
    prompt = np.repeat(np.array([11, 12], dtype=np.uint64), 256)
    assert hot.read_copies(prompt, NODES, now=0.0) is None
    for _ in range(int(MIN_CALLS) - 2):
        assert hot.read_copies(prompt, NODES, now=0.0) is None
    copies = hot.read_copies(prompt, NODES, now=0.0)
    assert copies is not None and copies.min() > 1
