# limit 585
# Session 31: issue 51's 128/4096 row at three waves of its KV room on one H200 (2026-11-28's x4 run capped it at 500
# requests, ~1 wave: 15,882 tok/s, 0.88x TensorRT-LLM 1.0's H200 18,027; batch 479 a step of 26.5 ms against 24.3 for
# its graph alone). ~1,437 requests x 4,096 tokens at ~17k tok/s: ~340 s plus the engine's load.
OUT=${1:?usage: decode_long.sh OUT}
export PYTHONPATH=$PWD COLUMNS=400
P=${PYTHON:-/opt/torch/.venv/bin/python3}
W=${WAVES:-3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
timeout 570 $P benchmarks/engine/throughput_bench.py --shapes 128/4096 --dtype fp8 --max-seq-len max \
  --max-batch-size 1024 --max-num-tokens 8192 --kv-fraction 0.95 --waves $W --stall-seconds 200 \
  --out $OUT/decode_long.json --markdown $OUT/decode_long.md > $OUT/decode_long.log 2>&1; echo "throughput rc $?"
grep -v -i warn $OUT/decode_long.log | cut -c1-400 | tail -40
