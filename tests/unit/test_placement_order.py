"""Ranks in node order, whatever order Ray numbered the bundles in (tests/e2e/test_placement.py
places real bundles on a simulated multi-node cluster)."""

import pytest

from agentgym_mega.cluster import PlacementError, check_within_nodes, node_order

ADDRESSES = {"n-b": "10.0.0.10", "n-a": "10.0.0.9", "n-c": "10.0.1.1"}


def test_bundles_are_ordered_by_node_address_then_index():
    # Ray interleaved the bundles over two nodes; 10.0.0.9 sorts before 10.0.0.10 (numerically)
    nodes = ["n-b", "n-a", "n-b", "n-a", "n-b", "n-a", "n-b", "n-a"]
    order = node_order(nodes, ADDRESSES)
    assert order == [1, 3, 5, 7, 0, 2, 4, 6]
    check_within_nodes(order, nodes, 4, "trainer TP group")  # two TP groups of 4, one per node
    with pytest.raises(PlacementError, match="trainer TP group 0"):
        check_within_nodes(list(range(8)), nodes, 4, "trainer TP group")  # Ray's own numbering


def test_nodes_with_one_address_are_told_apart_by_id():
    # several raylets of one machine (ray.cluster_utils.Cluster) share an address
    nodes = ["n-2", "n-1", "n-2", "n-1"]
    order = node_order(nodes, {"n-1": "127.0.0.1", "n-2": "127.0.0.1"})
    assert [nodes[b] for b in order] == ["n-1", "n-1", "n-2", "n-2"]


def test_a_group_that_must_straddle_nodes_is_named_with_the_spread():
    nodes = ["n-a"] * 3 + ["n-b"] * 5  # Ray put 3 and 5: a TP group of 4 cannot fit
    with pytest.raises(PlacementError, match=r"trainer TP group 0 .* would span 2 nodes: .*n-a: 3, n-b: 5"):
        check_within_nodes(node_order(nodes, ADDRESSES), nodes, 4, "trainer TP group")
