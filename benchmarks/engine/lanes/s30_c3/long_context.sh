# limit 575
# Session 30 call 3: issue 51's 20000/2000 row at steady state on one H200 (three waves of its KV room), with
# keys-major decode attention forced on (TRITONLLM_DECODE_KEYS_MAJOR=1: attnkm29's kernel, 5-8% faster at these
# shapes in call 1; attnkm30 is making it the FP8 pool's default where its tiling serves). The x4 call of 2026-11-28 ran 69 requests (capped:
# batch 34 of a possible 91, 0.52x); this fills the row, against TensorRT-LLM 1.0's H200 column (1,804 tok/s).
# No --time-budget: its request cap uses the H100 prior (755 tok/s) and would cut the run to ~1.8 waves. Estimated
# ~1.3-1.4 s of GPU a request at the plateau (0.45-0.6 s prefill, ~0.8 s decode): ~380 s for 273 plus the load.
OUT=${1:?usage: long_context.sh OUT}
export PYTHONPATH=$PWD COLUMNS=400
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
TRITONLLM_DECODE_KEYS_MAJOR=1 timeout 560 $P benchmarks/engine/throughput_bench.py --shapes 20000/2000 --dtype fp8 --max-seq-len max \
  --max-batch-size 1024 --max-num-tokens 8192 --kv-fraction 0.95 --waves 3 --stall-seconds 400 \
  --out $OUT/long.json --markdown $OUT/long.md > $OUT/long.log 2>&1; echo "throughput rc $?"
grep -v -i warn $OUT/long.log | cut -c1-400 | tail -40
