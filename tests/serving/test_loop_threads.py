"""A model's loop threads are joined at unload by one deadline, and the ones left are named with where
they are blocked (serving/loop_threads.py; the tensorrt_llm model's finalize)."""
import threading
import time

from serving.loop_threads import join_by_deadline, where_blocked


def blocked_in_a_call(gate: threading.Event) -> None:  # stands for a call into the backend that does not return
    gate.wait()


def test_two_blocked_threads_hold_the_join_one_deadline_not_two():
    stop, gate = threading.Event(), threading.Event()
    loops = [threading.Thread(target=stop.wait, name="stops_at_once", daemon=True)]
    loops += [threading.Thread(target=blocked_in_a_call, args=(gate,), name=f"blocked_{i}", daemon=True)
              for i in range(2)]
    for thread in loops:
        thread.start()
    stop.set()
    try:
        started = time.monotonic()
        left = join_by_deadline(loops, 1.0)
        took = time.monotonic() - started
        # a timeout per thread would take 2 s here (the unload's 5 s each took up to 20 s with four loops)
        assert 0.95 < took < 1.8, took
        assert [thread.name for thread in left] == ["blocked_0", "blocked_1"]
        described = where_blocked(left)
        assert described.startswith("blocked_0 (threading.py:"), described
        assert "in blocked_in_a_call)" in described and "; blocked_1 (" in described, described
    finally:
        gate.set()
    assert join_by_deadline(loops, 5.0) == []
    assert where_blocked(loops[:1]) == "stops_at_once (ended)"


def test_threads_that_stop_are_joined_without_waiting_for_the_deadline():
    stop = threading.Event()
    loops = [threading.Thread(target=stop.wait, args=(0.05 * i,), daemon=True) for i in range(4)]
    for thread in loops:
        thread.start()
    started = time.monotonic()
    assert join_by_deadline(loops, 30.0) == []
    assert time.monotonic() - started < 5.0
