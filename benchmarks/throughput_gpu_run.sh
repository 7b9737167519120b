#!/usr/bin/env bash
# Issue 32's throughput table on the GPU machine: TensorRT-LLM 1.0's input/output shapes through the
# in-process executor (benchmarks/throughput_bench.py), FP8 (weights + KV) then bf16, on random
# weights of the Llama-3.1-8B shape made on the GPU, all within one time budget. Nothing is
# downloaded or carried: it needs only the checkout and the machine's torch venv.
#
#   bash benchmarks/throughput_gpu_run.sh [OUT_DIR]          # from anywhere; OUT_DIR default $OUT
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
#   python benchmarks/throughput_bench.py --dtype fp8 --out fp8.json --markdown results.md
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/throughput_gpu_run}}
mkdir -p "$out"
exec > >(tee -a "$out/console.log") 2>&1

SHAPES=${SHAPES:-128/128,2048/128}
DTYPES=${DTYPES:-fp8 bf16}
BUDGET_S=${BUDGET_S:-540}
ENGINE_S=${ENGINE_S:-120}
if [ -z "${PYTHON:-}" ]; then  # the torch venv of the GPU machine (../shared/gpu/README.md), else PATH's
  PYTHON=/opt/torch/.venv/bin/python3
  [ -x "$PYTHON" ] || PYTHON=$(command -v python3 || command -v python)
fi
export PYTHONUNBUFFERED=1
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
if [ "${SMOKE:-0}" = 1 ]; then  # a check of this script off the GPU: the tiny model on the CPU
  EXTRA="--tiny --max-requests 4 --max-batch-size 2 ${EXTRA:-}"
else
  "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' \
    || { echo "throughput_gpu_run: $PYTHON has no torch with a CUDA device"; exit 1; }
fi

read -r -a dtypes <<< "$DTYPES"
jsons=()
status=0
for i in "${!dtypes[@]}"; do
  dtype=${dtypes[$i]}
  left=$(( BUDGET_S - ($(date +%s) - t0) - 15 ))  # 15 s kept for the report at the end
  share=$(( left / (${#dtypes[@]} - i) ))
  if [ "$share" -lt $(( ENGINE_S + 30 )) ]; then
    echo "=== $dtype: skipped, ${left} s of the budget left"; status=1; continue
  fi
  json=$out/throughput_$dtype.json
  echo "=== $dtype: shapes $SHAPES, limit ${share} s ==="
  # The bench plans for 10 s less than the limit: the process start and the engine's shutdown.
  timeout -k 20 "$share" "$PYTHON" benchmarks/throughput_bench.py --dtype "$dtype" --shapes "$SHAPES" \
    --max-seq-len max --time-budget $(( share - 10 )) --engine-seconds "$ENGINE_S" \
    --max-batch-size "${MAX_BATCH_SIZE:-1024}" --max-num-tokens "${MAX_NUM_TOKENS:-8192}" \
    --kv-fraction "${KV_FRACTION:-0.95}" ${EXTRA:-} --out "$json" > "$out/throughput_$dtype.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { status=$rc; echo "throughput_gpu_run: $dtype exited with $rc (124: the time limit); its log ends:"; tail -n 30 "$out/throughput_$dtype.log"; }
  # The per-shape blocks (trtllm-bench's fields, steady state, where the time went).
  sed -n '/^=== /,/^Where the time went/p' "$out/throughput_$dtype.log"
  [ -f "$json" ] && jsons+=("$json")
done
if [ ${#jsons[@]} -gt 0 ]; then  # one table of every dtype, also from a run the limit cut short
  "$PYTHON" benchmarks/throughput_bench.py --report "$(IFS=,; echo "${jsons[*]}")" --markdown "$out/throughput_results.md" > /dev/null
  cat "$out/throughput_results.md"
fi
echo "done in $(( $(date +%s) - t0 )) s; results in $out"
sleep 1  # let tee flush console.log
exit $status
