"""Session 26's probe: Whisper large-v3's 64-clip offline run three times in one process (a fresh executor each
time), to tell a once-per-process cost in the run's encoder pass (0.86-0.92 s against 0.31-0.34 s for the same pass
warm, 2026-11-30 22:03-22:08 UTC) from a per-executor or per-run one."""
import sys

sys.path[:0] = ["benchmarks/engine", "."]
import encdec_bench as bench  # noqa: E402

args = bench.parse_args(["--sections", "whisper", "--hf-whisper-batches", ""])
for attempt in range(3):
    run = bench.bench_whisper(args)
    print(f"run {attempt}: {run['audio_s_per_s']:.0f} audio s/s, encoder {run['encoder_seconds']:.3f} s "
          f"in {run['seconds']:.3f} s", flush=True)
