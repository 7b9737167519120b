"""engine/executor/device_stream.py: which executors queue their steps on a stream of higher priority than
the vision tower's (the tower then runs in what a step leaves instead of each of the step's kernels
waiting behind the tower's). The streams themselves are checked on a GPU (test_qwen2_vl's CUDA tests)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.executor.device_stream import (EXECUTOR_PRIORITY, EXECUTOR_STREAM_ENV, TOWER_PRIORITY, executor_stream,
                                          wants_priority_stream)


def engine(vision: bool = True, tp: int = 1, pp: int = 1):
    return SimpleNamespace(extra={"vision_encoder": "vision_encoder"} if vision else {},
                           build=SimpleNamespace(tp_size=tp, pp_size=pp))


@pytest.mark.parametrize("config, device, wanted", [
    (engine(), "cuda", True), (engine(), "cuda:1", True),
    (engine(), "cpu", False),  # no streams
    (engine(vision=False), "cuda", False),  # nothing else in the process shares the device
    (engine(tp=2), "cuda", False), (engine(pp=2), "cuda", False),  # (prompt tables need one rank)
    (None, "cuda", False),
])
def test_vision_language_engines_on_one_cuda_device_get_the_priority_stream(config, device, wanted):
    assert wants_priority_stream(config, device) is wanted
    assert EXECUTOR_PRIORITY <= TOWER_PRIORITY == 0  # lower runs first; 0 is CUDA's default and lowest (equal: one constant)


def test_other_executors_keep_their_threads_default_stream(monkeypatch):
    assert executor_stream(SimpleNamespace(engine_config=engine(), device="cpu")) is None
    monkeypatch.setenv(EXECUTOR_STREAM_ENV, "0")  # the off switch: the old path (the thread's default stream)
    assert not wants_priority_stream(engine(), "cuda")


def test_executors_of_named_gpus_build_and_loop_there_and_others_change_nothing():
    import contextlib

    import torch

    from engine.executor.device_stream import enter_device, on_device

    for device in (None, "cpu", "cuda"):  # "cuda" alone: the current device already
        assert isinstance(on_device(device), contextlib.nullcontext)
    enter_device("cpu")
    enter_device("cuda")  # no index: nothing to set (and no CUDA needed)
    if torch.cuda.device_count() >= 2:  # (the two-GPU case itself: test_disaggregated with TRITONLLM_DISAGG_DEVICES)
        with on_device("cuda:1"):
            assert torch.cuda.current_device() == 1
