"""Session 26's second probe: where the first timed Whisper run's extra ~0.5 s in its encoder pass goes (call 1: a
process's first run 1,217 audio s/s, encoder 0.863 s; a fresh executor's run after it in the same process 1,762-1,772,
encoder 0.37 s). Each encode_into call is synchronized and timed on the host, with the caching allocator's device
allocations (cudaMalloc calls, segments) it made; the same for the whole executor start and warm-up."""
import sys
import time

import torch

sys.path[:0] = ["benchmarks/engine", "."]
import encdec_bench as bench  # noqa: E402
from engine.encoder_decoder.runner import EncDecRunner  # noqa: E402

plain_encode_into = EncDecRunner.encode_into


def stats() -> tuple[int, int]:
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", -1), s.get("segment.all.allocated", -1)


def traced_encode_into(self, inputs, block_tables):
    torch.cuda.synchronize()
    allocs, segments = stats()
    started = time.perf_counter()
    plain_encode_into(self, inputs, block_tables)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    after_allocs, after_segments = stats()
    print(f"  encode_into: {len(inputs)} inputs of {len(inputs[0])} frames, {seconds * 1e3:.1f} ms, cudaMalloc "
          f"{after_allocs - allocs}, segments {after_segments - segments}, stream {torch.cuda.current_stream().stream_id}",
          flush=True)


EncDecRunner.encode_into = traced_encode_into
args = bench.parse_args(["--sections", "whisper", "--hf-whisper-batches", ""])
for attempt in range(2):
    print(f"run {attempt}: cudaMalloc so far {stats()[0]}", flush=True)
    run = bench.bench_whisper(args)
    print(f"run {attempt}: {run['audio_s_per_s']:.0f} audio s/s, encoder {run['encoder_seconds']:.3f} s "
          f"in {run['seconds']:.3f} s", flush=True)
