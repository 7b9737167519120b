"""benchmarks/engine/step_profile.py graph_tables (issue 51's --page_order): the decode graph's block tables,
each sequence's pages adjacent or drawn from the whole pool. Pure Python."""
from __future__ import annotations

import pytest

from benchmarks.engine.step_profile import graph_tables


def test_in_order_tables_hand_each_sequence_adjacent_blocks():
    assert graph_tables(3, 2, 100, "in_order") == [[0, 1], [2, 3], [4, 5]]


def test_shuffled_tables_take_distinct_blocks_from_the_whole_pool():
    tables = graph_tables(91, 657, 63_252, "shuffled")
    ids = [b for row in tables for b in row]
    assert len(tables) == 91 and all(len(row) == 657 for row in tables)
    assert len(set(ids)) == 91 * 657 and min(ids) >= 0 and max(ids) < 63_252
    assert max(ids) > 63_000 and ids != sorted(ids)
    assert graph_tables(91, 657, 63_252, "shuffled") == tables  # seeded: every run profiles the same tables


def test_graph_tables_refuse_a_small_pool_and_unknown_orders():
    with pytest.raises(ValueError, match="need 12 blocks; the pool has 10"):
        graph_tables(3, 4, 10, "in_order")
    with pytest.raises(ValueError, match="in_order or shuffled"):
        graph_tables(1, 1, 10, "random")
