"""benchmarks/sync_watch.py: torch's synchronizing-call warnings kept by stack, thread and first time, every
occurrence counted; other warnings go where they went; Triton compiles timed through its runtime hooks; the
hooks and the filter are restored after."""
import threading
import time
import warnings

import pytest

from benchmarks.sync_watch import SYNC_MESSAGE, SyncWatch


def _synchronizing_call():
    # (what torch warns in sync debug mode "warn", raised here so the CPU runs the same path)
    warnings.warn(f"{SYNC_MESSAGE} here", UserWarning)


def test_each_warning_is_kept_with_its_stack_and_thread():
    hook, filters = warnings.showwarning, list(warnings.filters)
    with SyncWatch() as watch:
        for _ in range(3):
            _synchronizing_call()
        worker = threading.Thread(target=_synchronizing_call, name="loop")
        worker.start()
        worker.join()
        with warnings.catch_warnings(record=True) as others:
            warnings.simplefilter("always")
            warnings.warn("something else", UserWarning)
    rows = watch.summary()
    assert [(row["count"], row["thread"]) for row in rows] == [(3, "MainThread"), (1, "loop")]
    assert rows[0]["stack"][-2:] == [
        f"tests/executor/test_sync_watch.py:{_line('for _ in range(3)') + 1} test_each_warning_is_kept_with_its_stack_and_thread",
        f"tests/executor/test_sync_watch.py:{_line('warnings.warn(f')} _synchronizing_call"]
    assert rows[1]["stack"] == [f"tests/executor/test_sync_watch.py:{_line('warnings.warn(f')} _synchronizing_call"]
    assert 0 <= rows[0]["first_ms"] <= rows[1]["first_ms"]
    assert [str(w.message) for w in others] == ["something else"]
    assert warnings.showwarning is hook and warnings.filters == filters


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line(" not in line)


def test_triton_compiles_are_timed_through_its_runtime_hooks():
    """(Triton calls jit_cache_hook before a compile, jit_post_compile_hook after; here called as it calls them, since
    the CPU compiles no kernel.)"""
    knobs = pytest.importorskip("triton").knobs
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    with SyncWatch() as watch:
        assert not knobs.runtime.jit_cache_hook(key=None, repr="_rows_kernel[num_warps=4](x: *bf16, n: i32)", fn=None,
                                                compile={}, is_manual_warmup=False, already_compiled=False)
        time.sleep(0.02)
        knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=None, compile={}, is_manual_warmup=False,
                                            already_compiled=False)
    (entry,) = watch.compiles
    assert (entry["kernel"], entry["thread"]) == ("_rows_kernel", "MainThread") and entry["ms"] >= 15
    assert entry["specialization"].endswith("(x: *bf16, n: i32)")
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
