#!/bin/bash
# Issue 53's decode-sized experts in one device call (<= ~200 s on one H200): the one-launch kernel's
# GPU tests, its kernel bench against the default path (Qwen3-30B-A3B and gpt-oss-20b shapes, bf16 and
# block-FP8, 1/8/16 tokens, tile sweep), then engine_bench batch-1 decode of Qwen3-30B-A3B with the
# switch on (bf16, then block-FP8 if the time allows). Logs under $1.
#   bash benchmarks/kernels/moe_decode_gpu_run.sh OUT_DIR
set -u
out=${1:-/tmp/moe_decode_gpu_run}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
t0=$(date +%s)
PY=${PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 60 $PY -m pytest -q -x tests/kernels/test_moe_decode.py -p no:cacheprovider > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
timeout 100 $PY benchmarks/kernels/moe_decode_bench.py --sweep > "$out/kernel_bench.log" 2>&1
cat "$out/kernel_bench.log"
for quant in none fp8_block; do
  left=$(( 200 - ($(date +%s) - t0) ))
  [ "$left" -gt 45 ] || { echo "engine_bench $quant skipped: ${left}s left"; continue; }
  flag=$([ "$quant" = none ] || echo "--quantization $quant")
  TRITONLLM_MOE_DECODE=fused timeout "$left" $PY benchmarks/engine/engine_bench.py --model qwen3_30b_a3b $flag \
    --max-batch-size 16 --sections bandwidth,decode --out "$out/engine_fused_$quant.json" > "$out/engine_fused_$quant.log" 2>&1
  echo "engine_bench qwen3_30b_a3b $quant, TRITONLLM_MOE_DECODE=fused (rc $?):"
  grep -E "^\| (batch-1|decode roofline)" "$out/engine_fused_$quant.log" || tail -5 "$out/engine_fused_$quant.log"
done
echo "total $(( $(date +%s) - t0 )) s"
