# Sourced by the GPU scripts. The per-dtype ones (engine/throughput_gpu_run.sh, speculative/speculative_gpu_run.sh):
# the machine check and the loop that gives each dtype its own process under its share of one time budget. The
# one-call kernel ones (kernels/moe_gemv_gpu_run.sh, kernels/moe_decode_gpu_run.sh): their start under one budget
# and the engine_bench decode run they share.
#
#   gpu_run_start NAME "SMOKE FLAGS"     PYTHON (the GPU machine's torch venv, else the checkout's, else
#                                        PATH's), BENCH_COMMIT, t0; prints the date and the GPU; SMOKE=1
#                                        puts SMOKE FLAGS (the tiny model on the CPU) in front of EXTRA,
#                                        otherwise a Python without a CUDA device ends the script
#   run_dtypes NAME MIN_SHARE run_one    for each of $DTYPES: its share of what is left of $BUDGET_S
#                                        (15 s kept for the report), skipped below MIN_SHARE s; calls
#                                        `run_one DTYPE SHARE JSON LOG` and collects the JSON files
#   report_dtypes NAME BENCH.py RESULTS.md   one table of every dtype (also of a run cut short); exits
#   budget_start OUT_DIR BUDGET_S        out: OUT_DIR (made; absolute), the checkout's root the working directory,
#                                        t0, budget, PYTHON as gpu_run_start picks it; the GPU in $out/gpu.txt
#   left                                 seconds of that budget left
#   qwen3_moe_decode TAG QUANT SECONDS [VAR=VALUE...]   engine_bench batch-1 decode of Qwen3-30B-A3B (QUANT: none
#                                        | fp8_block) under `timeout SECONDS` with those variables set, into
#                                        $out/engine_TAG.json and .log; prints its batch-1 and roofline rows

pick_python() {
  if [ -z "${PYTHON:-}" ]; then  # the torch venv of the GPU machine (../shared/gpu/README.md)
    PYTHON=/opt/torch/.venv/bin/python3
    [ -x "$PYTHON" ] || PYTHON=.venv/bin/python
    [ -x "$PYTHON" ] || PYTHON=$(command -v python3 || command -v python)
  fi
}

gpu_run_start() {
  local name=$1 smoke_flags=$2
  pick_python
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

budget_start() {
  out=$1
  budget=$2
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
  t0=$(date +%s)
  pick_python
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
}

left() { echo $(( budget - ($(date +%s) - t0) )); }

qwen3_moe_decode() {
  local tag=$1 quant=$2 seconds=$3 flag=() rc
  shift 3
  [ "$quant" = none ] || flag=(--quantization "$quant")
  env "$@" timeout "$seconds" "$PYTHON" benchmarks/engine/engine_bench.py --model qwen3_30b_a3b ${flag[@]+"${flag[@]}"} \
    --max-batch-size 16 --sections bandwidth,decode --out "$out/engine_$tag.json" > "$out/engine_$tag.log" 2>&1
  rc=$?
  echo "engine_bench qwen3_30b_a3b $quant${1:+, $*} (rc $rc, $(( $(date +%s) - t0 )) s in):"
  grep -E "^\| (batch-1|decode roofline)" "$out/engine_$tag.log" || tail -5 "$out/engine_$tag.log"
}
