#!/usr/bin/env bash
# Issue 32's throughput table on the GPU machine: TensorRT-LLM 1.0's input/output shapes through the
# in-process executor (benchmarks/engine/throughput_bench.py), FP8 (weights + KV) then bf16, on random
# weights of the Llama-3.1-8B shape made on the GPU, all within one time budget. Nothing is
# downloaded or carried: it needs only the checkout and the machine's torch venv.
#
#   bash benchmarks/engine/throughput_gpu_run.sh [OUT_DIR]          # from anywhere; OUT_DIR default $OUT
#
# Each dtype runs in its own process under its own share of the budget (a shape that overruns
# costs only its dtype's later shapes), with one engine per dtype sized for the longest shape
# (--max-seq-len max: one engine load each, not one per shape), and the bench's own --time-budget,
# which sizes the request counts from issue 32's measured rates (recalibrated after each shape)
# and skips what no longer fits. Results under OUT_DIR: throughput_<dtype>.json (rewritten after
# every shape), throughput_<dtype>.log, throughput_results.md (one table, both dtypes, with
# TensorRT-LLM's FP8 figures and the ratios), console.log.
#
# Knobs (environment):
#   SHAPES="128/128,2048/128"  (any of 128/128 128/2048 128/4096 500/2000 1000/1000 1000/2000
#                               2048/128 2048/2048 5000/500 20000/2000; ISL/OSL:N fixes a count)
#   DTYPES="fp8 bf16"  BUDGET_S=540 (all of it: 9 minutes)  ENGINE_S=120 (an engine load, compiles included)
#   MAX_BATCH_SIZE=1024  MAX_NUM_TOKENS=8192  KV_FRACTION=0.95  EXTRA="" (more throughput_bench.py flags,
#   e.g. "--waves 8" or "--max-requests 4000")  PYTHON=(the torch venv's python3)
#   SMOKE=1: the tiny model on the CPU, to check this script without a GPU
# A full-count run of all ten shapes takes about 90 minutes per dtype on an H100 (20000/2000 alone ~45):
#   python benchmarks/engine/throughput_bench.py --dtype fp8 --out fp8.json --markdown results.md
set -uo pipefail
cd "$(dirname "$0")/../.."  # the checkout's root
out=${1:-${OUT:-/tmp/throughput_gpu_run}}
mkdir -p "$out"
exec > >(tee -a "$out/console.log") 2>&1

SHAPES=${SHAPES:-128/128,2048/128}
DTYPES=${DTYPES:-fp8 bf16}
BUDGET_S=${BUDGET_S:-540}
ENGINE_S=${ENGINE_S:-120}
# shellcheck source=benchmarks/gpu_run_common.sh
. benchmarks/gpu_run_common.sh
gpu_run_start throughput_gpu_run "--tiny --max-requests 4 --max-batch-size 2"

run_throughput() {  # DTYPE SHARE JSON LOG
  echo "=== $1: shapes $SHAPES, limit $2 s ==="
  # The bench plans for 10 s less than the limit: the process start and the engine's shutdown.
  timeout -k 20 "$2" "$PYTHON" benchmarks/engine/throughput_bench.py --dtype "$1" --shapes "$SHAPES" \
    --max-seq-len max --time-budget $(( $2 - 10 )) --engine-seconds "$ENGINE_S" \
    --max-batch-size "${MAX_BATCH_SIZE:-1024}" --max-num-tokens "${MAX_NUM_TOKENS:-8192}" \
    --kv-fraction "${KV_FRACTION:-0.95}" ${EXTRA:-} --out "$3" > "$4" 2>&1
  local rc=$?
  sed -n '/^=== /,/^Where the time went/p' "$4"  # the per-shape blocks (trtllm-bench's fields, ...)
  return $rc
}
run_dtypes throughput $(( ENGINE_S + 30 )) run_throughput
report_dtypes benchmarks/engine/throughput_bench.py "$out/throughput_results.md"
