#!/usr/bin/env bash
# The GPU tests on a leased CUDA machine within a time budget, run so that a run the budget cuts
# short still names what failed and why.
#
#   BUDGET_S=480 bash tests/gpu_run.sh "$OUT"        (the device tool's $OUT comes back here)
#
# tests/kernels runs on KERNEL_WORKERS pytest-xdist workers (default 8: its tests hold little GPU
# memory, and its time goes mostly to Triton compiling); tests/engine on ENGINE_WORKERS (default 0:
# one test at a time, as it was checked; its executors have bounded pools, engine_testing.EXECUTOR_POOL).
# Of tests/executor only the tests marked gpu run (one at a time): its other executors take the
# default 90% of the free GPU memory for their KV pools, as served ones do, tens of millions of
# blocks for its tiny model.
# The kernels get KERNEL_SHARE percent of the budget (default 40), the engine tests what is left
# but 60 s, which the executor's few GPU tests get.
# OUT/failures.txt: each failure and error with its traceback as it happens (tests/conftest.py);
# OUT/<part>.log: every test's outcome (-v) and, when the part finished, pytest's summary.
# KERNEL_TESTS / ENGINE_TESTS override the paths (files or directories under tests/, whose
# conftest.py writes the failure log).
set -u
out=${1:?usage: tests/gpu_run.sh OUT}
mkdir -p "$out"
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3}  # the GPU machine's torch venv (../shared/gpu/README.md)
[ -x "$PYTHON" ] || PYTHON=.venv/bin/python
budget=${BUDGET_S:-480}
t0=$(date +%s)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITONLLM_TEST_FAILURE_LOG=$out/failures.txt
: > "$TRITONLLM_TEST_FAILURE_LOG"
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "CUDA:", torch.cuda.is_available())'

run_part() {  # NAME SECONDS WORKERS PATHS...
  local name=$1 seconds=$2 workers=$3 start rc
  shift 3
  start=$(date +%s)
  local distribute=()
  [ "$workers" -gt 0 ] && distribute=(-n "$workers")
  timeout "$seconds" "$PYTHON" -m pytest -v -rfE --tb=short -p no:cacheprovider "${distribute[@]}" "$@" \
    > "$out/$name.log" 2>&1
  rc=$?
  local how="exit $rc"
  [ "$rc" -eq 124 ] && how="cut by its $seconds s limit"
  printf '%s: %s after %s s: %s passed, %s skipped, %s failed, %s errors\n' \
    "$name" "$how" "$(( $(date +%s) - start ))" \
    "$(outcomes "$name" PASSED)" "$(outcomes "$name" SKIPPED)" "$(outcomes "$name" FAILED)" "$(outcomes "$name" ERROR)"
}

outcomes() {  # PART OUTCOME: the -v lines of that outcome (not the summary's lines, which start with it)
  grep -E "^(tests/|\[gw).* $2( |\$)" "$out/$1.log" | grep -c "$2"
}

kernel_s=$(( (budget - 10) * ${KERNEL_SHARE:-40} / 100 ))
# shellcheck disable=SC2086  # the path lists split on spaces
run_part kernels "$kernel_s" "${KERNEL_WORKERS:-8}" ${KERNEL_TESTS:-tests/kernels}
# shellcheck disable=SC2086
run_part engine "$(( budget - 60 - ($(date +%s) - t0) ))" "${ENGINE_WORKERS:-0}" ${ENGINE_TESTS:-tests/engine}
run_part executor "$(( budget - 10 - ($(date +%s) - t0) ))" 0 -m gpu tests/executor
echo "failures and errors (tracebacks in $out/failures.txt):"
grep -E '^(FAILED|ERROR)' "$TRITONLLM_TEST_FAILURE_LOG" || echo "  none"
echo "done in $(( $(date +%s) - t0 )) s"
