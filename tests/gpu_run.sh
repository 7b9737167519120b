#!/usr/bin/env bash
# Every GPU test (tests/kernels, tests/engine, tests/executor) on a leased CUDA machine in one device
# call of at most 10 minutes, run so that a run cut short still names what failed and why.
#
#   here:  bash tests/gpu_wheels.sh                       (once: .gpu_stash/ and .gpu_wheels/)
#   call 1 (carry .gpu_stash):   true                      (part of the embedded model stays on the warm machine)
#   call 2 (carry .gpu_wheels):  BUDGET_S=540 bash tests/gpu_run.sh "$OUT"
#
# The wheels the machine lacks (tests/gpu_wheels.sh) are installed first, so no test errors for a
# missing package; without .gpu_stash the embedded model's tests fail at their fixture, by name.
#
# The three parts run at the same time, each pytest on its own xdist workers (KERNEL_WORKERS,
# ENGINE_WORKERS, EXECUTOR_WORKERS; their sum within the machine's cores: Triton's compiles take
# the CPU, and its cache on disk is shared, so a kernel compiles once for all workers). On one GPU
# every process that makes a model runner caps its allocator at $TRITONLLM_GPU_MEMORY_FRACTION of
# the device (engine/executor/device_memory.py), so the workers fit together: the tests' own
# executors get the CPU's pool size (tests/conftest.py), the engine processes they start 90% of
# their share. With several GPUs the parts go to GPUs of their own (CUDA_VISIBLE_DEVICES), round robin.
#
# Prints one summary line per part, then each failure and error with its traceback (written as it
# happens by tests/conftest.py, so a part cut by the budget still reports them).
# OUT/<part>.log: each test's outcome (-v), every duration over 1 s and pytest's summary; OUT/failures.txt: the
# tracebacks of all parts; OUT/kernel_choices.tgz: the choices made (at most 8 files come back from a device call).
set -u
out=${1:?usage: tests/gpu_run.sh OUT}
mkdir -p "$out"
t0=$(date +%s)
budget=${BUDGET_S:-540}
if [ -z "${PYTHON:-}" ]; then  # the GPU machine's torch venv (../shared/gpu/README.md), else the project's
  for PYTHON in /opt/torch/.venv/bin/python3 .venv/bin/python python3; do [ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null && break; done
fi
site=/tmp/gpu_test_site
work=$(mktemp -d)  # per part: its exit status and its failure log

install_wheels() {
  local wheels=() part1 part2 whole
  part2=$(ls .gpu_wheels/*.part2 2>/dev/null | head -1)
  if [ -n "$part2" ]; then
    whole=$(basename "${part2%.part2}")
    part1=.gpu_stash/$whole.part1
    if [ -f "$part1" ]; then
      cat "$part1" "$part2" > "/tmp/$whole"
      if [ "$(sha256sum "/tmp/$whole" | cut -d' ' -f1)" = "$(cat ".gpu_wheels/$whole.sha256")" ]; then
        wheels+=("/tmp/$whole")
      else
        echo "wheels: $whole does not match its sha256 once joined; not installed"
      fi
    else
      echo "wheels: $part1 did not stay on this machine (carry .gpu_stash in a call just before): $whole not installed"
    fi
  fi
  for tarball in .gpu_wheels/*.tar.xz; do  # NIXL's trimmed files (tests/gpu_wheels.sh), unpacked as they are
    [ -f "$tarball" ] && mkdir -p "$site" && tar xJf "$tarball" -C "$site" && echo "wheels: unpacked $(basename "$tarball")"
  done
  wheels+=(.gpu_wheels/*.whl)
  [ -e "${wheels[-1]}" ] || { echo "wheels: none in .gpu_wheels (bash tests/gpu_wheels.sh here, then carry it)"; return; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
    && echo "wheels: installed $(printf '%s\n' "${wheels[@]}" | sed 's|.*/||; s/-[0-9].*//' | tr '\n' ' ')"
}

install_wheels
# The load-time kernel choices (kernels/choice_cache.py) in one directory for every process of the three parts, so
# a later test's engine hits what an earlier one timed; seeded from .gpu_choices/kernel_choices.tgz when that is
# carried (a copy of an earlier run's $out/kernel_choices.tgz: a fresh machine starts cold, and each cold choice
# compiles and times every candidate). Entries whose kernels or candidates changed since are re-timed (the key
# holds their digests); tests/kernels/test_choice_cache.py keeps its cold-then-warm loads in a cache of its own.
export TRITONLLM_KERNEL_CHOICE_CACHE=${TRITONLLM_KERNEL_CHOICE_CACHE:-/tmp/gpu_suite_kernel_choices}
if [ -f .gpu_choices/kernel_choices.tgz ]; then
  mkdir -p "$TRITONLLM_KERNEL_CHOICE_CACHE" && tar xzf .gpu_choices/kernel_choices.tgz -C "$TRITONLLM_KERNEL_CHOICE_CACHE" \
    && echo "choices: $(ls "$TRITONLLM_KERNEL_CHOICE_CACHE" | wc -l) families from .gpu_choices/kernel_choices.tgz"
fi
export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITONLLM_GPU_SUITE=1  # tests/gpu_suite_order.py: the long tests first, one worker each
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "CUDA:", torch.cuda.is_available(), "GPUs:", torch.cuda.device_count(), "cores:", __import__("os").cpu_count())'
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)

outcomes() {  # PART OUTCOME: how many -v lines of that outcome (the summary's lines start with it instead)
  grep -E "^(tests/|\[gw).* $2( |\$)" "$out/$1.log" | grep -c "$2"
}

