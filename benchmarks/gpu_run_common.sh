# Sourced by the per-dtype GPU scripts (engine/throughput_gpu_run.sh, speculative/speculative_gpu_run.sh): the machine
# check and the loop that gives each dtype its own process under its share of one time budget.
#
#   gpu_run_start NAME "SMOKE FLAGS"     PYTHON (the GPU machine's torch venv, else the checkout's, else
#                                        PATH's), BENCH_COMMIT, t0; prints the date and the GPU; SMOKE=1
#                                        puts SMOKE FLAGS (the tiny model on the CPU) in front of EXTRA,
#                                        otherwise a Python without a CUDA device ends the script
#   run_dtypes NAME MIN_SHARE run_one    for each of $DTYPES: its share of what is left of $BUDGET_S
#                                        (15 s kept for the report), skipped below MIN_SHARE s; calls
#                                        `run_one DTYPE SHARE JSON LOG` and collects the JSON files
#   report_dtypes NAME BENCH.py RESULTS.md   one table of every dtype (also of a run cut short); exits

gpu_run_start() {
  local name=$1 smoke_flags=$2
  if [ -z "${PYTHON:-}" ]; then  # the torch venv of the GPU machine (../shared/gpu/README.md)
    PYTHON=/opt/torch/.venv/bin/python3
    [ -x "$PYTHON" ] || PYTHON=.venv/bin/python
    [ -x "$PYTHON" ] || PYTHON=$(command -v python3 || command -v python)
  fi
  export PYTHONUNBUFFERED=1
  export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  t0=$(date +%s)
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  if [ "${SMOKE:-0}" = 1 ]; then  # a check of the script off the GPU: the tiny model on the CPU
    EXTRA="$smoke_flags ${EXTRA:-}"
  else
    "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' \
      || { echo "$name: $PYTHON has no torch with a CUDA device"; exit 1; }
  fi
}

run_dtypes() {
  local name=$1 min_share=$2 run_one=$3 i dtype left share json log rc dtypes
  read -r -a dtypes <<< "$DTYPES"
  jsons=()
  status=0
  for i in "${!dtypes[@]}"; do
    dtype=${dtypes[$i]}
    left=$(( BUDGET_S - ($(date +%s) - t0) - 15 ))
    share=$(( left / (${#dtypes[@]} - i) ))
    if [ "$share" -lt "$min_share" ]; then
      echo "=== $dtype: skipped, ${left} s of the budget left"; status=1; continue
    fi
    json=$out/${name}_$dtype.json
    log=$out/${name}_$dtype.log
    "$run_one" "$dtype" "$share" "$json" "$log"
    rc=$?
    [ $rc -eq 0 ] || { status=$rc; echo "${name}_gpu_run: $dtype exited with $rc (124: the time limit); its log ends:"; tail -n 30 "$log"; }
    [ -f "$json" ] && jsons+=("$json")
  done
}

report_dtypes() {
  local bench=$1 results=$2
  if [ ${#jsons[@]} -gt 0 ]; then
    "$PYTHON" "$bench" --report "$(IFS=,; echo "${jsons[*]}")" --markdown "$results" > /dev/null
    cat "$results"
  fi
  echo "done in $(( $(date +%s) - t0 )) s; results in $out"
  sleep 1  # let tee flush console.log
  exit $status
}
