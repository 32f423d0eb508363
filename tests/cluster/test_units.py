"""Placement by units (`ems.cluster.rendezvous` with `units`, keys of `ems.datapath.keys.chain_keys`): locality, even
spread, ~1/N movement on a join or a loss, replicas on distinct nodes, the unit read back from the stored key, and a
read after joins still reaching a copy saved before them (`read_order`)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.cluster.rendezvous import UNIT_WIDTH, node_seeds, owners, ranked_owners, read_order, route_hashes
from ems.datapath.keys import UNIT_BLOCKS, chain_keys, route_key_of, unit_of

NS = bytes(16)


def _nodes(n: int, tag: str = "") -> list[str]:
    return [f"10.{tag}{i // 250}.{i % 250}.1:7700" for i in range(n)]


def _chain(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(0, 2**63, size=n)]


def _chains(count: int, blocks: int) -> tuple[list[bytes], np.ndarray, list[bytes]]:
    """Route keys and units of `count` chains of `blocks` blocks, and their stored keys."""
    routes, units, stored = [], [], []
    for c in range(count):
        keys, r, u = chain_keys(NS, _chain(blocks, c), [])
        routes += r
        units.append(u)
        stored += keys
    return routes, np.concatenate(units), stored


def test_a_call_touches_a_bounded_number_of_nodes_whatever_the_pool():
    routes, units, _ = _chains(1, 1000)
    for n in (64, 1024, 4096):
        seeds = node_seeds(_nodes(n))
        ranks = ranked_owners(routes, seeds, 2, units)
        touched = np.unique(ranks).size
        units_spanned = np.unique(units).size  # 1000 blocks from position 0: 4 units
        assert units_spanned == -(-1000 // UNIT_BLOCKS)
        assert touched <= units_spanned * UNIT_WIDTH, (n, touched)
        # a call of several units asks no node for more than a quarter of its values (the bound)
        share = np.bincount(ranks.ravel(), minlength=n).max() / ranks.size
        assert share <= 0.25, share


def test_per_key_placement_is_the_rendezvous_ranking():
    """Keys with no unit (each its own) rank exactly as before units existed: a full sort of their scores."""
    keys = [f"k{i}".encode() for i in range(500)]
    seeds = node_seeds(_nodes(40))
    full = np.argsort(np.asarray(_scores(keys, seeds)), axis=1, kind="stable")[:, ::-1]
    assert (ranked_owners(keys, seeds, 40) == full).all()
    assert (ranked_owners(keys, seeds, 40, route_hashes(keys)) == full).all()
    assert (owners(keys, seeds) == full[:, 0]).all()


def _scores(keys: list[bytes], seeds: np.ndarray) -> np.ndarray:
    from ems.cluster.rendezvous import _scores as scores

    return scores(keys, seeds)


def test_values_spread_evenly_over_the_pool():
    routes, units, _ = _chains(200, 512)  # 400 units over 32 nodes: 50 group places a node
    n = 32
    counts = np.bincount(ranked_owners(routes, node_seeds(_nodes(n)), 2, units).ravel(), minlength=n)
    assert counts.max() <= 1.6 * counts.mean(), counts


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=48),
    k=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    start=st.integers(min_value=0, max_value=600),
)
def test_replicas_are_distinct_and_the_unit_is_in_the_stored_key(n, k, seed, start):
    chain = _chain(start + 300, seed)
    keys, routes, units = chain_keys(NS, chain[start:], chain[:start])
    assert [route_key_of(key) for key in keys] == routes
    assert [unit_of(key) for key in keys] == units.tolist()
    ranks = ranked_owners(routes, node_seeds(_nodes(n, "h")), k, units)
    assert ranks.shape == (len(keys), min(k, n))
    assert all(len(set(row)) == len(row) for row in ranks.tolist())
    # a unit's keys stay inside its group
    for u in np.unique(units).tolist():
        assert np.unique(ranks[units == u]).size <= max(k, min(n, UNIT_WIDTH))


def _moved(before: list[str], after: list[str], routes: list[bytes], units: np.ndarray, k: int) -> np.ndarray:
    a = np.array(before)[ranked_owners(routes, node_seeds(before), k, units)]
    b = np.array(after)[ranked_owners(routes, node_seeds(after), k, units)]
    return np.array([set(x) != set(y) for x, y in zip(a.tolist(), b.tolist())])


def test_a_join_or_a_loss_moves_about_one_in_n():
    """A join moves the entering node's share and the displaced member's (~1.75/N), a loss the lost node's and the
    new member's (~2/N): O(1/N), inside the units whose group changed only."""
    routes, units, _ = _chains(400, 256)  # 400 units
    n = 40
    nodes = _nodes(n)
    joined = _moved(nodes, nodes + ["new:1"], routes, units, 1)
    assert joined.mean() < 2.5 / (n + 1), joined.mean()
    after = np.array(nodes + ["new:1"])[owners(routes, node_seeds(nodes + ["new:1"]), units)]
    before = np.array(nodes)[owners(routes, node_seeds(nodes), units)]
    moved = before != after
    # a join moves values only inside the units whose group the new node entered (to it, or off the member it
    # displaced), never anywhere else
    entered = np.isin(units, units[after == "new:1"])
    assert not (moved & ~entered).any()
    lost = _moved(nodes, nodes[1:], routes, units, 1)
    was_on_lost = before == nodes[0]
    assert (was_on_lost <= lost).all() and lost.mean() < 2.5 / n, lost.mean()
    assert not (lost & ~np.isin(units, units[was_on_lost])).any()  # only in the units the lost node was a member of


@settings(max_examples=20, deadline=None)
@given(n=st.integers(min_value=2, max_value=30), joins=st.integers(min_value=1, max_value=3), k=st.integers(1, 3))
def test_a_read_after_joins_reaches_a_copy_saved_before(n, joins, k):
    routes, units, _ = _chains(20, 256)
    before = _nodes(n)
    after = before + [f"joined{j}:1" for j in range(joins)]
    saved = np.array(before)[ranked_owners(routes, node_seeds(before), k, units)]
    order, tries = read_order(routes, node_seeds(after), k, joins, units)
    asked = np.array(after)[order[:, :tries]]
    for held, tried in zip(saved.tolist(), asked.tolist()):
        assert set(held) & set(tried), (held, tried)
