"""benchmarks/engine/step_profile.py (issue 51): graph_tables (--page_order: the decode graph's block tables,
each sequence's pages adjacent or drawn from the whole pool) and profile_without_pdl (--pdl_ab). No GPU."""
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


def test_profile_without_pdl_turns_it_off_for_the_call_and_restores_it(monkeypatch):
    from benchmarks.engine.step_profile import profile_without_pdl
    from kernels import _triton

    monkeypatch.setattr(_triton, "PDL_ALLOWED", True)
    monkeypatch.setattr(_triton, "_pdl_enabled", True)
    assert profile_without_pdl(lambda: _triton._pdl_enabled) is False
    assert _triton._pdl_enabled is True

    def failing():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        profile_without_pdl(failing)
    assert _triton._pdl_enabled is True  # restored on the way out of an error too
