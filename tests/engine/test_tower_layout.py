"""engine/vision/tower_layout.py: a batch's layout assembled from kept per-grid pieces (runs of equal
grids tiled on the device) equals the one made afresh for the whole batch (the window-major order and
its inverse, the windows' and frames' runs, the rotary table in the forward's order)."""
from __future__ import annotations

import torch

from engine.vision.tower_layout import Segments, axial_angles, grid_positions, tower_layout, window_order

MERGE, HEAD_DIM, THETA = 2, 16, 10000.0
# Two grids repeated (runs of 2 and 1), edge windows cut short, a video grid of 2 frames
GRIDS = [[1, 8, 6], [1, 8, 6], [1, 4, 8], [2, 6, 6], [1, 8, 6]]


def afresh(grids: list[list[int]], window: int | None):
    """(order, lengths of windows (patches), frame lengths, table) made for the whole batch at once."""
    unit = MERGE * MERGE
    positions = torch.cat([grid_positions(t, h, w, MERGE) for t, h, w in grids])
    order, lengths = None, None
    if window is not None:
        order, units = window_order(grids, MERGE, window)
        positions = positions.view(-1, unit, 2)[order].view(-1, 2)
        lengths = [n * unit for n in units]
    angles = axial_angles(positions, HEAD_DIM, THETA)
    return order, lengths, [h * w for t, h, w in grids for _ in range(t)], torch.cat([angles.cos(), angles.sin()], -1)


def runs_of(segments: Segments, patches: int) -> list[list[int]]:
    """Each run's patch indices, sorted, whatever the grouping."""
    runs = []
    for n, rows in segments.groups:
        if rows is None:
            return [list(range(s, s + n)) for s in range(0, patches, n)]
        runs += rows.tolist()
    return sorted(runs)


def expected_runs(lengths: list[int]) -> list[list[int]]:
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    return sorted(list(range(s, s + n)) for s, n in zip(starts, lengths))


def test_layout_from_kept_pieces_equals_the_batch_made_afresh():
    patches = sum(t * h * w for t, h, w in GRIDS)
    for window in (2, None):
        order, lengths, frames, table = afresh(GRIDS, window)
        for keep in (True, True, False):  # made, then from the kept pieces, then afresh
            layout = tower_layout(GRIDS, MERGE, HEAD_DIM, THETA, "cpu", window=window, keep=keep)
            assert torch.equal(layout.rotary.table, table)
            assert runs_of(layout.frames, patches) == expected_runs(frames)
            if window is None:
                assert layout.order is None and layout.windows is None
                continue
            assert torch.equal(layout.order, order)
            assert torch.equal(layout.order[layout.inverse], torch.arange(order.numel()))
            assert layout.windows.lengths == lengths
            assert runs_of(layout.windows, patches) == expected_runs(lengths)
    one = tower_layout([[1, 8, 8]] * 3, MERGE, HEAD_DIM, THETA, "cpu", window=2)
    assert [rows for _, rows in one.windows.groups] == [None] and [rows for _, rows in one.frames.groups] == [None]


def test_pieces_kept_are_bounded(monkeypatch):
    """Past PIECES_KEPT (or PIECE_BYTES_KEPT) the least recently used pieces go; a batch whose pieces were
    dropped while it was assembled still gets its layout."""
    from engine.vision import tower_layout as module

    monkeypatch.setattr(module, "_pieces", module.OrderedDict())
    monkeypatch.setattr(module, "PIECES_KEPT", 1)
    order, lengths, frames, table = afresh(GRIDS, 2)
    layout = tower_layout(GRIDS, MERGE, HEAD_DIM, THETA, "cpu", window=2)
    assert torch.equal(layout.order, order) and torch.equal(layout.rotary.table, table)
    assert list(module._pieces) and len(module._pieces) == 1
    monkeypatch.setattr(module, "PIECES_KEPT", 64)
    monkeypatch.setattr(module, "PIECE_BYTES_KEPT", 1)
    tower_layout(GRIDS, MERGE, HEAD_DIM, THETA, "cpu", window=2)
    assert len(module._pieces) == 1  # the newest always stays


def test_pieces_read_holds_what_a_forward_read_past_their_eviction(monkeypatch):
    """pieces_read (what a tower graph holds for its life, engine/vision/tower_graphs.py): every piece the
    thread's layouts read inside the block, kept ones and evicted ones alike, none read outside it."""
    from engine.vision import tower_layout as module

    monkeypatch.setattr(module, "_pieces", module.OrderedDict())
    monkeypatch.setattr(module, "PIECES_KEPT", 1)
    tower_layout([[1, 4, 8]], MERGE, HEAD_DIM, THETA, "cpu", window=2)  # outside: not recorded
    with module.pieces_read() as read:
        tower_layout([[1, 8, 6], [1, 8, 6], [1, 4, 8]], MERGE, HEAD_DIM, THETA, "cpu", window=2)
    assert [p.patches for p in read] == [48, 32]  # one per run of equal grids
    assert list(module._pieces.values()) == [read[1]]  # the first was evicted from the LRU, still held here
    expected = module.grid_piece((1, 8, 6), MERGE, HEAD_DIM, THETA, 2, torch.device("cpu"), keep=False)
    assert torch.equal(read[0].table, expected.table) and torch.equal(read[0].order, expected.order)
    tower_layout([[1, 4, 4]], MERGE, HEAD_DIM, THETA, "cpu", window=2)
    assert len(read) == 2  # the block is over


def test_attention_backend_settings(monkeypatch):
    """TRITONLLM_TOWER_SDPA for every run, TRITONLLM_TOWER_WINDOW_SDPA for windows alone; a bad name is
    refused naming the variable and the allowed ones."""
    import pytest

    from engine.vision.qwen2_vl import SDPA_ENV, WINDOW_SDPA_ENV, sdpa_backend

    monkeypatch.delenv(SDPA_ENV, raising=False)
    monkeypatch.delenv(WINDOW_SDPA_ENV, raising=False)
    assert sdpa_backend() == sdpa_backend(windows=True) == "planless"  # (no cuDNN: no plan built per new shape)
    monkeypatch.setenv(SDPA_ENV, "flash")
    assert sdpa_backend() == sdpa_backend(windows=True) == "flash"
    monkeypatch.setenv(WINDOW_SDPA_ENV, "math")
    assert (sdpa_backend(), sdpa_backend(windows=True)) == ("flash", "math")
    assert tower_layout([[1, 8, 8]], MERGE, HEAD_DIM, THETA, "cpu", window=2).windows.windows
    monkeypatch.setenv(WINDOW_SDPA_ENV, "fast")
    with pytest.raises(ValueError, match="TRITONLLM_TOWER_WINDOW_SDPA='fast'.*allowed: planless, auto, cudnn"):
        sdpa_backend(windows=True)
