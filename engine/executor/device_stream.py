"""The CUDA stream the executor's loop thread queues its steps on.

Why: a vision-language engine's tower runs in the same process, beside the executor, on a stream of its
own (engine/vision/encode_queue.py). On streams of equal priority the GPU hands free SM slots to the
blocks of the kernel launched first, so each of a decode step's few hundred small kernels waits behind
the tower's large GEMM then in progress (H200, Qwen2.5-VL-7B shape: decode steps of 6.4 ms took 212
and 263 ms while batches of 32 images encoded). On a stream of higher priority a step's blocks take the
next free slots instead, and the tower (priority 0, the lowest) runs in what the step leaves.

Scope: CUDA, engines with a vision encoder (engine.build wrote ``extra["vision_encoder"]``), one rank
(prompt tables need tp_size == pp_size == 1). Elsewhere nothing shares the device in-process and the
loop keeps its thread's default stream. Everything the loop queues goes on this stream (the thread's
current stream): graph replays, copies, sampling, LoRA uploads' waits. Work queued at load on the
constructing thread's default stream is ordered before it (``use_stream``).

Invariant: while the loop serves on this stream, no other thread allocates on that device's default
stream. Why: tensors made at load live in the caching allocator's default-stream pools, and a block the
loop frees goes back to that pool as soon as the host drops it, with no record of this stream's kernels
still reading it; an allocation on the default stream (another thread) could then be handed that block
and overwrite it mid-step. Today nothing does (the tower has its own stream, tables are host memory);
code that must allocate there while serving needs ``Tensor.record_stream`` or an event wait on this stream.
"""
from __future__ import annotations

import os

import torch

# Lower numbers run first; 0 is the default and the lowest (torch.cuda.Stream.priority_range()).
EXECUTOR_PRIORITY = -1
TOWER_PRIORITY = 0
# "0": every executor loops on its thread's default stream, as before this stream existed (A/B runs, or a
# regression on some GPU: the tower and the steps then share SMs as equals again).
EXECUTOR_STREAM_ENV = "TRITONLLM_EXECUTOR_STREAM"


def wants_priority_stream(engine_config, device) -> bool:
    if engine_config is None or torch.device(device).type != "cuda" or os.environ.get(EXECUTOR_STREAM_ENV) == "0":
        return False
    build = engine_config.build
    return bool(engine_config.extra.get("vision_encoder")) and build.tp_size == 1 and build.pp_size == 1


def executor_stream(runner) -> torch.cuda.Stream | None:
    """A stream of EXECUTOR_PRIORITY on the runner's device for the loop, or None (the thread's default stream)."""
    if not wants_priority_stream(getattr(runner, "engine_config", None), runner.device):
        return None
    return torch.cuda.Stream(torch.device(runner.device), priority=EXECUTOR_PRIORITY)


def use_stream(stream: torch.cuda.Stream | None) -> None:
    """Make ``stream`` the calling thread's current stream (torch keeps it per thread), after what the
    device's default stream holds (load-time work: weights, KV pool, graph capture). The caching allocator
    keeps free blocks per stream: those the load left cached on the default stream are given back, so the
    loop's first steps allocate afresh instead of failing, flushing every cache and retrying."""
    if stream is None:
        return
    stream.wait_stream(torch.cuda.default_stream(stream.device))
    torch.cuda.set_stream(stream)
    torch.cuda.empty_cache()


def on_device(device):
    """The executor's construction on its own GPU: a context in which ``device`` (``cuda:1``, say) is the
    calling thread's current CUDA device, so what is launched by the current device rather than by a
    tensor's (Triton kernels, CUDA-graph capture, the current stream) goes there too; a no-op off CUDA."""
    import contextlib

    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or device.index is None:  # "cuda": the current one already
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def enter_device(device) -> None:
    """Make the runner's device the calling thread's current CUDA device (the loop thread's, for the same
    reason as ``on_device``); a no-op off CUDA. Two executors of one process on two GPUs need it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:  # ("cuda" alone: the thread's current device)
        torch.cuda.set_device(device)
