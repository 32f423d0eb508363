"""Rendezvous routing: even spread over nodes, and adding a node moves only ~1/N of the keys (all to it)."""

from __future__ import annotations

import numpy as np
import pytest

from ems.cluster.rendezvous import node_seeds, owners

KEYS = [f"block-{i}".encode() for i in range(30000)]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_even_distribution(n):
    nodes = [f"10.0.0.{i}:7000" for i in range(n)]
    counts = np.bincount(owners(KEYS, node_seeds(nodes)), minlength=n)
    mean = len(KEYS) / n
    assert np.all(np.abs(counts - mean) < 0.06 * mean), counts


def test_order_of_nodes_does_not_matter():
    nodes = [f"h{i}:1" for i in range(4)]
    a = np.array(nodes)[owners(KEYS, node_seeds(nodes))]
    b = np.array(nodes[::-1])[owners(KEYS, node_seeds(nodes[::-1]))]
    assert (a == b).all()


@pytest.mark.parametrize("n", [1, 3, 7])
def test_adding_a_node_moves_about_one_in_n_plus_one(n):
    before_nodes = [f"node{i}:9000" for i in range(n)]
    after_nodes = before_nodes + ["new:9000"]
    before = np.array(before_nodes)[owners(KEYS, node_seeds(before_nodes))]
    after = np.array(after_nodes)[owners(KEYS, node_seeds(after_nodes))]
    moved = before != after
    assert (after[moved] == "new:9000").all()  # keys only move to the new node
    share = moved.mean()
    assert abs(share - 1 / (n + 1)) < 0.02, share


def test_removing_a_node_moves_only_its_keys():
    nodes = [f"node{i}:9000" for i in range(5)]
    before = np.array(nodes)[owners(KEYS, node_seeds(nodes))]
    rest = nodes[:2] + nodes[3:]
    after = np.array(rest)[owners(KEYS, node_seeds(rest))]
    moved = before != after
    assert (before[moved] == nodes[2]).all() and moved.sum() == (before == nodes[2]).sum()
