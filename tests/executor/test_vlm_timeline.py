"""benchmarks/engine/vlm_timeline.py (vlm_bench's host and device times of the executor's first steps and of the
encode queue's forwards, on one clock) on CPU, with stand-ins for the executor and the queue."""
import types

import torch

from benchmarks.engine.vlm_timeline import LoopTimeline


def test_loop_timeline_times_the_loops_launches_and_the_towers_forwards_then_unwraps():
    """benchmarks/engine/vlm_timeline.py on CPU (host times only): each executor launch and token wait, each tower
    forward and when its tables were completed, on the run's clock; the instances are as before after it."""
    class Loop:
        runner = types.SimpleNamespace(device=torch.device("cpu"))

        def _launch(self, plan, started):
            return "step"

        def _finish_in_flight(self, launched=None):
            return True

    class Queue:
        stream = None

        def _launch(self, items, slot):
            return types.SimpleNamespace(items=items)

        def _complete(self, launched):
            launched.completed = True

    ex, queue = Loop(), Queue()
    plan = types.SimpleNamespace(num_context_tokens=386, scheduled=[1, 2, 3], num_context_sequences=1)
    with LoopTimeline(ex, queue) as timeline:
        assert ex._launch(plan, 0.0) == "step" and ex._finish_in_flight(None)
        launched = queue._launch([(None, [[1, 32, 32]] * 2, None)], 0)
        queue._complete(launched)
    assert launched.completed and not {"_launch", "_finish_in_flight", "_complete"} & (set(vars(ex)) | set(vars(queue)))
    summary = timeline.summary()
    (began, ended, start, end, tokens, rows), = summary["steps"]
    assert 0 <= began <= ended and start is end is None and (tokens, rows) == (386, 2)
    assert len(summary["token_waits"]) == 1
    (began, ended, start, end, images, completed), = summary["forwards"]
    assert images == 2 and began <= ended <= completed
