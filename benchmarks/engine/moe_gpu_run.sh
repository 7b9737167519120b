#!/bin/bash
# Issue 31's GPU figures in one lease: Qwen3-30B-A3B shape in bf16, FP8 per channel and FP8 per
# 128 x 128 block, and bf16 weights with an FP8 KV cache at batch 1,024; gpt-oss-20b shape; the
# expert kernels alone. Writes JSON and logs under $1.
#   bash benchmarks/engine/moe_gpu_run.sh OUT_DIR
set -u
out=${1:-/tmp/moe_gpu_run}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # a relative OUT_DIR stays where it was given
cd "$(dirname "$0")/../.."  # the checkout's root
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
common="--model qwen3_30b_a3b --max-batch-size 512 --sections bandwidth,decode,offline --offline 128x128x1024"
for quant in none fp8 fp8_block; do
  flag=$([ "$quant" = none ] || echo "--quantization $quant")
  timeout 150 python benchmarks/engine/engine_bench.py $common $flag --out "$out/qwen3_$quant.json" > "$out/qwen3_$quant.log" 2>&1
  grep -E "^\| (batch-1|offline|\.\.\.|executor|decode roofline)" "$out/qwen3_$quant.log"
done
# bf16 weights with an FP8 KV cache: all 1,024 requests of 128/128 in one wave (benchmarks/results/kernels.md, issue 31)
timeout 150 python benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --max-batch-size 1024 --kv-cache-dtype fp8 --sections offline \
  --offline 128x128x1024 --out "$out/qwen3_none_kvfp8.json" > "$out/qwen3_none_kvfp8.log" 2>&1
grep -E "^\| (offline|\.\.\.|executor)" "$out/qwen3_none_kvfp8.log"
timeout 150 python benchmarks/engine/engine_bench.py --model gpt_oss_20b --max-batch-size 512 --sections bandwidth,decode,offline \
  --offline 128x128x1024 --out "$out/gpt_oss.json" > "$out/gpt_oss.log" 2>&1
grep -E "^\| (batch-1|offline|\.\.\.|executor|decode roofline)" "$out/gpt_oss.log"
timeout 90 python benchmarks/kernels/moe_kernel_bench.py --stages --tokens 1 8 64 512 2048 8192 > "$out/moe_kernels.log" 2>&1
cat "$out/moe_kernels.log"
