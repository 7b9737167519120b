"""engine/executor/gc_freeze.py (the engine process freezes what its load made, so a full collection while
serving does not stall the loop for a few hundred ms) and benchmarks/engine/gc_pauses.py (the collections a
timed run saw). CPU, no full collection run here (one costs ~0.3 s in a test process)."""
import gc

import pytest

from benchmarks.engine.gc_pauses import GcPauses
from engine.executor import gc_freeze


@pytest.fixture
def collects(monkeypatch):
    """gc.collect counted instead of run; whatever a test froze is given back to the collector after it."""
    calls = []
    monkeypatch.setattr(gc_freeze.gc, "collect", lambda *args: calls.append(args) or 0)
    yield calls
    gc.unfreeze()


@pytest.mark.parametrize("setting, device, freezes", [
    (None, "cuda:0", True), (None, "cpu", False), ("1", "cpu", True), ("0", "cuda", False)])
def test_freeze_after_load_collects_then_freezes_on_cuda_only_unless_told(monkeypatch, collects, setting, device,
                                                                           freezes):
    if setting is None:
        monkeypatch.delenv(gc_freeze.GC_FREEZE_ENV, raising=False)
    else:
        monkeypatch.setenv(gc_freeze.GC_FREEZE_ENV, setting)
    report = gc_freeze.freeze_after_load(device)
    if not freezes:
        assert report is None and collects == [] and gc.get_freeze_count() == 0
        return
    assert collects == [()]  # a full collection first: load-time garbage is not frozen for the process's life
    assert report["frozen"] > 0 and gc.get_freeze_count() > 0 and report["collect_s"] >= 0
    assert len(report["counts_before"]) == 3 and report["full_collections_before"] >= 0
    gc_freeze.unfreeze()
    assert gc.get_freeze_count() == 0


def test_gc_pauses_lists_each_collection_and_names_full_ones():
    with GcPauses() as pauses:
        gc.collect(0)
        pauses("start", {"generation": 2})  # a full collection as the callback sees one (none run here)
        pauses("stop", {"generation": 2, "collected": 7})
    assert pauses not in gc.callbacks
    summary = pauses.summary()
    assert summary["collections"] == len(pauses.collections) >= 2
    assert summary["by_generation"][2] == 1 and summary["by_generation"][0] >= 1
    at_ms, ms, generation = summary["longest"][-1]
    assert generation == 2 and 0 <= ms < 1000 and at_ms >= 0
    assert all(c[2] == 2 or c[1] >= 5 for c in summary["longest"])  # the short young ones are only counted


def test_leaving_the_process_groups_unfreezes_once_before_its_collections(monkeypatch):
    """A TP / PP rank in a process frozen after load leaves its groups (_destroy_groups), then drops them and
    collects (_join_group_threads) so that a group in a reference cycle is destroyed now, not at finalization:
    that needs the frozen objects back first, once."""
    import types

    from engine.tensor_parallel import distributed

    calls = []
    monkeypatch.setattr(distributed, "gc", types.SimpleNamespace(
        get_freeze_count=lambda: 5 - 5 * calls.count("unfreeze"), unfreeze=lambda: calls.append("unfreeze"),
        collect=lambda: calls.append("collect")))
    ctx = types.SimpleNamespace(tp_group=object(), control=None)
    assert distributed._destroy_groups(None)  # (no process group in this process: nothing to leave)
    distributed._join_group_threads(ctx, None, None)
    assert ctx.tp_group is None and calls == ["unfreeze", "collect", "collect"]


@pytest.mark.parametrize("frozen", [0, 5])
def test_leaving_the_process_groups_collects_the_released_graphs_of_a_frozen_process(monkeypatch, frozen):
    """The runner's CUDA graphs hold captured NCCL work and must be gone before the groups are left: in a frozen
    process (engine/executor/gc_freeze.py) one inside a reference cycle is only collected once unfrozen."""
    import types

    from engine.tensor_parallel import distributed

    calls = []
    monkeypatch.setattr(distributed, "gc", types.SimpleNamespace(
        get_freeze_count=lambda: frozen, unfreeze=lambda: calls.append("unfreeze"),
        collect=lambda: calls.append("collect")))
    runner = types.SimpleNamespace(release_cuda_graphs=lambda: calls.append("release"))
    assert distributed._destroy_groups(runner)  # (no process group in this process: nothing to leave)
    assert calls == (["release", "unfreeze", "collect"] if frozen else ["release"])