run_part() {  # NAME GPU WORKERS MEMORY_FRACTION DIST PATHS...: in the background; writes $work/NAME.rc when done
  local name=$1 gpu=$2 workers=$3 fraction=$4 dist=$5 limit
  shift 5
  limit=$(( budget - ($(date +%s) - t0) - 15 ))
  (
    [ "$gpus" -gt 1 ] && export CUDA_VISIBLE_DEVICES=$gpu
    export TRITONLLM_GPU_MEMORY_FRACTION=$fraction
    export TRITONLLM_TEST_FAILURE_LOG=$work/failures-$name.txt
    # tests/gpu_suite_order.py orders the collection in the workers, where xdist has set --dist to "no"
    export TRITONLLM_GPU_SUITE_DIST=$dist
    : > "$TRITONLLM_TEST_FAILURE_LOG"
    start=$(date +%s)
    # SIGINT, not SIGTERM: pytest stops as on Ctrl-C and still prints its summary and every duration so far
    # (a part cut by the budget says where its time went); SIGKILL 10 s later if it has not stopped.
    timeout -s INT -k 10 "$limit" "$PYTHON" -m pytest -v -rfEs --tb=short -p no:cacheprovider -n "$workers" --dist "$dist" \
      --no-loadscope-reorder --durations=0 --durations-min=1 "$@" > "$out/$name.log" 2>&1
    echo "$? $(( $(date +%s) - start ))" > "$work/$name.rc"
  ) &
}

# Memory caps per process ($TRITONLLM_GPU_MEMORY_FRACTION): tests size their executors' pools as on
# the CPU (tests/conftest.py), so a worker's cap holds its models (SmolLM2 in float32 is 0.5 GB; a
# worker may hold three executors at once: 1.4 GB ran out); the engine processes that executor tests
# start take 90% of their cap, 0.04 (5.6 GB of an H200): ~5 million blocks of the tiny model's 1 KB,
# ~5 s of a block manager's set-up each.
# WARM_CACHE=1: the engine's load-time GEMM candidates compiled by a pool of processes
# (benchmarks/kernels/warm_triton_cache.py, 90 kernels) while the parts collect their tests; every CUDA executor a
# test starts times them, and on a cold cache each worker compiled them one after the other (the throughput
# bench's tiny run: 84 s). Not measured yet. Its summary line lands in $out/warm_cache.txt.
if [ "${WARM_CACHE:-0}" = 1 ]; then
  timeout 120 "$PYTHON" benchmarks/kernels/warm_triton_cache.py --jobs "${WARM_JOBS:-8}" > "$out/warm_cache.txt" 2>&1 &
fi
# shellcheck disable=SC2086  # the path lists split on spaces
run_part kernels 0 "${KERNEL_WORKERS:-8}" 1 load ${KERNEL_TESTS:-tests/kernels}
# shellcheck disable=SC2086
run_part engine $(( 1 % (gpus > 0 ? gpus : 1) )) "${ENGINE_WORKERS:-5}" 0.03 loadfile ${ENGINE_TESTS:-tests/engine}
# shellcheck disable=SC2086
run_part executor $(( 2 % (gpus > 0 ? gpus : 1) )) "${EXECUTOR_WORKERS:-3}" 0.04 loadfile ${EXECUTOR_TESTS:-tests/executor}
wait

for name in kernels engine executor; do
  read -r rc seconds < "$work/$name.rc"
  how="exit $rc"
  [ "$rc" -eq 124 ] && how="CUT by the budget"
  [ "$rc" -eq 137 ] && how="CUT by the budget (SIGKILL: no summary)"  # timeout's -k, 10 s after its SIGINT
  printf '%-9s %s after %s s: %s passed, %s skipped, %s failed, %s errors\n' "$name:" "$how" "$seconds" \
    "$(outcomes "$name" PASSED)" "$(outcomes "$name" SKIPPED)" "$(outcomes "$name" FAILED)" "$(outcomes "$name" ERROR)"
done
for name in kernels engine executor; do
  echo "slowest of $name:"
  sed -n '/slowest.*durations/,/^$/p' "$out/$name.log" | sed -n '2,7p'
done
echo "skipped, by reason (count):"
grep -h '^SKIPPED' "$out"/kernels.log "$out"/engine.log "$out"/executor.log \
  | sed -E 's/^SKIPPED \[([0-9]+)\] [^:]+:[0-9]+: /\1\t/' \
  | awk -F'\t' '{n[$2] += $1} END {for (r in n) printf "%6d  %s\n", n[r], r}' | sort -rn | head -20
echo "failures and errors:"
cat "$work"/failures-*.txt > "$out/failures.txt"
grep -E '^(FAILED|ERROR)' "$out/failures.txt" || echo "  none"
head -c 6000 "$out/failures.txt"
if [ -d "$TRITONLLM_KERNEL_CHOICE_CACHE" ]; then  # for the next run's .gpu_choices/ (README, "Tests and speed")
  tar czf "$out/kernel_choices.tgz" -C "$TRITONLLM_KERNEL_CHOICE_CACHE" --exclude='*.lock' . \
    && echo "choices: $(ls "$TRITONLLM_KERNEL_CHOICE_CACHE" | grep -vc '\.lock$') families in $out/kernel_choices.tgz"
fi
[ -f "$out/warm_cache.txt" ] && grep -E "^warm_triton_cache|not compiled" "$out/warm_cache.txt"
echo "done in $(( $(date +%s) - t0 )) s"
