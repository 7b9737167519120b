# limit 585
# Session 31: issue 51's 20000/2000 row at three waves of its KV room on one H200, with keys-major decode attention as
# the FP8 pool's default (session 30's call 3 forced it with TRITONLLM_DECODE_KEYS_MAJOR=1, which then recorded no
# residency and captured the plateau's bucket with one split: 50 ms a decode step where two splits give 40.7; ec5393b).
# Expected ~1,330 tok/s (~0.74x TensorRT-LLM 1.0's H200 1,804). Extra environment (A/B switches) passes through.
OUT=${1:?usage: long_context.sh OUT}
export PYTHONPATH=$PWD COLUMNS=400
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
env | grep '^TRITONLLM_' > $OUT/env.txt
timeout 570 $P benchmarks/engine/throughput_bench.py --shapes 20000/2000 --dtype fp8 --max-seq-len max \
  --max-batch-size 1024 --max-num-tokens 8192 --kv-fraction 0.95 --waves 3 --stall-seconds 400 \
  --out $OUT/long.json --markdown $OUT/long.md > $OUT/long.log 2>&1; echo "throughput rc $?"
grep -v -i warn $OUT/long.log | cut -c1-400 | tail -40
