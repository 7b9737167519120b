#!/bin/bash
# Issue 55's GPU figures in one lease on ONE H200 (random weights), at most ~375 s (the guards' sum; the
# 2026-11-29 run with 25-45-s guards lost the MLA bench and every offline section to them):
#  1. the MLA decode kernel's bandwidth over the latent cache, DeepSeek-V3's 128 heads, contexts 1k-32k,
#     batch 1/8/32, bf16 and FP8 pools (goal >= 80% of the copy bandwidth); a 4-node tree beside it;
#  2. DeepSeek-V2-Lite shape, bf16 then block-FP8: batch-1 decode against the active-parameter roofline
#     (goal >= 60%) and 128/128 offline (512 requests) through the executor;
#  3. MTP (decoding_mode mtp) on V2-Lite + a V3-style module: batch-1 step costs at k = 1..3 and the
#     speed-up they give at stated acceptances;
#  4. Llama-4-Scout's first 12 layers (llama4_scout_12l, bf16; the whole model needs TP2, or FP8:
#     engine_bench --model llama4_scout --quantization fp8_block): batch-1 decode and 128/128 offline (256 requests); per-layer
#     step time x 48/12 gives the whole stack's batch-1 figure.
# TINY=1: the same steps on the CPU with the tiny shapes (deepseek_tiny, llama4_tiny), a smoke run.
# Writes JSON and logs under $1; prints the tables' key rows.
#   bash benchmarks/engine/deepseek_llama4_gpu_run.sh OUT_DIR
set -u
out=${1:-/tmp/deepseek_llama4_gpu_run}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."  # the checkout's root
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PYTHON" ] || PYTHON=python3
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
date -u
if [ "${TINY:-0}" = 1 ]; then
  kernel="--tiny"; eb="--device cpu --dtype float32 --sections decode,offline --offline 16x16x8 --max-seq-len 512"
  eb="$eb --max-num-tokens 512 --max-batch-size 8"; v2=deepseek_tiny; scout=llama4_tiny; mtp="--tiny --ks 1,2"; fp8=""
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  kernel=""; eb="--sections bandwidth,decode,offline --max-seq-len 2048 --max-num-tokens 8192 --max-batch-size 256"
  v2=deepseek_v2_lite; scout=llama4_scout_12l; mtp="--ks 1,2,3 --repeat 10"; fp8="--quantization fp8_block"
fi
rows="^\| (batch-1|decode roofline|offline|\.\.\.|HBM)"
timeout ${MLA_S:-60} "$PYTHON" benchmarks/kernels/mla_kernel_bench.py $kernel --out "$out/mla_kernel.json" \
  > "$out/mla_kernel.log" 2>&1; grep -E "^\||^MLA|Error" "$out/mla_kernel.log" | tail -40
timeout ${TREE_S:-30} "$PYTHON" benchmarks/kernels/mla_kernel_bench.py $kernel --batches 1,8 --contexts 4096,32768 \
  --pool bf16 --tree 4 --out "$out/mla_kernel_tree.json" > "$out/mla_kernel_tree.log" 2>&1
grep -E "^\||Error" "$out/mla_kernel_tree.log" | tail -6
eb_offline=${EB_OFFLINE:-128x128x512}; [ "${TINY:-0}" = 1 ] && eb_offline=16x16x8
timeout ${V2_S:-75} "$PYTHON" benchmarks/engine/engine_bench.py --model $v2 $eb --offline $eb_offline \
  --out "$out/v2_lite_bf16.json" > "$out/v2_lite_bf16.log" 2>&1; grep -E "$rows|Error" "$out/v2_lite_bf16.log"
if [ -n "$fp8" ]; then
  timeout ${V2_FP8_S:-75} "$PYTHON" benchmarks/engine/engine_bench.py --model $v2 $eb $fp8 --offline $eb_offline \
    --out "$out/v2_lite_fp8_block.json" > "$out/v2_lite_fp8_block.log" 2>&1
  grep -E "$rows|Error" "$out/v2_lite_fp8_block.log"
fi
timeout ${MTP_S:-60} "$PYTHON" benchmarks/speculative/mtp_bench.py $mtp --out "$out/mtp.json" > "$out/mtp.log" 2>&1
grep -E "^\||Error" "$out/mtp.log" | tail -12
scout_offline=${SCOUT_OFFLINE:-128x128x256}; [ "${TINY:-0}" = 1 ] && scout_offline=16x16x8
timeout ${SCOUT_S:-75} "$PYTHON" benchmarks/engine/engine_bench.py --model $scout $eb --offline $scout_offline \
  --out "$out/scout_12l.json" > "$out/scout_12l.log" 2>&1; grep -E "$rows|Error" "$out/scout_12l.log"
date -u
