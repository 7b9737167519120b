"""Session 26's third probe (--gc-off / --gc-freeze: the fourth): is the first Whisper run of a process slow because the GPU's clocks are still low?
(call 2: the process's first two encoder passes 1,224 and 870 ms, every later one 365-382 ms, with no allocations in
the slow second one.) The SM clock is sampled by nvidia-smi beside the run (the lane script); with --spin the GPU
first runs 3 s of bf16 matmuls, as a server under load would have it."""
import sys
import time

import torch

sys.path[:0] = ["benchmarks/engine", "."]
import encdec_bench as bench  # noqa: E402

if "--gc-off" in sys.argv:  # no cyclic collection at all: is the slow pass a full collection of the heap?
    import gc
    gc.disable()
if "--gc-freeze" in sys.argv:  # the imports' objects out of the collector's reach (engine_process freezes after load)
    import gc
    gc.collect()
    gc.freeze()
if "--spin" in sys.argv:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    started = time.perf_counter()
    while time.perf_counter() - started < 3.0:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    print(f"spun {time.perf_counter() - started:.1f} s", flush=True)
args = bench.parse_args(["--sections", "whisper", "--hf-whisper-batches", ""])
for attempt in range(2):
    run = bench.bench_whisper(args)
    print(f"{time.strftime('%H:%M:%S')} run {attempt}: {run['audio_s_per_s']:.0f} audio s/s, encoder "
          f"{run['encoder_seconds']:.3f} s in {run['seconds']:.3f} s", flush=True)
