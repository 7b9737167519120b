#!/bin/bash
# Issue 54's GPU figures in one lease: batch-1 decode of BLOOM-7B1 (ALiBi) and Falcon-7B (multi-query,
# parallel residual) against their bf16 weight-read roofline, each with one eager step's kernel
# profile; both 128/128 offline (1,024 requests) and transformers' generate at static batches.
# TESTS=1: the fused LayerNorm / activated-GEMM kernel tests first. SWEEP=1: the skinny-GEMM tilings
# on these shapes first (benchmarks/kernels/skinny_tiling_sweep.py). Writes JSON and logs under $1.
#   bash benchmarks/engine/families_gpu_run.sh OUT_DIR
set -u
out=${1:-/tmp/families_gpu_run}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # a relative OUT_DIR stays where it was given
cd "$(dirname "$0")/../.."  # the checkout's root
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PYTHON" ] || PYTHON=python3
export PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [ "${TESTS:-0}" = 1 ]; then
  timeout 60 "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_elementwise.py \
    tests/kernels/test_kernel_linear.py -k "layer_norm or activated" > "$out/tests.log" 2>&1; tail -2 "$out/tests.log"
fi
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 90 "$PYTHON" benchmarks/kernels/skinny_tiling_sweep.py --out "$out/sweep.json" > "$out/sweep.log" 2>&1
  grep -E "^\||failed|WRONG" "$out/sweep.log"
fi
common="--max-seq-len 2048 --max-num-tokens 8192"
timeout ${BLOOM_S:-200} "$PYTHON" benchmarks/engine/engine_bench.py --model bloom7b1 $common --max-batch-size 512 \
  --sections bandwidth,decode,offline,hf --offline 128x128x1024 --hf-batches ${HF_BATCHES:-128,256} \
  --out "$out/bloom7b1.json" > "$out/bloom7b1.log" 2>&1
grep -E "^\| (batch-1|decode roofline|offline|\.\.\.|transformers|HBM)" "$out/bloom7b1.log"
timeout ${FALCON_S:-240} "$PYTHON" benchmarks/engine/engine_bench.py --model falcon7b $common --max-batch-size 512 \
  --sections bandwidth,decode,offline,hf --offline 128x128x1024 --hf-batches ${HF_BATCHES:-128,256} \
  --out "$out/falcon7b.json" > "$out/falcon7b.log" 2>&1
grep -E "^\| (batch-1|decode roofline|offline|\.\.\.|transformers|HBM)" "$out/falcon7b.log"
