#!/usr/bin/env bash
# Issue 34's GPU figures in one lease: benchmarks/speculative/speculative_bench.py on random weights of the
# Llama-3.1-8B shape made on the GPU, bf16 then FP8 (weights; KV pool bf16), each in its own process
# under its own share of one time budget. Nothing is downloaded or carried: it needs only the
# checkout and the machine's torch venv.
#
#   bash benchmarks/speculative/speculative_gpu_run.sh [OUT_DIR]          # from anywhere; OUT_DIR default $OUT
#
# Per dtype: the verify step against a plain decode step (k 1, 2, 4, 8 at batch 1, 8, 64), client
# drafts at fixed acceptance (k 4, 2, 8 with every a), the n-gram executor on a repetitive prompt
# set (a second engine load), the verify steps as single CUDA graphs, and the projection at the
# real-weight acceptance lengths. The bench skips what no longer fits its share (the n-gram engine
# first) and rewrites its JSON after every section, so a dtype cut short by `timeout` keeps what it
# measured. Results under OUT_DIR: speculative_<dtype>.json and .log, speculative_results.md (one
# table, both dtypes), console.log.
#
# Knobs (environment): DTYPES="bf16 fp8"  BUDGET_S=480 (the whole run; ~8 minutes)
#   EXTRA="" (more speculative_bench.py flags, e.g. "--loop-ks 4 --batches 1,8")  PYTHON=(the torch venv's python3)
#   SMOKE=1: the tiny model on the CPU, to check this script without a GPU
set -uo pipefail
cd "$(dirname "$0")/../.."  # the checkout's root
out=${1:-${OUT:-/tmp/speculative_gpu_run}}
mkdir -p "$out"
exec > >(tee -a "$out/console.log") 2>&1

DTYPES=${DTYPES:-bf16 fp8}
BUDGET_S=${BUDGET_S:-480}
# shellcheck source=benchmarks/gpu_run_common.sh
. benchmarks/gpu_run_common.sh
gpu_run_start speculative_gpu_run "--tiny --context 128 --output-len 16 --batches 1,4 --ks 1,4 --loop-ks 4 --ngram-prompts 2"

run_speculative() {  # DTYPE SHARE JSON LOG
  echo "=== $1: limit $2 s ==="
  # The bench plans for 20 s less than the limit: the process start (torch, CUDA) and the shutdown.
  timeout -k 15 "$2" "$PYTHON" benchmarks/speculative/speculative_bench.py --dtypes "$1" --time-budget $(( $2 - 20 )) \
    ${EXTRA:-} --out "$3" > "$4" 2>&1
  local rc=$?
  grep -E "^(---|    )" "$4"
  return $rc
}
run_dtypes speculative 90 run_speculative
report_dtypes benchmarks/speculative/speculative_bench.py "$out/speculative_results.md"
