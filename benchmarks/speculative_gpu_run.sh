#!/usr/bin/env bash
# Issue 34's GPU figures in one lease: benchmarks/speculative_bench.py on random weights of the
# Llama-3.1-8B shape made on the GPU, bf16 then FP8 (weights; KV pool bf16), each in its own process
# under its own share of one time budget. Nothing is downloaded or carried: it needs only the
# checkout and the machine's torch venv.
#
#   bash benchmarks/speculative_gpu_run.sh [OUT_DIR]          # from anywhere; OUT_DIR default $OUT
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
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/speculative_gpu_run}}
mkdir -p "$out"
exec > >(tee -a "$out/console.log") 2>&1

DTYPES=${DTYPES:-bf16 fp8}
BUDGET_S=${BUDGET_S:-480}
if [ -z "${PYTHON:-}" ]; then  # the torch venv of the GPU machine, else the checkout's, else PATH's
  PYTHON=/opt/torch/.venv/bin/python3
  [ -x "$PYTHON" ] || PYTHON=.venv/bin/python
  [ -x "$PYTHON" ] || PYTHON=$(command -v python3 || command -v python)
fi
export PYTHONUNBUFFERED=1
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
if [ "${SMOKE:-0}" = 1 ]; then  # a check of this script off the GPU: the tiny model on the CPU
  EXTRA="--tiny --context 128 --output-len 16 --batches 1,4 --ks 1,4 --loop-ks 4 --ngram-prompts 2 ${EXTRA:-}"
else
  "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' \
    || { echo "speculative_gpu_run: $PYTHON has no torch with a CUDA device"; exit 1; }
fi

read -r -a dtypes <<< "$DTYPES"
jsons=()
status=0
for i in "${!dtypes[@]}"; do
  dtype=${dtypes[$i]}
  left=$(( BUDGET_S - ($(date +%s) - t0) - 15 ))  # 15 s kept for the report at the end
  share=$(( left / (${#dtypes[@]} - i) ))
  if [ "$share" -lt 90 ]; then
    echo "=== $dtype: skipped, ${left} s of the budget left"; status=1; continue
  fi
  json=$out/speculative_$dtype.json
  echo "=== $dtype: limit ${share} s ==="
  # The bench plans for 20 s less than the limit: the process start (torch, CUDA) and the shutdown.
  timeout -k 15 "$share" "$PYTHON" benchmarks/speculative_bench.py --dtypes "$dtype" --time-budget $(( share - 20 )) \
    ${EXTRA:-} --out "$json" > "$out/speculative_$dtype.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { status=$rc; echo "speculative_gpu_run: $dtype exited with $rc (124: the time limit); its log ends:"; tail -n 30 "$out/speculative_$dtype.log"; }
  grep -E "^(---|    )" "$out/speculative_$dtype.log"
  [ -f "$json" ] && jsons+=("$json")
done
if [ ${#jsons[@]} -gt 0 ]; then  # one table of every dtype, also from a run the limit cut short
  "$PYTHON" benchmarks/speculative_bench.py --report "$(IFS=,; echo "${jsons[*]}")" --markdown "$out/speculative_results.md" > /dev/null
  cat "$out/speculative_results.md"
fi
echo "done in $(( $(date +%s) - t0 )) s; results in $out"
sleep 1  # let tee flush console.log
exit $status
