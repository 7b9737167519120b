#!/usr/bin/env bash
# The device calls of a session on nvidia-h200-x2 (2 H200s of one host), planned in benchmarks/next_gpu_runs.md
# ("On nvidia-h200-x2"): issue 50's PP 2 vs TP 2 vs one GPU, issue 57's disaggregated vs aggregated serving and
# its KV transfer, the checks that need two GPUs, and the one-GPU runs still waiting, two at a time
# (CUDA_VISIBLE_DEVICES=0 and =1) after the two-GPU work of the same call, never beside it.
#
#   bash benchmarks/engine/x2_gpu_run.sh CALL [OUT]        CALL 1 to 34; OUT default $OUT
#   LANES_DIR=D LANE0="a b" LANE1="c" bash benchmarks/engine/x2_gpu_run.sh lanes [OUT]   D/a.sh, D/b.sh on GPU 0, D/c.sh on GPU 1
#   SMOKE=1 bash benchmarks/engine/x2_gpu_run.sh CALL DIR  the same flow on the CPU with the tiny model
#                                                         (the one-GPU jobs are only printed)
#
# 1  (~420 s, guard 530) two-GPU checks: tests/executor/test_disaggregated.py with context on GPU 0 and
#    generation on GPU 1 (TRITONLLM_DISAGG_DEVICES) + test_device_stream.py (its two-GPU case), then
#    tp_bench.py: greedy TP 2 and PP 2 == TP 1 (float32, over NCCL), then bf16 speed of TP 1, TP 2, PP 2.
# 2  (~430 s, guard 540) disagg_bench.py (FP8 weights + FP8 KV), then the one-GPU pair:
#    GPU 0 vlm_bench offline (vlmstall2) + the INT4 batch-1 run (int4b1), GPU 1 V2-Lite decode (dsdecode2).
# 3  (~300 s, guard 310) the INT4 list (issue 52): GPU 0 bf16 then INT4 dequantize + cuBLAS, GPU 1 INT4 rows kernel.
# 4  (~545 s; only with >= 11 min of device time left) issue 51's two shapes that were cut: GPU 0 128/4096,
#    GPU 1 20000/2000, each at 3 waves within its 535-s budget.
# 5, 6 session 16's retries (run). 7 (~250 s on two GPUs, ~450 s with LANES=1) session 17's one-GPU jobs in two lanes (LANES=1 on one GPU);
#    8 (~270 s) the KV pull and NIXL GPU tests, PP 2 with stage graphs and with two steps in flight;
#    9 (~430 s) disagg_bench at 6 and 10 req/s, then with the context executor in its own process.
# 10-12 session 17's later calls, 13-16 session 18's, 17 session 19's first, 18 session 20's first, 19 its plan for the next session, 20 session 21's first bench call, 21 what call 20 lost, 22 session 22's, 23 session 23's middle call, 24 its last, 25 session 24's first bench call, 26 its middle call, 27 its helpers' second call, 28 its last, 29 one more T5 run (each case's comment says what it runs and
# how long).
#
# Everything goes to /tmp/x2_call$CALL; at the end OUT gets call$CALL.tgz (all logs and JSON), summary.txt (what
# this script printed) and the markdown tables (at most 8 files come back from a call). The console ends with
# each job's exit status and its result lines, so the call's output_tail alone is enough to read.
set -u
script=$(realpath "$0")
call=${1:?usage: x2_gpu_run.sh 1-34 [OUT]}
out=$(realpath -m "${2:-${OUT:-/tmp/x2_gpu_run}}")
mkdir -p "$out"
if [ -z "${X2_UNDER_TEE:-}" ]; then  # the console also in $out/summary.txt, complete when the call returns
  X2_UNDER_TEE=1 bash "$script" "$call" "$out" 2>&1 | tee "$out/summary.txt"
  exit "${PIPESTATUS[0]}"
fi
cd "$(dirname "$script")/../.."  # the checkout's root
w=/tmp/x2_call$call
rm -rf "$w" && mkdir -p "$w"
# shellcheck source=benchmarks/gpu_run_common.sh
. benchmarks/gpu_run_common.sh
gpu_run_start x2_gpu_run ""
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
smoke=${SMOKE:-0}
if [ "$smoke" != 1 ]; then
  need=2; [ "$call" = 7 ] && [ "${LANES:-2}" = 1 ] && need=1  # call 7's lanes run one after the other on one GPU
  [ "$call" = 22 ] && [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *,pp,* ]] && need=1  # call 22 without its PP part
  { [ "$call" = 23 ] || [ "$call" = 24 ] || [ "$call" = 25 ] || [ "$call" = 26 ] || [ "$call" = 27 ] || [ "$call" = 28 ] || [ "$call" = 29 ] || [ "$call" = 30 ] || [ "$call" = 31 ] || [ "$call" = 32 ] || [ "$call" = 33 ] || [ "$call" = 34 ] || [ "$call" = lanes ]; } && need=1  # (two lanes where two GPUs are, else one after the other)
  "$PYTHON" -c "import torch; n = torch.cuda.device_count(); assert n >= $need, f'{n} GPU(s): this call needs $need'" || exit 1
fi

job() {  # NAME LIMIT_S CMD...: one guarded job, its output in $w/NAME.log, one status line
  local name=$1 limit=$2 start rc left
  shift 2
  if [ -n "${X2_DEADLINE_S:-}" ]; then  # the call's own deadline (s after its start): the report and the archive
    left=$(( t0 + X2_DEADLINE_S - $(date +%s) ))  # must be written before the device tool's timeout ends the call
    if [ "$left" -lt 10 ]; then echo "[x2] $name: not run (X2_DEADLINE_S)"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$w/$name.log" 2>&1
  rc=$?
  echo "[x2] $name: exit $rc$([ $rc -eq 124 ] && echo ' (its guard)') after $(( $(date +%s) - start )) s"
}

script_lane() {  # GPU NAMES...: the scripts $w/NAME.sh in turn on that GPU, each under its guard ${LIMITS[NAME]}
  local gpu=$1 name      # (an associative array the call declares), with $OUT its own folder $w/NAME
  shift
  for name in "$@"; do
    mkdir -p "$w/$name"
    OUT="$w/$name" CUDA_VISIBLE_DEVICES=$gpu job "$name" "${LIMITS[$name]}" bash "$w/$name.sh"
  done
}

on_gpu() {  # GPU NAME LIMIT_S CMD...: a one-GPU job (SMOKE: printed only: these benches need CUDA)
  local gpu=$1
  shift
  if [ "$smoke" = 1 ]; then echo "[x2] would run on GPU $gpu (TRITONLLM_WNA16_MMA_ROWS=${TRITONLLM_WNA16_MMA_ROWS:-unset}): $*"; return; fi
  CUDA_VISIBLE_DEVICES=$gpu job "$@"
}

if [ "$smoke" = 1 ]; then
  tiny_tp=(--model tiny --device cpu --offline 64x16x8 --greedy_steps 8)
  tiny_disagg=(--model tiny --device cpu --prompt_lens 64,256 --output_len 8 --rates 4,8 --seconds 2
               --max_num_tokens 512 --kv_tokens 8192 --transfer_lens 2048,8192 --transfer_repeats 3)
  devices=cpu,cpu
else
  tiny_tp=() tiny_disagg=() devices=cuda:0,cuda:1
fi

case $call in
1)
  TRITONLLM_DISAGG_DEVICES=$devices job tests_2gpu 100 "$PYTHON" -m pytest -v -rfEs -p no:cacheprovider \
    tests/executor/test_disaggregated.py tests/executor/test_kv_pull.py tests/executor/test_device_stream.py
  # PP phases last: the TP phases ran on these machines before, and a phase that fails ends the run.
  job tp_bench 420 "$PYTHON" benchmarks/engine/tp_bench.py \
    --phases greedy_tp1,greedy_tp2,perf_tp1,perf_tp2,greedy_pp2,perf_pp2 --greedy_steps 32 --max_batch_size 256 \
    --offline 128x128x1024,2048x128x256 --phase_timeout 150 --out "$w/tp_bench.json" --results-md "$w/tp_bench.md" \
    "${tiny_tp[@]}"
  grep -E "passed|failed|error" "$w/tests_2gpu.log" | tail -3
  grep -E "^\[tp_bench\] |\"passed\"|FAILED|Error" "$w/tp_bench.log" | head -20
  grep -E "^\[tp_bench rank 0.*(KV pool|decode batch|offline)" "$w/tp_bench.log" | cut -c1-200
  [ -f "$w/tp_bench.md" ] && cp "$w/tp_bench.md" "$out/" && cat "$w/tp_bench.md"
  ;;
2)
  job disagg_bench 330 "$PYTHON" benchmarks/engine/disagg_bench.py --rates 2,4,6 --seconds 30 --drain_timeout 40 \
    --out "$w/disagg.json" --results-md "$w/disagg.md" "${tiny_disagg[@]}"
  grep -E "^\[disagg_bench\]|Error|Traceback" "$w/disagg_bench.log" | cut -c1-400
  grep "^\[load" "$w/disagg_bench.log" | tail -4
  [ -f "$w/disagg.md" ] && cp "$w/disagg.md" "$out/" && cat "$w/disagg.md"
  # The one-GPU pair (their authors' commands: /tmp/notes/vlmstall2.md, int4b1.md, dsdecode2.md).
  (
    on_gpu 0 vlm_offline 75 "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= \
      --out "$w/vlm.json" --results-md "$w/vlm.md"
    on_gpu 0 int4b1 48 "$PYTHON" benchmarks/engine/engine_bench.py --sections executor_decode \
      --executor-decode-batches 1,1 --max-batch-size 8 --quantization int4_wo --out "$w/int4b1.json"
  ) &
  gpu0=$!
  on_gpu 1 ds_decode 48 "$PYTHON" benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode \
    --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out "$w/ds2.json" --results-md "$w/ds2.md"
  wait "$gpu0"
  if [ "$smoke" != 1 ]; then
    grep "^offline\|executor sections\|^\[load" "$w/vlm_offline.log" | cut -c1-1200; cat "$w/vlm.md" 2>/dev/null
    grep -E "^\||load-time|graph|^\[executor_decode\]" "$w/int4b1.log" | cut -c1-600
    grep -E "^\[load|Error|Traceback" "$w/ds_decode.log" | head; tail -2 "$w/ds2.md" 2>/dev/null
    "$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['decode']['eager_step_profile'])" "$w/ds2.json" 2>/dev/null
  fi
  ;;
3)
  E=(benchmarks/engine/engine_bench.py --sections executor_decode --executor-decode-batches 1,64,256 --max-batch-size 256)
  (
    on_gpu 0 eng_bf16 140 "$PYTHON" "${E[@]}" --out "$w/eng_bf16.json"
    TRITONLLM_WNA16_MMA_ROWS=0 on_gpu 0 eng_int4_dense 150 "$PYTHON" "${E[@]}" --quantization int4_wo --out "$w/eng_int4_dense.json"
  ) &
  gpu0=$!
  TRITONLLM_WNA16_MMA_ROWS=1 on_gpu 1 eng_int4_rows 290 "$PYTHON" "${E[@]}" --quantization int4_wo --out "$w/eng_int4_rows.json"
  wait "$gpu0"
  [ "$smoke" = 1 ] || for f in eng_bf16 eng_int4_dense eng_int4_rows; do echo "== $f"; tail -4 "$w/$f.log"; done
  ;;
4)
  T=(benchmarks/engine/throughput_bench.py --dtype fp8 --max-seq-len max --max-batch-size 1024 --max-num-tokens 8192
     --kv-fraction 0.95 --waves 3 --time-budget 530 --engine-seconds 100)
  on_gpu 0 shape_128_4096 545 "$PYTHON" "${T[@]}" --shapes 128/4096 --out "$w/g0.json" &
  gpu0=$!
  on_gpu 1 shape_20000_2000 545 "$PYTHON" "${T[@]}" --shapes 20000/2000 --out "$w/g1.json"
  wait "$gpu0"
  [ "$smoke" = 1 ] || for f in shape_128_4096 shape_20000_2000; do grep -E "^\| [0-9]+/[0-9]+ \| fp8|plateau|Where" "$w/$f.log" | head -6; done
  ;;
5)
  # Session 16's retry after the per-device capture stream (kernels/linear.py capture_stream): the two-GPU tests
  # and disagg_bench failed in calls 1 and 2 on it. The one-GPU benches their guards cut run beside the tests.
  on_gpu 1 ds_decode 150 "$PYTHON" benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode \
    --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out "$w/ds2.json" --results-md "$w/ds2.md" &
  gpu1=$!
  on_gpu 0 eagle_loop 150 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1,8 --sections loop \
    --out "$w/tree.json" --markdown "$w/tree.md" &
  gpu0=$!
  TRITONLLM_DISAGG_DEVICES=$devices job tests_2gpu 100 "$PYTHON" -m pytest -v -rfEs -p no:cacheprovider \
    tests/executor/test_disaggregated.py tests/executor/test_kv_pull.py tests/executor/test_device_stream.py
  grep -E "passed|failed|error" "$w/tests_2gpu.log" | tail -3
  wait "$gpu0" "$gpu1"
  job disagg_bench 270 "$PYTHON" benchmarks/engine/disagg_bench.py --rates 2,6 --seconds 25 --drain_timeout 30 \
    --out "$w/disagg.json" --results-md "$w/disagg.md" "${tiny_disagg[@]}"
  grep -E "^\[disagg_bench\]|Error|Traceback" "$w/disagg_bench.log" | cut -c1-600
  if [ "$smoke" != 1 ]; then
    grep -E "^\[load|Error|Traceback" "$w/ds_decode.log" | tail -3; tail -2 "$w/ds2.md" 2>/dev/null
    "$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['decode']['eager_step_profile'])" "$w/ds2.json" 2>/dev/null
    grep -E "eagle3|oracle|step|Error|Traceback" "$w/eagle_loop.log" | tail -25 | cut -c1-400
  fi
  ;;
6)
  # Session 16's last call (~250 s; X2_LIMIT_S = the call's limit): the GPU tests of the day's fixes (rotary positions
  # read as any layout, the KV pull off both loops) beside each other, then the disaggregated bench at the rate where
  # aggregated decode stalls (6/s), then PP 2 with stage graphs and two steps in flight in what time is left.
  on_gpu 0 gpu_fixes 60 bash -c "$PYTHON -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/executor/test_speculative_eagle3.py;
    $PYTHON -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/kernels/test_kernel_elementwise.py -k rotary;
    $PYTHON -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/engine/test_qwen2_vl.py tests/engine/test_qwen3_vl.py" &
  gpu0=$!
  TRITONLLM_DISAGG_DEVICES=$devices job tests_2gpu 60 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
    tests/executor/test_disaggregated.py tests/executor/test_kv_pull.py
  wait "$gpu0"
  for f in gpu_fixes tests_2gpu; do grep -E "passed|failed|error|FAILED" "$w/$f.log" 2>/dev/null | tail -8; done
  job disagg_bench 165 "$PYTHON" benchmarks/engine/disagg_bench.py --rates 6 --seconds 25 --drain_timeout 30 \
    --out "$w/disagg.json" --results-md "$w/disagg.md" "${tiny_disagg[@]}"
  grep -E "^\[disagg_bench\]|Error|Traceback" "$w/disagg_bench.log" | cut -c1-700
  left=$(( ${X2_LIMIT_S:-280} - ($(date +%s) - t0) - 8 ))
  if [ "$smoke" != 1 ] && [ "$left" -gt 30 ]; then
    TRITONLLM_PP_STEPS_IN_FLIGHT=2 job pp "$left" "$PYTHON" benchmarks/engine/tp_bench.py --phases perf_pp2 --max_batch_size 256 \
      --offline 128x128x1024 --phase_timeout $(( left - 4 )) --out "$w/pp.json" --results-md "$w/pp.md"
    grep -E "graphs vs eager|in flight|decode batch|offline|KV pool|Error|Traceback" "$w/pp.log" | cut -c1-300
  fi
  ;;
7)
  # Session 17's one-GPU work (~250 s; on a single nvidia-h200 the two lanes run one after the other: LANES=1):
  # what sessions 16's helpers built after the last device call, each job its helper's command (/tmp/notes/NAME.md).
  lane0() {
    on_gpu 0 ds3 60 "$PYTHON" benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode \
      --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out "$w/ds3.json" --results-md "$w/ds3.md"
    on_gpu 0 tower 60 "$PYTHON" benchmarks/engine/vlm_bench.py --sections encoder --image-sizes 448 --encoder-batches 32 \
      --encoder-repeats 5 --tower-variants unfused,fused,window-sdpa-efficient,window-sdpa-flash,window-sdpa-math,sdpa-flash,sdpa-efficient \
      --out "$w/tower.json" --results-md "$w/tower.md"
    on_gpu 0 choice_cache 115 "$PYTHON" benchmarks/engine/choice_cache_bench.py --first-off --loads 2 --out "$w/choice_cache.json"
  }
  lane1() {
    on_gpu "${LANE1_GPU:-1}" eagle_loop 60 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1,8 --lengths 3,4 \
      --sections loop --draft-kernels 15 --out "$w/tree.json" --markdown "$w/tree.md"
    on_gpu "${LANE1_GPU:-1}" eagle_fp8_head 90 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 \
      --lengths 4 --sections loop --other-head --out "$w/fp8head.json" --markdown "$w/fp8head.md"
    on_gpu "${LANE1_GPU:-1}" layouts 60 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernel_input_layouts.py
  }
  if [ "${LANES:-2}" = 1 ]; then LANE1_GPU=0; lane0; lane1; else lane0 & gpu0=$!; lane1; wait "$gpu0"; fi
  if [ "$smoke" != 1 ]; then
    grep -E "^\[load.*choices|Error|Traceback" "$w/ds3.log" | tail -3; tail -4 "$w/ds3.md" 2>/dev/null
    grep -E "^encoder|Error" "$w/tower.log" | cut -c1-200
    grep -E "^\[load|^==|^   load|Error|Traceback" "$w/choice_cache.log" | head -20
    grep -E "oracle|EAGLE-3|drafting replay|kernels of one|Error|Traceback" "$w/eagle_loop.log" | tail -20 | cut -c1-300
    tail -12 "$w/eagle_fp8_head.log"; grep -E "passed|failed|error" "$w/layouts.log" | tail -3
  fi
  ;;
8)
  # Session 17's two-GPU checks and PP 2 (~270 s): the KV pull's GPU tests (the allocation-free pull), NIXL on VRAM
  # (the trimmed wheel of tests/gpu_wheels.sh: carry .gpu_wheels, or run after the suite on the same machine), then
  # PP 2 with stage graphs (one step in flight) and with two steps in flight.
  site=/tmp/gpu_test_site
  for t in .gpu_wheels/nixl_cu*_ucx.tar.xz; do [ -f "$t" ] && mkdir -p "$site" && tar xJf "$t" -C "$site"; done
  TRITONLLM_DISAGG_DEVICES=$devices job tests_pull 60 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
    tests/executor/test_kv_pull.py tests/executor/test_disaggregated.py
  TRITONLLM_DISAGG_DEVICES=$devices PYTHONPATH=$PWD:$site job tests_nixl 60 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
    tests/executor/test_kv_transfer_nixl.py
  for f in tests_pull tests_nixl; do grep -E "passed|failed|error|FAILED|skipped" "$w/$f.log" | tail -6; done
  P=(benchmarks/engine/tp_bench.py --phases perf_pp2 --max_batch_size 256 --offline 128x128x1024 --phase_timeout 66)
  job pp_graphs 72 "$PYTHON" "${P[@]}" --out "$w/pp.json" "${tiny_tp[@]}"
  TRITONLLM_PP_STEPS_IN_FLIGHT=2 job pp_in_flight 72 "$PYTHON" "${P[@]}" --out "$w/ppf.json" "${tiny_tp[@]}"
  for f in pp_graphs pp_in_flight; do echo "== $f"; grep -E "graphs vs eager|ready|decode batch|offline|KV pool|Error|Traceback" "$w/$f.log" | cut -c1-300; done
  ;;
9)
  # Session 17's disaggregated bench (~430 s): in one process at 6 and 10 req/s (the hand-off after the
  # allocation-free pull; 10/s for the throughput form of the goal), then each executor in its own process (KV over shm).
  job disagg_bench 250 "$PYTHON" benchmarks/engine/disagg_bench.py --rates 6,10 --seconds 25 --drain_timeout 30 \
    --out "$w/disagg.json" --results-md "$w/disagg.md" "${tiny_disagg[@]}"
  grep -E "^\[disagg_bench\]|Error|Traceback" "$w/disagg_bench.log" | cut -c1-700
  job disagg_proc 200 "$PYTHON" benchmarks/engine/disagg_bench.py --rates 6 --seconds 25 --drain_timeout 30 --sections serve \
    --context_process --out "$w/disagg_proc.json" --results-md "$w/disagg_proc.md" "${tiny_disagg[@]}"
  grep -E "^\[disagg_bench\]|Error|Traceback" "$w/disagg_proc.log" | cut -c1-700
  ;;
10)
  # Session 17 (~300 s): the GPU suite's fixes and the new transports' tests on two GPUs (nixl-cu13 from
  # .gpu_wheels: carry it), then vlm_bench's offline section at encode batches 32 and 8, one per GPU (issue 48).
  site=/tmp/gpu_test_site
  if [ "$smoke" != 1 ]; then
    for t in .gpu_wheels/nixl_cu*_ucx.tar.xz; do [ -f "$t" ] && mkdir -p "$site" && tar xJf "$t" -C "$site"; done
    ls .gpu_wheels/*.whl > /dev/null 2>&1 && "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$site" .gpu_wheels/*.whl
  fi
  TRITONLLM_DISAGG_DEVICES=$devices PYTHONPATH=$PWD:$site job tests_17 150 "$PYTHON" -m pytest -q -rfEs \
    -p no:cacheprovider tests/executor/test_kv_pull.py tests/executor/test_disaggregated.py \
    tests/executor/test_kv_transfer_cuda_ipc.py tests/executor/test_kv_transfer_nixl.py \
    tests/executor/test_join_latency_bench.py tests/kernels/test_moe_decode_tiles.py
  grep -E "passed|failed|error|FAILED" "$w/tests_17.log" | tail -14
  for b in 32 8; do
    on_gpu $(( b == 32 ? 0 : 1 )) vlm$b 200 "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= \
      --encode-batch $b --out "$w/vlm$b.json" --results-md "$w/vlm$b.md" &
  done
  wait
  for b in 32 8; do echo "== vlm$b"; grep -E "^offline|executor sections|^\[load|Error|Traceback" "$w/vlm$b.log" | cut -c1-900; done
  ;;
11)
  # Session 17 (~270 s): eagle9's tree step breakdown (GPU 0) beside dsdecode4's V2-Lite decode fusions (GPU 1),
  # then PP 2 with steps in flight chosen by step cost (ppflight2) beside TP 1 in the same lease.
  on_gpu 0 eagle9 115 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 --nodes 15,16 --lengths 4 \
    --sections verify,loop --kernels 20 --step-kernels 25 --draft-kernels 15 --out "$w/eagle9.json" --markdown "$w/eagle9.md" &
  on_gpu 1 ds4 88 "$PYTHON" benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode \
    --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out "$w/ds4.json" --results-md "$w/ds4.md" &
  wait
  grep -v "^\[load" "$w/eagle9.log" | grep -E "ms vs|step:|tree - decode|oracle|EAGLE-3|Error|Traceback" | head -30
  grep -E "^\[load|Error|Traceback" "$w/ds4.log" | head; tail -3 "$w/ds4.md" 2>/dev/null
  [ -f "$w/ds4.json" ] && "$PYTHON" -c "import json,sys; d=json.load(open(sys.argv[1]))['decode']; print('fusion', d.get('fusion_choice')); print('pdl', d.get('launch_choice'))" "$w/ds4.json"
  job pp 150 "$PYTHON" benchmarks/engine/tp_bench.py --phases perf_tp1,perf_pp2 --max_batch_size 256 \
    --offline 128x128x1024 --phase_timeout 70 --out "$w/pp.json" "${tiny_tp[@]}"
  grep -E "ready|in flight|decode batch|offline|KV pool|Error|Traceback" "$w/pp.log" | cut -c1-300
  ;;
12)
  # Session 17's last call (~350 s). GPU 0: the VLM offline run with the load's objects frozen (vlmstall3), then the
  # tree verify step after the tree rows' attention change (treeattn); GPU 1: V2-Lite decode with the one-launch MLA
  # choice (dsdecode5), then the one-token expert GEMV bench and tests (moefp8); then the cuda_ipc transport served
  # with the context executor in its own process (two GPUs).
  ( on_gpu 0 vlm 98 "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= --encode-batch 32 \
      --also-encode-batches 8 --out "$w/vlm.json" --results-md "$w/vlm.md"
    on_gpu 0 tree 88 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 --nodes 15,16 --lengths 4 \
      --sections verify,loop --oracle-nodes 15 --kernels 15 --step-kernels 20 --out "$w/tree.json" --markdown "$w/tree.md"
    CUDA_VISIBLE_DEVICES=0 job kernel_tests 50 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_tree_attention.py \
      tests/kernels/test_draft_topk.py ) &
  ( on_gpu 1 ds5 85 "$PYTHON" benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode \
      --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out "$w/ds5.json" --results-md "$w/ds5.md"
    CUDA_VISIBLE_DEVICES=1 BUDGET_S=120 job moe_gemv 130 bash benchmarks/kernels/moe_gemv_gpu_run.sh "$w/moe_gemv" ) &
  wait
  echo "== vlm"; grep -E "^offline|collector|gc|Error|Traceback" "$w/vlm.log" | cut -c1-700
  echo "== tree"; grep -v "^\[load" "$w/tree.log" | grep -E "ms vs|step:|tree - decode|_paged|_rotary|_merge|oracle L|EAGLE-3 L|Error|Traceback" | head -30
  echo "== kernel tests"; grep -E "passed|failed|FAILED|Error" "$w/kernel_tests.log" | tail -6
  echo "== ds5"; grep -E "Error|Traceback" "$w/ds5.log" | head -3; tail -3 "$w/ds5.md" 2>/dev/null
  [ -f "$w/ds5.json" ] && "$PYTHON" -c "import json,sys; d=json.load(open(sys.argv[1]))['decode']; print('fusion', d.get('fusion_choice')); print('pdl', d.get('launch_choice'))" "$w/ds5.json"
  echo "== moe_gemv"; grep -vi warning "$w/moe_gemv.log" | tail -30
  job disagg_ipc 210 "$PYTHON" benchmarks/engine/disagg_bench.py --context_process --kv_transfer cuda_ipc --sections serve \
    --modes disaggregated --rates 6 --seconds 25 --drain_timeout 30 --out "$w/disagg_ipc.json" --results-md "$w/disagg_ipc.md" \
    "${tiny_disagg[@]}"
  grep -E "^\[disagg_bench\]|Error|Traceback" "$w/disagg_ipc.log" | cut -c1-700
  ;;
13)
  # Session 18 (~470 s). GPU 0: issue 48's tower-priority A/B, vlm_bench offline three times (image = the tower
  # below the executor's priority, image_equal_priority = equal), the tree verify step with PDL off (issue 56:
  # per-kernel times without the predecessor's tail), the FP8 cross pool (issue 49); GPU 1: the expert GEMV
  # in the engine (issue 53: Qwen3-30B-A3B batch-1, block-FP8 and bf16).
  ( for r in 1 2 3; do
      on_gpu 0 vlm_r$r 110 "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= --encode-batch 32 \
        --out "$w/vlm_r$r.json" --results-md "$w/vlm.md"
    done
    TRITONLLM_PDL=0 on_gpu 0 tree 95 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 --nodes 15,16 \
      --lengths 4 --sections verify,loop --oracle-nodes 15 --kernels 15 --step-kernels 20 --out "$w/tree.json" --markdown "$w/tree.md"
    on_gpu 0 encdec 125 "$PYTHON" benchmarks/engine/encdec_bench.py --sections whisper,t5 --hf-whisper-batches "" \
      --hf-t5-batches "" --cross-kv-cache-dtype fp8,auto --out "$w/encdec.json" --results-md "$w/encdec.md" ) &
  CUDA_VISIBLE_DEVICES=1 BUDGET_S=340 job moe_gemv 360 bash benchmarks/kernels/moe_gemv_gpu_run.sh "$w/moe_gemv" &
  wait
  for r in 1 2 3; do echo "== vlm_r$r"; grep -E "^offline|Error|Traceback" "$w/vlm_r$r.log" | cut -c1-700; done
  echo "== tree"; grep -v "^\[load" "$w/tree.log" | grep -E "ms vs|step:|tree - decode|_paged|_rotary|_merge|oracle L|EAGLE-3 L|Error|Traceback" | head -30
  echo "== encdec"; grep -vi warning "$w/encdec.log" | grep -E "whisper|t5|audio|tok/s|Error|Traceback" | head -24
  echo "== moe_gemv"; grep -vi warning "$w/moe_gemv.log" | tail -30
  ;;
14)
  # Session 18's second call (~370 s). Two GPUs: pp50's PP 2 runs (TP 1, the cost-balanced default split 17,15 with
  # deferred send waits, the even split 16,16, 17,15 with the waits in the step, 18,14). Then GPU 0: int4rows52's
  # W4A16 GEMM sweep (M 64-512, Llama-3.1-8B products) and its kernel tests; GPU 1: vlm48's FP8-tower and
  # first-full A/B, twice.
  W=$w
  mkdir -p $W/pp50 $W/int4rows52
  P=(benchmarks/engine/tp_bench.py --max_batch_size 256 --offline 128x128x1024 --perf_sections offline)
  job pp_balanced 85 "$PYTHON" "${P[@]}" --phases perf_tp1,perf_pp2 --phase_timeout 38 --out $W/pp50/balanced.json --results-md $W/pp50/pp50.md
  job pp_even 40 "$PYTHON" "${P[@]}" --phases perf_pp2 --pp_layers 16,16 --phase_timeout 32 --out $W/pp50/even.json
  TRITONLLM_PP_DEFER_SEND_WAITS=0 job pp_waits 40 "$PYTHON" "${P[@]}" --phases perf_pp2 --phase_timeout 32 --out $W/pp50/waits.json
  job pp_18_14 40 "$PYTHON" "${P[@]}" --phases perf_pp2 --pp_layers 18,14 --phase_timeout 32 --out $W/pp50/18_14.json
  echo "== pp50"; grep -hE "^\[tp_bench.*(: [0-9]+ rank|offline \(|done in|failed)|Error|Traceback" $w/pp_balanced.log $w/pp_even.log \
    $w/pp_waits.log $w/pp_18_14.log | cut -c1-400
  ( on_gpu 0 int4_sweep 110 "$PYTHON" benchmarks/quantization/wna16_gemm_sweep.py --budget-s 85 --out $W/int4rows52/sweep.json \
      --md $W/int4rows52/sweep.md
    CUDA_VISIBLE_DEVICES=0 job int4_tests 45 "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/kernels/test_wna16_mma_gemm.py \
      -k "timed_tiling or sweeps or dispatch" ) &
  ( on_gpu 1 vlm48_r1 115 "$PYTHON" benchmarks/engine/vlm_bench.py --sections encoder,offline --image-sizes 448 \
      --encoder-batches 32 --encoder-repeats 3 --tower-variants fp8 --hf-batches= --encode-batch 32 --also-encode-batches 32 \
      --offline-variants fp8-tower,first-full,fp8-tower+first-full --out "$W/vlm48_r1.json" --results-md "$W/vlm48.md"
    on_gpu 1 vlm48_r2 95 "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= --encode-batch 32 \
      --also-encode-batches 32 --offline-variants fp8-tower,first-full,fp8-tower+first-full \
      --out "$W/vlm48_r2.json" --results-md "$W/vlm48.md" ) &
  wait
  echo "== int4rows52"; cat $W/int4rows52/sweep.md 2>/dev/null; grep "^   " $w/int4_sweep.log | head -60; tail -3 $w/int4_tests.log
  grep -E "compiled in|budget|Error|Traceback" $w/int4_sweep.log | head -8
  echo "== vlm48"; grep -E "^offline|^encoder|failed|Error|Traceback" $w/vlm48_r1.log $w/vlm48_r2.log | cut -c1-600
  ;;
15)
  # Session 18's third call (~450 s). Two GPUs: pp50 (TP 1 and PP 2 at the default split, then 14,18). Then GPU 0:
  # eagle56 (tree attention and EAGLE-3 GPU tests, the tree rows' attention bench, tree_bench with PDL off and on),
  # int4rows52's bf16 reference; GPU 1: vlm48's stall A/B, int4rows52's second sweep and INT4 engine decode, then
  # the GPU tests of the files this session changed.
  W=$w
  mkdir -p $W/pp50 $W/int4rows52b
  P=(benchmarks/engine/tp_bench.py --max_batch_size 256 --offline 128x128x1024 --perf_sections offline)
  job pp_default 110 "$PYTHON" "${P[@]}" --phases perf_tp1,perf_pp2 --phase_timeout 72 --out $W/pp50/default.json --results-md $W/pp50/pp50.md
  job pp_14_18 30 "$PYTHON" "${P[@]}" --phases perf_pp2 --pp_layers 14,18 --phase_timeout 27 --out $W/pp50/14_18.json
  echo "== pp50"; for f in pp_default pp_14_18; do echo "-- $f"; grep -hE "^\[tp_bench.*(: [0-9]+ rank|offline \(|done in|failed)|Error|Traceback" $w/$f.log | cut -c1-420; done
  ( CUDA_VISIBLE_DEVICES=0 job eagle56_tests 45 "$PYTHON" -m pytest -x -q -p no:cacheprovider tests/kernels/test_tree_attention.py \
      "tests/executor/test_speculative_eagle3.py::test_executor_decoding_mode_eagle_on_cuda_graphs"
    on_gpu 0 eagle56_attn 35 "$PYTHON" benchmarks/kernels/tree_attention_bench.py --nodes 15,16,32,64 \
      --out "$W/eagle56_attn.json" --markdown "$W/eagle56_attn.md"
    TRITONLLM_PDL=0 on_gpu 0 eagle56_tree_pdl0 90 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 --nodes 15,16 \
      --lengths 4 --sections verify,loop --oracle-nodes 15 --kernels 15 --step-kernels 20 --draft-kernels 15 \
      --out "$W/eagle56_tree_pdl0.json" --markdown "$W/eagle56_tree_pdl0.md"
    on_gpu 0 eagle56_tree_pdl1 75 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 --lengths 4 --sections loop \
      --oracle-nodes 15 --out "$W/eagle56_tree_pdl1.json" --markdown "$W/eagle56_tree_pdl1.md"
    on_gpu 0 int4_eng_bf16 60 "$PYTHON" benchmarks/engine/engine_bench.py --sections executor_decode --executor-decode-batches 64,256 \
      --max-batch-size 256 --out $W/int4rows52b/eng_bf16.json ) &
  ( on_gpu 1 vlm48_r3 100 "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= --encode-batch 32 \
      --also-encode-batches 32 --offline-variants flash-attn+first-odd,first-odd,fp8-tower,fp8-tower,flash-attn,fp8-tower+flash-attn \
      --out "$W/vlm48_r3.json" --results-md "$W/vlm48_r3.md"
    on_gpu 1 int4_sweep2 40 "$PYTHON" benchmarks/quantization/wna16_gemm_sweep.py --rows 256,64 --budget-s 25 \
      --out $W/int4rows52b/sweep2.json --md $W/int4rows52b/sweep2.md
    on_gpu 1 int4_eng 95 "$PYTHON" benchmarks/engine/engine_bench.py --sections executor_decode --executor-decode-batches 64,256 \
      --max-batch-size 256 --quantization int4_wo --out $W/int4rows52b/eng_int4.json
    CUDA_VISIBLE_DEVICES=1 job tests_18 70 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_wna16_mma_gemm.py \
      tests/kernels/test_wna16_mma_rows.py tests/executor/test_kv_transfer_cuda_ipc.py tests/engine/test_qwen2_vl.py ) &
  wait
  echo "== eagle56"; tail -3 $w/eagle56_tests.log; cat $W/eagle56_attn.md $W/eagle56_tree_pdl0.md $W/eagle56_tree_pdl1.md 2>/dev/null
  grep -E "host phases|oracle L|EAGLE-3 L|ms vs|tree - decode|Error|Traceback" $w/eagle56_tree_pdl0.log $w/eagle56_tree_pdl1.log | cut -c1-400
  echo "== vlm48"; grep -E "^offline image[^ ]*:|failed|Error|Traceback" $w/vlm48_r3.log | cut -c1-300; grep -E "^\| " $W/vlm48_r3.md | cut -c1-300
  echo "== int4rows52"; cat $W/int4rows52b/sweep2.md 2>/dev/null; tail -6 $w/int4_eng.log; tail -6 $w/int4_eng_bf16.log
  echo "== tests_18"; grep -E "passed|failed|FAILED|Error" $w/tests_18.log | tail -8
  ;;
16)
  # Session 18's last call (~200 s): the GPU tests of what changed after call 15. GPU 0: EAGLE-3 on CUDA graphs with
  # the drafts kept on the device and the tree attention kernels, then tree_bench's forced loop (do the static-tree
  # rows reproduce their continuation again with the short-step tiling opt-in?); GPU 1: the fused W4A16 GEMM and rows
  # kernels with the load-time timing, and the Qwen2.5-VL tests (the FP8 tower on CUDA).
  ( CUDA_VISIBLE_DEVICES=0 job tests_spec 130 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/executor/test_speculative_eagle3.py \
      tests/kernels/test_tree_attention.py
    on_gpu 0 tree_loop 60 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 --lengths 4 --sections loop \
      --oracle-nodes 15 --out "$w/tree_loop.json" --markdown "$w/tree_loop.md" ) &
  CUDA_VISIBLE_DEVICES=1 job tests_int4_vlm 150 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_wna16_mma_gemm.py \
    tests/kernels/test_wna16_mma_rows.py tests/engine/test_qwen2_vl.py &
  wait
  for t in tests_spec tests_int4_vlm; do echo "== $t"; grep -E "passed|failed|FAILED|Error" $w/$t.log | tail -8; done
  echo "== tree_loop"; cat $w/tree_loop.md 2>/dev/null; grep -E "oracle L|EAGLE-3 L|Error|Traceback" $w/tree_loop.log | cut -c1-300
  ;;
17)
  # Session 19 (~250 s at most): what dropped the static-tree forced loop at 16 nodes (17-token steps, the 32-token
  # bucket: measured L 3.80 at call 13, 2.79 / 2.97 at calls 15 / 16, the short-step tiling off at 16) while the
  # 15-node oracle (16 tokens) kept 3.80? The oracle drafts nothing on the device and fell as far as EAGLE-3, and only
  # products of 17+ rows go through the load-time choice of kernels/wide_rows.py (timed: it may differ between
  # loads), so each GPU runs the loop with one fixed choice, TRITONLLM_WIDE_ROWS=0 (cuBLAS) on GPU 0 and =1 (the
  # skinny kernel) on GPU 1, then again with the drafted ids read at once (TRITONLLM_DEVICE_DRAFTS=0). Then the
  # short-step tiling against the reference on the GPU (test_tree_attention.py's "short" cases).
  for lane in 0 1; do
    ( for drafts in 1 0; do
        on_gpu $lane loop_wide${lane}_drafts$drafts 60 env TRITONLLM_WIDE_ROWS=$lane TRITONLLM_DEVICE_DRAFTS=$drafts \
          "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 --lengths 4 --sections loop \
          --oracle-nodes 15 --out "$w/loop_wide${lane}_drafts$drafts.json" --markdown "$w/loop_wide${lane}_drafts$drafts.md"
      done ) &
  done
  wait
  CUDA_VISIBLE_DEVICES=0 job tests_tree_attention 130 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
    tests/kernels/test_tree_attention.py
  echo "== tests_tree_attention"; grep -E "passed|failed|FAILED|Error" $w/tests_tree_attention.log | tail -8
  for md in "$w"/loop_wide*.md; do [ -f "$md" ] && { echo "== $md"; cat "$md"; }; done
  ;;
18)
  # Session 20's first bench call (~470 s). GPU 0: the executor tests that failed in the session's GPU suite (one block
  # left after test_memory_profile's pools: 5f659cf collects before sizing), in the suite's order on one worker under
  # its 0.04 cap, and the FP8 tower test at its new tolerance; GPU 1: call 17's forced loop with each fixed choice of
  # kernels/wide_rows.py (device drafts on). Then PP 2 beside TP 1 after host50's cuts (two GPUs). Then the INT4
  # engine at 64 / 256 requests beside bf16 (GPU 0 bf16, GPU 1 INT4).
  ( CUDA_VISIBLE_DEVICES=0 TRITONLLM_GPU_MEMORY_FRACTION=0.04 job tests_pool 170 "$PYTHON" -m pytest -v -rfEs -p no:cacheprovider \
      tests/executor/test_memory_profile.py tests/executor/test_overlap.py tests/executor/test_prompt_tables.py \
      tests/executor/test_sliding_window_executor.py
    CUDA_VISIBLE_DEVICES=0 TRITONLLM_GPU_MEMORY_FRACTION=0.03 job tests_tower 80 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
      "tests/engine/test_qwen2_vl.py::test_cuda_fp8_tower_matches_the_reference_scheme" ) &
  ( for lane in 0 1; do
      on_gpu 1 loop_wide$lane 75 env TRITONLLM_WIDE_ROWS=$lane "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 \
        --batches 1 --lengths 4 --sections loop --oracle-nodes 15 --out "$w/loop_wide$lane.json" --markdown "$w/loop_wide$lane.md"
    done ) &
  wait
  echo "== tests_pool"; grep -E "passed|failed|FAILED|Error" $w/tests_pool.log | tail -12
  echo "== tests_tower"; grep -E "passed|failed|FAILED|Error|assert" $w/tests_tower.log | tail -6
  for md in "$w"/loop_wide*.md; do [ -f "$md" ] && { echo "== $md"; cat "$md"; }; done
  grep -hE "\-> (kernel|library)" $w/loop_wide*.log | sort | uniq -c | head -20
  job pp 120 "$PYTHON" benchmarks/engine/tp_bench.py --phases perf_tp1,perf_pp2 --max_batch_size 256 \
    --offline 128x128x1024 --perf_sections offline --phase_timeout 72 --out "$w/pp.json" --results-md "$w/pp.md"
  echo "== pp"; grep -hE "^\[tp_bench.*(: [0-9]+ rank|offline \(|done in|failed)|Error|Traceback" $w/pp.log | cut -c1-420
  E=(benchmarks/engine/engine_bench.py --sections executor_decode --executor-decode-batches 64,256 --max-batch-size 256)
  on_gpu 0 int4_bf16 100 "$PYTHON" "${E[@]}" --out "$w/int4_bf16.json" &
  on_gpu 1 int4_eng 140 "$PYTHON" "${E[@]}" --quantization int4_wo --out "$w/int4_eng.json" &
  wait
  echo "== int4"; tail -6 $w/int4_bf16.log; tail -6 $w/int4_eng.log
  ;;
19)
  # Session 20's planned call for the next session (~300 s): issue 50's sampling on the last stage (pplast20, CPU-tested
  # only): the greedy check over NCCL (tiny, PP 2 == TP 1 with the new path) and PP 2 with it off then on (the first
  # run pays the cold compile); then GPU 0: the 64-node tree verify step with PDL off (the share of its product chain,
  # benchmarks/results/speculative.md session 20), GPU 1: the executor tests of session 20's changes.
  P=(benchmarks/engine/tp_bench.py --max_batch_size 256 --offline 128x128x1024 --perf_sections offline --phases perf_pp2)
  job greedy_last 70 "$PYTHON" benchmarks/engine/tp_bench.py --model tiny --device cuda --phases greedy_tp1,greedy_pp2 \
    --greedy_steps 16 --phase_timeout 30 --out "$w/greedy_last.json" "${tiny_tp[@]}"
  TRITONLLM_PP_SAMPLE_ON_LAST_STAGE=0 job pp_off 60 "$PYTHON" "${P[@]}" --phase_timeout 55 --out "$w/pp_off.json" \
    "${tiny_tp[@]}"
  job pp_on 40 "$PYTHON" "${P[@]}" --phase_timeout 35 --out "$w/pp_on.json" "${tiny_tp[@]}"
  echo "== sampling on the last stage"; grep -hE "passed|sampled_on_last_stage|offline \(|Error|Traceback" \
    $w/greedy_last.log $w/pp_off.log $w/pp_on.log | cut -c1-400
  TRITONLLM_PDL=0 on_gpu 0 tree64_pdl0 90 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 \
    --nodes 64,16 --sections verify --kernels 12 --out "$w/tree64_pdl0.json" --markdown "$w/tree64_pdl0.md" &
  CUDA_VISIBLE_DEVICES=1 TRITONLLM_GPU_MEMORY_FRACTION=0.05 job tests_20 150 "$PYTHON" -m pytest -q -rfEs \
    -p no:cacheprovider tests/executor/test_executor_release.py tests/executor/test_memory_profile.py \
    tests/executor/test_disaggregated.py tests/executor/test_sampler.py &
  wait
  for md in "$w"/tree64_pdl0.md; do [ -f "$md" ] && cat "$md"; done
  echo "== tests_20"; grep -E "passed|failed|FAILED|Error" $w/tests_20.log | tail -8
  ;;
20|21)
  # 20: session 21's first bench call (~450 s; cut at 331 s when the session's device time ran out, after the PP part
  # and the first Llama rows). 21: what it lost, for the next session (~330 s): the PP part replaced by traces of the
  # two splits. Then GPU 0: tree21's tree verify runs
  # and the tree attention tests, then Llama-3.1-8B batch-1
  # decode with the one-row tiling choice off and on (28f365c), the same for DeepSeek-V2-Lite; GPU 1: the VLM offline run's encode queue under py-spy
  # (--native: a stalled run's worker thread shows whether it waits for the GIL or in the driver's launch;
  # benchmarks/speedscope_threads.py reads it), then Qwen3-30B-A3B batch-1 decode with the one-row choice off and on.
  # pp21 (issue 50): call 20: TP 1 and PP 2 in one process (the same lease's ratio), PP 2's two ranks traced over 20
  # steady decode-only steps (tp_bench --trace_steps: host waits, each stream's busy time and idle gaps by cause), the
  # splits 17,15 and 15,17 (the last stage now also runs the head and the argmax); call 21: both splits traced.
  P=(benchmarks/engine/tp_bench.py --max_batch_size 256 --offline 128x128x1024 --perf_sections offline)
  mkdir -p "$w/traces"
  if [ "$call" = 20 ]; then
    job pp_ratio 92 "$PYTHON" "${P[@]}" --phases perf_tp1,perf_pp2 --phase_timeout 70 --out "$w/pp_ratio.json" "${tiny_tp[@]}"
    job pp_trace 36 "$PYTHON" "${P[@]}" --phases perf_pp2 --phase_timeout 33 --trace_steps 20 --trace_skip 60 --trace_warm 5 \
      --trace_dir "$w/traces" --out "$w/pp_trace.json" "${tiny_tp[@]}"
    for split in 17,15 15,17; do
      job "pp_split_${split/,/_}" 26 "$PYTHON" "${P[@]}" --phases perf_pp2 --pp_layers $split --phase_timeout 24 \
        --out "$w/pp_split_${split/,/_}.json" "${tiny_tp[@]}"
    done
  else
    for split in 17,15 15,17; do
      mkdir -p "$w/traces/${split/,/_}"
      job "pp_split_${split/,/_}" 36 "$PYTHON" "${P[@]}" --phases perf_pp2 --pp_layers $split --phase_timeout 33 \
        --trace_steps 20 --trace_skip 60 --trace_warm 5 --trace_dir "$w/traces/${split/,/_}" \
        --out "$w/pp_split_${split/,/_}.json" "${tiny_tp[@]}"
    done
  fi
  echo "== pp"; grep -hE "^\[tp_bench.*(: [0-9]+ rank|offline \(|done in|failed|trace:)|^rank|^  [a-z]|^loop|Error|Traceback" \
    $w/pp_*.log | cut -c1-600
  # tree21 (issue 56): the 64-node tree verify with the mask as bytes and the old 8 key splits, then main's defaults
  # (the mask as bits, splits up to one wave); both with PDL off as in call 19; then the tree attention tests.
  TV=(benchmarks/speculative/tree_bench.py --dtypes bf16 --batches 1 --nodes 64,16 --sections verify --kernels 12 --repeat 50)
  pyspy=""
  if [ "$smoke" != 1 ]; then
    "$PYTHON" -m pip install -q --no-deps --target /tmp/pyspy .carry/py_spy-*.whl > /dev/null 2>&1 && pyspy=/tmp/pyspy/bin/py-spy
  fi
  ( TRITONLLM_PDL=0 TRITONLLM_TREE_BITS=0 TRITONLLM_SHORT_STEP_SPLITS=8 on_gpu 0 tree21_off 45 "$PYTHON" "${TV[@]}" \
      --out "$w/tree21_off.json" --markdown "$w/tree21_off.md"
    TRITONLLM_PDL=0 on_gpu 0 tree21_on 45 "$PYTHON" "${TV[@]}" --out "$w/tree21_on.json" --markdown "$w/tree21_on.md"
    CUDA_VISIBLE_DEVICES=0 job tree21_tests 40 "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/kernels/test_tree_attention.py
    for one in 0 1; do
      TRITONLLM_ONE_ROW_CHOICE=$one on_gpu 0 llama_b1_one$one 90 "$PYTHON" benchmarks/engine/engine_bench.py \
        --sections decode --max-batch-size 16 --out "$w/llama_b1_one$one.json"
    done
    for one in 0 1; do  # DeepSeek-V2-Lite (issue 55): its 2048-wide projections, as Qwen3-30B-A3B's
      TRITONLLM_ONE_ROW_CHOICE=$one on_gpu 0 v2lite_b1_one$one 90 "$PYTHON" benchmarks/engine/engine_bench.py \
        --model deepseek_v2_lite --sections bandwidth,decode --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 \
        --out "$w/v2lite_b1_one$one.json"
    done ) &
  ( if [ -n "$pyspy" ]; then
      on_gpu 1 vlm_spy 170 "$pyspy" record --native --threads --idle --rate 100 --format speedscope -o "$w/vlm_spy.json" \
        -- "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= --encode-batch 32 \
        --also-encode-batches 32,32,32,32,32,32 --out "$w/vlm_spy_bench.json"
      "$PYTHON" benchmarks/speedscope_threads.py "$w/vlm_spy.json" --threads "image_encode_queue" --inside _launch \
        --out "$w/vlm_spy_threads.json" > "$w/vlm_spy_threads.txt" 2>&1
    fi
    for one in 0 1; do
      TRITONLLM_ONE_ROW_CHOICE=$one on_gpu 1 qwen3_b1_one$one 100 "$PYTHON" benchmarks/engine/engine_bench.py \
        --model qwen3_30b_a3b --max-batch-size 16 --sections decode --out "$w/qwen3_b1_one$one.json"
    done ) &
  wait
  for name in llama_b1_one0 llama_b1_one1 v2lite_b1_one0 v2lite_b1_one1 qwen3_b1_one0 qwen3_b1_one1; do
    echo "== $name"; grep -hE "^\| batch-1|Error|Traceback" "$w/$name.log" | cut -c1-300
  done
  for md in "$w"/tree21_*.md; do [ -f "$md" ] && { echo "== $md"; tail -4 "$md"; }; done
  grep -h "paged_att" $w/tree21_off.log $w/tree21_on.log 2>/dev/null | cut -c1-200
  echo "== tree21_tests"; grep -E "passed|failed|FAILED|Error" $w/tree21_tests.log | tail -6
  echo "== vlm_spy"; grep -E "^offline image" "$w/vlm_spy.log" | cut -c1-260; cat "$w/vlm_spy_threads.txt" 2>/dev/null | head -80
  # the raw chrome traces beside the archive (each under the device tool's 16 MiB), not inside it
  [ "$call" = 20 ] && for f in "$w"/traces/*.json.gz; do [ -f "$f" ] && [ "$(stat -c %s "$f")" -lt 15000000 ] && cp "$f" "$out/"; done
  find "$w/traces" -name "*.txt" -exec cp --backup=numbered {} "$w/" \; 2>/dev/null
  rm -rf "/tmp/x2_call${call}_traces" && mv "$w/traces" "/tmp/x2_call${call}_traces"
  ;;
22)
  # Session 22 (~400 s, guard 540). ONLY: the parts, comma-separated, of pp (two GPUs), vlm, sq, enc, tree (default
  # pp,vlm,tree; "both" = vlm,tree); with one GPU the lanes run one after the other on it. First, both GPUs: the PP 2 trace with each GPU's SM clock and power sampled
  # every 100 ms (issue 50: in call 21 rank 1's kernels ran 1.33x longer than rank 0's same kernels; a GPU busy
  # 98% of the time against 67% may be held at a lower clock by its power limit).
  only=${ONLY:-pp,vlm,tree}
  [ "$only" = both ] && only=vlm,tree
  has() { [[ ",$only," == *,$1,* ]]; }
  lane1_gpu=1
  [ "$smoke" = 1 ] || [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ] && lane1_gpu=0
  P=(benchmarks/engine/tp_bench.py --max_batch_size 256 --offline 128x128x1024)
  mkdir -p "$w/traces"
  if has pp; then
  if [ "$smoke" != 1 ]; then
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu \
      --format=csv,noheader -lms 100 > "$w/pp_clocks.csv" 2>&1 &
    smi=$!
    # (apart: a field name this driver does not know must not cost the clocks)
    nvidia-smi --query-gpu=index,clocks_throttle_reasons.active --format=csv,noheader -lms 100 > "$w/pp_reasons.csv" 2>&1 &
    smi="$smi $!"
  fi
  job pp_trace 170 "$PYTHON" "${P[@]}" --phases perf_pp2 --phase_timeout 160 --trace_steps 20 --trace_skip 60 --trace_warm 5 \
    --trace_dir "$w/traces" --out "$w/pp_trace.json" "${tiny_tp[@]}"
  [ "$smoke" != 1 ] && kill $smi 2>/dev/null
  [ -f "$w/pp_reasons.csv" ] && { echo "clock event reasons (samples):"; sort "$w/pp_reasons.csv" | uniq -c | sort -rn | head -8; }
  echo "== pp"; grep -hE "^\[tp_bench.*(offline \(|done in|failed)|^rank|^  (device|top)|^loop|Error|Traceback" \
    "$w/pp_trace.log" | cut -c1-400
  [ -f "$w/pp_clocks.csv" ] && "$PYTHON" - "$w/pp_clocks.csv" <<'PY'
import collections, sys
rows = collections.defaultdict(list)  # GPU -> [(sm MHz, W, temperature)] while busy (> 200 W)
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 6 or not f[2].split()[0].isdigit():
        continue
    try:
        watts = float(f[4].split()[0])
    except ValueError:
        continue
    if watts > 200:
        rows[f[1]].append((int(f[2].split()[0]), watts, f[5]))
for gpu, r in sorted(rows.items()):
    sm = sorted(x[0] for x in r); w = sorted(x[1] for x in r)
    print(f"GPU {gpu}: {len(r)} samples over 200 W: SM MHz median {sm[len(sm) // 2]} (min {sm[0]}, max {sm[-1]}), "
          f"power median {w[len(w) // 2]:.0f} W (max {w[-1]:.0f}), temperature C {collections.Counter(x[2] for x in r).most_common(3)}")
PY
  fi
  # Then two lanes. GPU 0 (issue 48): the tower-graph tests, then the offline section with the tower's forwards
  # replayed from CUDA graphs (engine/vision/tower_graphs.py, opt-in) twice against eager, and FP8 (VLM_VARIANTS
  # sets the variants; ONLY=both: the vlm part then the tree part on one GPU).
  # sq (issue 52): SmoothQuant W8A8 INT8 against bf16, 128/128 offline with 1,024 requests and batch-1 decode, one
  # process each (never measured on a GPU; goal 128/128 >= 1.3x bf16).
  ( if has vlm; then
      CUDA_VISIBLE_DEVICES=0 job vlm_graph_tests 150 "$PYTHON" -m pytest -q -x -p no:cacheprovider -rfEs \
        tests/engine/test_qwen2_vl.py tests/engine/test_encode_queue_staging.py tests/engine/test_qwen3_vl.py tests/engine/test_tower_layout.py
      on_gpu 0 vlm_graphs 260 "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= --encode-batch 32 \
        --also-encode-batches 32 --offline-variants "${VLM_VARIANTS:-tower-graphs,tower-graphs,fp8-tower,fp8-tower+tower-graphs}" \
        ${VLM_EXTRA:-} --out "$w/vlm_graphs.json" --results-md "$w/vlm_graphs.md"
    fi
    if has sq; then  # first the int8 skinny kernel's GPU tests and its per-shape bench (helper sq8, /tmp/notes/sq8.md)
      CUDA_VISIBLE_DEVICES=0 job sq_tests 80 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_int8_sq.py
      on_gpu 0 sq_kernels 70 "$PYTHON" -u benchmarks/quantization/int8_skinny_bench.py --out "$w/int8_skinny.md" \
        --json "$w/int8_skinny.json"
      for q in bf16 int8_sq; do
        on_gpu 0 "sq_$q" 150 "$PYTHON" benchmarks/engine/engine_bench.py --sections decode,offline --offline 128x128x1024 \
          --max-batch-size 512 $([ "$q" = int8_sq ] && echo --quantization int8_sq) --out "$w/sq_$q.json" \
          --results-md "$w/sq_$q.md"
      done
    fi ) &
  lane0=$!
  # GPU 1 (issue 56): tree verify at 16/32/64 nodes and batches 1/8/32, then the forced loop at lengths 3/4/5, in
  # bf16 and with FP8 weights ("the same with FP8 weights": last measured before the drafts stayed on the device).
  [ "$lane1_gpu" = 0 ] && wait "$lane0"  # (one GPU: the tree part after the others)
  has tree && on_gpu $lane1_gpu tree22 330 "$PYTHON" benchmarks/speculative/tree_bench.py --dtypes bf16,fp8 --batches 1,8,32 \
    --nodes 16,32,64 --sections verify,loop --lengths 3,4,5 --out "$w/tree22.json" --markdown "$w/tree22.md"
  if has enc; then  # issue 49 (GPU 1 after tree): FP8 layer weights in encoder-decoder engines (/tmp/notes/encfp8.md)
    CUDA_VISIBLE_DEVICES=$lane1_gpu job enc_tests 70 "$PYTHON" -m pytest -q -rfEs -s -p no:cacheprovider -m gpu \
      tests/engine/test_encoder_decoder_fp8_weights.py
    on_gpu $lane1_gpu enc_bench 130 "$PYTHON" -u benchmarks/engine/encdec_bench.py --sections t5,whisper --hf-whisper-batches "" \
      --hf-t5-batches "" --cross-kv-cache-dtype fp8 --quantization none,fp8 --out "$w/enc_bench.json" \
      --results-md "$w/enc_bench.md"
  fi
  wait
  echo "== vlm_graph_tests"; grep -E "passed|failed|FAILED|Error" "$w/vlm_graph_tests.log" | tail -6
  echo "== vlm_graphs"; grep -E "^offline |^\[load|Error|Traceback|failed" "$w/vlm_graphs.log" | grep -v synchronizing | cut -c1-300
  grep -E "synchronizing calls" "$w/vlm_graphs.log" | cut -c1-1500
  [ -f "$w/vlm_graphs.md" ] && grep -E "^\||replayed" "$w/vlm_graphs.md" | cut -c1-400
  echo "== tree22"; grep -E "Error|Traceback|^\[load" "$w/tree22.log" | head -8
  [ -f "$w/tree22.md" ] && cat "$w/tree22.md"
  [ -f "$w/enc_tests.log" ] && { echo "== enc_tests"; grep -E "CUDA: FP8|passed|failed|Error|assert" "$w/enc_tests.log" | tail -15; }
  [ -f "$w/enc_bench.log" ] && { echo "== enc_bench"; grep -vi warning "$w/enc_bench.log" | grep -E "whisper|t5|audio|tok/s|Error|Traceback|run:" | cut -c1-400 | head -24; }
  [ -f "$w/sq_tests.log" ] && { echo "== sq_tests"; grep -E "passed|failed|FAILED|Error" "$w/sq_tests.log" | tail -6; }
  [ -f "$w/sq_kernels.log" ] && { echo "== sq_kernels"; grep -v Warning "$w/sq_kernels.log" | tail -25 | cut -c1-300; }
  for q in bf16 int8_sq; do [ -f "$w/sq_$q.log" ] && { echo "== sq_$q"; grep -E "^\| (batch-1|offline|\.\.\.)|Error|Traceback" "$w/sq_$q.log" | cut -c1-300; }; done
  ;;
23)
  # Session 23's middle call (~300 s, two lanes; one GPU: one after the other). GPU 0: the int8_sq GPU tests after
  # ab59289 / fde908a (never passed on a GPU), the sampling kernels' variant test, helper sq9's int8 GEMM tests and
  # first sweep (/tmp/notes/sq9.md), then gpt-oss-20b's shape with bf16 experts (batch-1 decode). GPU 1: helper w4a8's
  # W4A8 sweep and tests (/tmp/notes/w4a8.md), the MXFP4 GEMV tests, then gpt-oss-20b with MXFP4 experts (the GEMV
  # path for 1-8 tokens, 62341d9; issue 53's goal: batch 1 >= 1.3x its bf16-expert figure).
  lane1_gpu=1
  [ "$smoke" = 1 ] || [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ] && lane1_gpu=0
  G=(benchmarks/engine/engine_bench.py --sections bandwidth,decode --max-batch-size 16)
  (
    CUDA_VISIBLE_DEVICES=0 job verify_tests 120 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_int8_sq.py \
      tests/kernels/test_kernel_sampling.py tests/engine/test_int8_sq_engine.py
    CUDA_VISIBLE_DEVICES=0 job sq9_gemm_tests 85 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_int8_gemm.py
    on_gpu 0 sq9_bench 30 "$PYTHON" -u benchmarks/quantization/int8_gemm_bench.py --rows 512 8192 --shapes gate_up down \
      --out "$w/int8_gemm_first.md" --json "$w/int8_gemm_first.json"
    on_gpu 0 gptoss_bf16 150 "$PYTHON" "${G[@]}" --model gpt_oss_20b --out "$w/gptoss_bf16.json" --results-md "$w/gptoss_bf16.md"
  ) &
  lane0=$!
  [ "$lane1_gpu" = 0 ] && wait "$lane0"
  mkdir -p "$w/w4a8"
  on_gpu $lane1_gpu w4a8_sweep 70 "$PYTHON" benchmarks/quantization/w4a8_gemm_sweep.py --budget-s 45 --warm-procs 8 \
    --out "$w/w4a8/sweep.json" --md "$w/w4a8/sweep.md"
  CUDA_VISIBLE_DEVICES=$lane1_gpu job w4a8_tests 50 "$PYTHON" -m pytest -q -rfEs --tb=short -p no:cacheprovider -n 4 \
    tests/kernels/test_w4a8_gemm.py
  CUDA_VISIBLE_DEVICES=$lane1_gpu job mxfp4_tests 60 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_moe_gemv.py \
    tests/kernels/test_fused_moe_mxfp4.py -k "mxfp4 or MXFP4"
  on_gpu $lane1_gpu gptoss_mxfp4 150 "$PYTHON" "${G[@]}" --model gpt_oss_20b_mxfp4 --out "$w/gptoss_mxfp4.json" \
    --results-md "$w/gptoss_mxfp4.md"
  wait
  for f in verify_tests sq9_gemm_tests w4a8_tests mxfp4_tests; do
    echo "== $f"; grep -E "passed|failed|FAILED|ERROR|Error" "$w/$f.log" | tail -8 | cut -c1-300
  done
  echo "== sq9_bench"; grep -v Warning "$w/sq9_bench.log" | tail -14 | cut -c1-400
  echo "== w4a8"; tail -30 "$w/w4a8_tests.log" | cut -c1-300; cat "$w/w4a8/sweep.md" 2>/dev/null
  grep -v "^|" "$w/w4a8_sweep.log" | grep -v Warning | head -60 | cut -c1-300
  for f in gptoss_bf16 gptoss_mxfp4; do
    echo "== $f"; grep -E "^\| (batch-1|bandwidth|\.\.\.)|moe_gemv|gemv|Error|Traceback|^\[load" "$w/$f.log" | cut -c1-400 | head -20
  done
  ;;
24)
  # Session 23's last call (~440 s, two lanes; one GPU: one after the other). GPU 0: helper sq9's int8 GEMM (rows past 16,
  # /tmp/notes/sq9.md), engine_bench bf16 against int8_sq (batch-1 and 128/128 offline, issue 52's >= 1.3x), helper
  # enc23's encoder-decoder GPU tests. GPU 1: helper w4a8's W4A8 GEMM (/tmp/notes/w4a8.md), helper t5attn's T5 decode
  # self-attention (/tmp/notes/t5attn.md), encdec_bench (/tmp/notes/enc23.md), then the VLM offline runs after the sampling kernels' fix (fde908a, ae11360).
  lane1_gpu=1
  [ "$smoke" = 1 ] || [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ] && lane1_gpu=0
  (
    CUDA_VISIBLE_DEVICES=0 job sampling_tests 40 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_kernel_sampling.py
    # helper sq9 (/tmp/notes/sq9.md): the int8 GEMM's tests, the int8_sq engine's CUDA tests, the per-shape bench
    CUDA_VISIBLE_DEVICES=0 job sq9_tests 90 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_int8_gemm.py
    CUDA_VISIBLE_DEVICES=0 job sq9_engine 45 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider -k cuda \
      tests/engine/test_int8_sq_engine.py tests/kernels/test_int8_sq.py::test_cuda_path_matches_the_reference
    on_gpu 0 sq9_bench 65 "$PYTHON" -u benchmarks/quantization/int8_gemm_bench.py --out "$w/int8_gemm.md" --json "$w/int8_gemm.json"
    for q in bf16 int8_sq; do
      on_gpu 0 "sq_$q" 110 "$PYTHON" benchmarks/engine/engine_bench.py --sections decode,offline$([ "$q" = bf16 ] && \
        echo ,executor_decode --executor-decode-batches 256) --offline 128x128x1024 \
        --max-batch-size 512 $([ "$q" = int8_sq ] && echo --quantization int8_sq) --out "$w/sq_$q.json" \
        --results-md "$w/sq_$q.md"
    done
    CUDA_VISIBLE_DEVICES=0 job enc_tests 60 "$PYTHON" -m pytest -q -rfEs -s -p no:cacheprovider -m gpu \
      tests/engine/test_encoder_decoder_fp8_weights.py tests/engine/test_encoder_decoder.py tests/engine/test_whisper_fused_decode.py \
      tests/kernels/test_kernel_elementwise.py tests/kernels/test_fp8.py -k "cuda or fused_graphs_equal_unfused or \
activated_fp8_product or quantized_gated_activation or quantized_gelu_tanh or quantized_layer_norm or layer_norm_with_its_adds"
  ) &
  lane0=$!
  [ "$lane1_gpu" = 0 ] && wait "$lane0"
  # helper w4a8 (/tmp/notes/w4a8.md): the sweep, the CUDA tests, the INT4 engine at 256 requests with TRITONLLM_W4A8=1
  # (bf16's executor_decode at 256 runs in lane 0's sq_bf16, same lease)
  mkdir -p "$w/w4a8"
  on_gpu $lane1_gpu w4a8_sweep 45 "$PYTHON" benchmarks/quantization/w4a8_gemm_sweep.py --budget-s 30 --warm-procs 8 \
    --rows 256,64,1024,128,512 --out "$w/w4a8/sweep.json" --md "$w/w4a8/sweep.md"
  CUDA_VISIBLE_DEVICES=$lane1_gpu job w4a8_tests 30 "$PYTHON" -m pytest -q -rfEs --tb=short -p no:cacheprovider -n 4 \
    tests/kernels/test_w4a8_gemm.py
  TRITONLLM_W4A8=1 on_gpu $lane1_gpu w4a8_engine 70 "$PYTHON" benchmarks/engine/engine_bench.py --sections executor_decode \
    --executor-decode-batches 256 --max-batch-size 256 --quantization int4_wo --out "$w/w4a8/eng_w4a8.json"
  # helper t5attn (/tmp/notes/t5attn.md): the T5 decode kernel's tests and its bench against the tensor-core path
  CUDA_VISIBLE_DEVICES=$lane1_gpu job t5attn_tests 35 "$PYTHON" -m pytest -q -x -n 4 -p no:cacheprovider \
    tests/kernels/test_t5_bias_attention.py tests/kernels/test_kernel_input_layouts.py -k t5
  on_gpu $lane1_gpu t5attn_bench 55 "$PYTHON" benchmarks/kernels/t5_attention_bench.py --encoder "" --decode "" \
    --out "$w/t5_decode_paths.json" --md "$w/t5_decode_paths.md"
  on_gpu $lane1_gpu enc_bench 100 "$PYTHON" -u benchmarks/engine/encdec_bench.py --sections whisper,t5 --hf-whisper-batches "" \
    --hf-t5-batches "" --cross-kv-cache-dtype fp8 --quantization none,fp8 --out "$w/enc.json" --results-md "$w/enc.md"
  on_gpu $lane1_gpu vlm 110 "$PYTHON" benchmarks/engine/vlm_bench.py --sections offline --hf-batches= --encode-batch 32 \
    --also-encode-batches 32 --offline-variants fp8-tower --sync-watch --out "$w/vlm.json" --results-md "$w/vlm.md"
  wait
  echo "== sampling_tests"; grep -E "passed|failed|FAILED" "$w/sampling_tests.log" | tail -3
  for f in sq9_tests sq9_engine w4a8_tests t5attn_tests; do [ -f "$w/$f.log" ] && { echo "== $f"; grep -v -i warning "$w/$f.log" | tail -14 | cut -c1-400; }; done
  echo "== sq9_bench"; grep -v Warning "$w/sq9_bench.log" | tail -26 | cut -c1-400
  echo "== w4a8 sweep"; cat "$w/w4a8/sweep.md" 2>/dev/null | cut -c1-400; grep -v "^|" "$w/w4a8_sweep.log" | grep -v "W4A16 best" | head -30 | cut -c1-300
  echo "== w4a8 engine"; tail -6 "$w/w4a8_engine.log" | cut -c1-400
  grep -hE "executor_decode|256" "$w/sq_bf16.log" | grep -iE "tok/s|step" | head -4 | cut -c1-300
  echo "== t5attn bench"; cat "$w/t5_decode_paths.md" 2>/dev/null | cut -c1-400
  for q in bf16 int8_sq; do [ -f "$w/sq_$q.log" ] && { echo "== sq_$q"; grep -E "^\| (batch-1|offline|\.\.\.)|Error|Traceback" "$w/sq_$q.log" | cut -c1-300; }; done
  echo "== enc_tests"; grep -E "CUDA: FP8|passed|failed|Error|assert" "$w/enc_tests.log" | tail -12 | cut -c1-300
  echo "== enc_bench"; grep -vi warning "$w/enc_bench.log" | grep -E "whisper|t5|audio|tok/s|Error|Traceback|run:" | cut -c1-400 | head -24
  echo "== vlm"; grep -E "^offline |Error|Traceback" "$w/vlm.log" | cut -c1-600
  [ -f "$w/vlm.md" ] && grep -E "^\|" "$w/vlm.md" | cut -c1-300
  ;;
25)
  # Session 24's first bench call (~260 s, two lanes; one GPU: one after the other). GPU 0: the two t5_v1_1 FP8 engine
  # tests the suite at 2bbb68c failed (float32 rows into the 16-bit gated kernel; c760181), then encdec_bench's T5
  # sections with FP8 weights and the FP8 cross pool after the T5 decode tiling of 559000e (issue 49). GPU 1: issue
  # 52's INT4 engine at 256 requests with W4A8 (TRITONLLM_W4A8=1), without it, and bf16, same lease.
  lane1_gpu=1
  [ "$smoke" = 1 ] || [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ] && lane1_gpu=0
  (
    CUDA_VISIBLE_DEVICES=0 job t5fp8_tests 60 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
      tests/engine/test_encoder_decoder_fp8_weights.py -k t5_v1_1
    on_gpu 0 t5_bench 170 "$PYTHON" -u benchmarks/engine/encdec_bench.py --sections t5 --hf-whisper-batches "" \
      --hf-t5-batches "" --cross-kv-cache-dtype fp8 --quantization none,fp8 --out "$w/t5.json" --results-md "$w/t5.md"
  ) &
  lane0=$!
  [ "$lane1_gpu" = 0 ] && wait "$lane0"
  E=(benchmarks/engine/engine_bench.py --sections executor_decode --executor-decode-batches 256 --max-batch-size 256)
  TRITONLLM_W4A8=1 on_gpu $lane1_gpu int4_w4a8 140 "$PYTHON" "${E[@]}" --quantization int4_wo --out "$w/int4_w4a8.json"
  on_gpu $lane1_gpu int4_w4a16 100 "$PYTHON" "${E[@]}" --quantization int4_wo --out "$w/int4_w4a16.json"
  on_gpu $lane1_gpu bf16_256 70 "$PYTHON" "${E[@]}" --out "$w/bf16_256.json"
  wait
  echo "== t5fp8_tests"; grep -E "passed|failed|FAILED|Error" "$w/t5fp8_tests.log" | tail -6 | cut -c1-300
  echo "== t5_bench"; grep -vi warning "$w/t5_bench.log" | grep -E "t5|tok/s|step|Error|Traceback|run:" | cut -c1-400 | head -24
  for f in int4_w4a8 int4_w4a16 bf16_256; do
    echo "== $f"; grep -iE "tok/s|step|Error|Traceback|choice" "$w/$f.log" | grep -v Warning | head -8 | cut -c1-300
  done
  ;;
26)
  # Session 24's middle call (~400 s, two lanes; one GPU: one after the other): the helpers' first GPU runs
  # (/tmp/notes/{xattn,t5enc,mla,mxfp4}.md). GPU 0: xattn's one-query cross-attention decode kernel (tests, sweep
  # against the general paged kernel, Whisper splits), t5enc's T5 encoder attention (tests, sweep against SDPA with
  # the bias materialized), then the Qwen2.5-VL tower's profile at 448 x 448 (issue 48). GPU 1: mla's MLA decode
  # kernel (tests, bf16 and FP8 pools sweep), mxfp4's one-token MXFP4 GEMV (sweep, tests).
  lane1_gpu=1
  [ "$smoke" = 1 ] || [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ] && lane1_gpu=0
  T=("$PYTHON" -m pytest -q -x -n 4 -p no:cacheprovider)
  # PART=a: lane 0 without the tower profile, then the T5 engine; PART=b: lane 1 (one GPU, two calls of ~380 s)
  part=${PART:-all}
  [ "$part" = b ] || (
    CUDA_VISIBLE_DEVICES=0 job xattn_tests 35 "${T[@]}" tests/kernels/test_cross_attention_decode.py \
      tests/kernels/test_one_query_attention.py tests/kernels/test_t5_bias_attention.py
    CUDA_VISIBLE_DEVICES=0 job xattn_engine_tests 45 "${T[@]}" tests/engine/test_encoder_decoder_graphs.py \
      tests/engine/test_whisper_fused_decode.py -k "cuda or gpu"
    on_gpu 0 xattn_bench 60 "$PYTHON" benchmarks/kernels/cross_attention_bench.py \
      --tilings 1x32x1x1,1x64x1x1,1x64x2x1,2x32x2x1,1x16x1x1 --out "$w/xattn.json" --md "$w/xattn.md"
    on_gpu 0 xattn_splits 25 "$PYTHON" benchmarks/kernels/cross_attention_bench.py --shapes 1x20x1500,64x20x1500 \
      --pools bf16 --tilings 1x32x1x1,1x64x1x1 --splits 1,2,4,8,16,32 --out "$w/xattn_splits.json" --md "$w/xattn_splits.md"
    CUDA_VISIBLE_DEVICES=0 job t5enc_tests 40 "${T[@]}" tests/kernels/test_t5_bias_attention.py \
      tests/kernels/test_kernel_input_layouts.py -k t5
    on_gpu 0 t5enc_bench 105 "$PYTHON" benchmarks/kernels/t5_attention_bench.py --encoder 256x512,16x512 --decode "" \
      --paths "" --out "$w/t5_encoder.json" --encoder-md "$w/t5_encoder.md"
    [ "$part" = all ] && on_gpu 0 vlm_tower_profile 80 "$PYTHON" benchmarks/engine/vlm_bench.py --sections encoder --image-sizes 448 \
      --encoder-batches 32 --encoder-repeats 2 --hf-batches "" --profile-dir "$w/vlmprof" --out "$w/vlm_tower.json"
  ) &
  lane0=$!
  [ "$lane1_gpu" = 0 ] && wait "$lane0"
  [ "$part" = a ] || {
  CUDA_VISIBLE_DEVICES=$lane1_gpu job mla_tests 45 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_mla_attention.py \
    -k "decode_kernel or combine_applies"
  on_gpu $lane1_gpu mla_bf16 70 "$PYTHON" benchmarks/kernels/mla_kernel_bench.py --shape v2_lite --pool bf16 --batches 1,16,64 \
    --contexts 1024,8192,32768 --repeat 5 --configs 16:128:32,d32:4:3,d32:8:3,d64:8:3,d16:4:3,d32:8:0,d32:4:3:256:128:8,d32:8:3:256:256:8,d32:4:3:64:32:2 \
    --out "$w/mla_bf16.json" --markdown "$w/mla_bf16.md"
  on_gpu $lane1_gpu mla_fp8 35 "$PYTHON" benchmarks/kernels/mla_kernel_bench.py --shape v2_lite --pool fp8 --batches 1,16,64 \
    --contexts 1024,8192,32768 --repeat 5 --configs 16:128:32,d32:8:0,d32:4:0,d32:8:3,d32:8:0:256:128:8 \
    --out "$w/mla_fp8.json" --markdown "$w/mla_fp8.md"
  on_gpu $lane1_gpu mxfp4_bench 105 "$PYTHON" -u benchmarks/kernels/moe_gemv_bench.py --model gpt_oss_20b --gemv-candidates 2 \
    --word-tiles 16,4,4 32,4,4 32,4,2 64,2,4 16,8,4 64,4,4 16,4,4,1 32,4,4,1 --out "$w/mxfp4_gemv.json"
  CUDA_VISIBLE_DEVICES=$lane1_gpu job mxfp4_tests 40 "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/kernels/test_mxfp4_gemv.py
  }
  wait
  # the T5 engine with both new kernels as defaults (xattn's cross-attention decode, t5enc's encoder attention)
  [ "$part" = b ] || on_gpu $lane1_gpu t5_engine 75 "$PYTHON" -u benchmarks/engine/encdec_bench.py --sections t5 --hf-whisper-batches "" \
    --hf-t5-batches "" --cross-kv-cache-dtype fp8 --quantization fp8 --out "$w/t5_engine.json" --results-md "$w/t5_engine.md"
  for f in xattn_tests xattn_engine_tests t5enc_tests mla_tests mxfp4_tests; do
    echo "== $f"; grep -v -i warning "$w/$f.log" | tail -8 | cut -c1-300
  done
  for f in xattn xattn_splits t5_encoder mla_bf16 mla_fp8; do echo "== $f.md"; cat "$w/$f.md" 2>/dev/null | cut -c1-300; done
  echo "== mxfp4_bench"; grep -v -i warn "$w/mxfp4_bench.log" | tail -40 | cut -c1-300
  echo "== t5_engine"; grep -vi warning "$w/t5_engine.log" | grep -E "t5|tok/s|step|Error|Traceback" | cut -c1-400 | head -8
  echo "== vlm_tower_profile"; grep -vi warn "$w/vlm_tower_profile.log" | tail -12 | cut -c1-300
  ;;
27)
  # Session 24's second helpers' call (one H200, ~550 s; the helpers' lines of /tmp/notes/NAME.md, "## GPU command",
  # as they wrote them at 17:45): xattn (the encoder-decoder graph tests on CUDA, FP8 cross tilings x splits),
  # t5enc (the encoder sweep around its best, the Flan-T5-XL FP8 engine), mla (the MLA decode kernel's tests and
  # sweeps with --check, V2-Lite batch-1 with TRITONLLM_MLA_DECODE=1), mxfp4 (the word GEMV sweep, gpt-oss-20b MXFP4).
  export PYTHON w
  echo "== xattn"
  job xattn 125 bash -c '
      timeout 90 $PYTHON -m pytest -x --tb=short -n 2 -p no:cacheprovider tests/engine/test_encoder_decoder_graphs.py tests/engine/test_whisper_fused_decode.py -k "cuda or gpu" 2>&1 | tail -40
      timeout 28 $PYTHON benchmarks/kernels/cross_attention_bench.py --shapes 64x32x512,256x32x512 --pools fp8 --tilings 1x32x1x1,1x64x1x1,1x16x1x2 --splits 1,2,4,8 --out "$w"/xattn_fp8.json --md "$w"/xattn_fp8.md 2>&1 | tail -3
'
  grep -vi warning "$w/xattn.log" | tail -60 | cut -c1-400
  echo "== t5enc"
  job t5enc 125 bash -c '
      timeout 55 $PYTHON benchmarks/kernels/t5_attention_bench.py --encoder 256x512 --encoder-sweep split,ahead --decode "" --paths "" --out "$w"/t5_encoder2.json --encoder-md "$w"/t5_encoder2.md 2>&1 | grep "^  256x512" | cut -c1-160
      timeout 65 $PYTHON -u benchmarks/engine/encdec_bench.py --sections t5 --quantization fp8 --cross-kv-cache-dtype fp8 --hf-t5-batches "" --hf-whisper-batches "" --out "$w"/encdec_t5.json --results-md "$w"/encdec_t5.md > "$w"/encdec_t5.log 2>&1; echo "engine rc $?"; grep -vi warn "$w"/encdec_t5.log | grep -E "t5|tok/s|encoder|Error|Traceback|failed" | cut -c1-400 | head -12
'
  grep -vi warning "$w/t5enc.log" | tail -60 | cut -c1-400
  echo "== mla"
  job mla 155 bash -c '
      timeout 25 $PYTHON -m pytest -q -p no:cacheprovider tests/kernels/test_mla_attention.py -k "decode_kernel_equals" 2>&1 | tail -3
      timeout 35 $PYTHON benchmarks/kernels/mla_kernel_bench.py --shape v2_lite --pool bf16 --batches 1,32 --contexts 1024,8192,32768 --repeat 5 --check --configs 16:128:32,d32:4:3,d32:8:3,d64:8:3,d32:8:0,d32:4:3:256:128:8 --out "$w"/mla_bf16.json --markdown "$w"/mla_bf16.md 2>&1 | grep -E "^bf16 batch|Error|Traceback" | head -45
      timeout 15 $PYTHON benchmarks/kernels/mla_kernel_bench.py --shape v2_lite --pool fp8 --batches 1,32 --contexts 1024,32768 --repeat 5 --check --configs 16:128:32,d32:8:0,d32:8:3 --out "$w"/mla_fp8.json --markdown "$w"/mla_fp8.md 2>&1 | grep -E "^fp8 batch|Error|Traceback" | head -15
      TRITONLLM_MLA_DECODE=1 timeout 75 $PYTHON benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out "$w"/ds_mla.json --results-md "$w"/ds_mla.md 2>&1 | grep -E "Error|Traceback" | head -3; tail -3 "$w"/ds_mla.md; timeout 5 $PYTHON -c "import json,sys; d=json.load(open(sys.argv[1]))['\''decode'\'']; print(d.get('\''graph_step_profile'\'')); print('\''pdl'\'', d.get('\''launch_choice'\''))" "$w"/ds_mla.json
'
  grep -vi warning "$w/mla.log" | tail -60 | cut -c1-400
  echo "== mxfp4"
  job mxfp4 150 bash -c '
      timeout 50 $PYTHON -u benchmarks/kernels/moe_gemv_bench.py --model gpt_oss_20b --kinds mxfp4 --gemv-candidates 1 --word-tiles 16,4,4 32,4,4 16,8,4 32,4,4,p 16,4,4,f --out "$w"/mxfp4_gemv.json 2>&1 | grep -v -i warn | tee "$w"/mxfp4_bench.log
      timeout 97 $PYTHON benchmarks/engine/engine_bench.py --sections bandwidth,decode --max-batch-size 16 --model gpt_oss_20b_mxfp4 --out "$w"/gptoss_mxfp4.json --results-md "$w"/gptoss_mxfp4.md > "$w"/gptoss_mxfp4.log 2>&1; echo "engine rc $?"; grep -E "batch-1|load " "$w"/gptoss_mxfp4.md "$w"/gptoss_mxfp4.log | cut -c1-260; $PYTHON -c "import json,sys; d=json.load(open(sys.argv[1]))['\''decode'\'']['\''gemm_choices'\'']; [print(k[:40], str(v)[:700]) for k,v in d.items() if '\''gemv'\'' in k]" "$w"/gptoss_mxfp4.json
'
  grep -vi warning "$w/mxfp4.log" | tail -60 | cut -c1-400
  ;;
28)
  # Session 24's last call (one H200, ~330 s; the helpers' lines of /tmp/notes/NAME.md as they stood at 18:31): the
  # Flan-T5-XL FP8 engine at HEAD (xattn's FP8 cross tiling, t5enc's encoder tiling), mxfp4's word path checked at
  # gpt-oss's misaligned rows and the gpt-oss-20b MXFP4 engine, V2-Lite with the general MLA kernel
  # (TRITONLLM_MLA_DECODE=0: call 27's decode-kernel figure's same-code baseline), t5enc's encoder sweep last.
  export PYTHON w
  echo "== t5_engine"
  job t5_engine 65 bash -c '
      timeout 60 $PYTHON -u benchmarks/engine/encdec_bench.py --sections t5 --quantization fp8 --cross-kv-cache-dtype fp8 --hf-t5-batches "" --hf-whisper-batches "" --out "$w"/encdec_t5.json --results-md "$w"/encdec_t5.md > "$w"/encdec_t5.log 2>&1; echo "engine rc $?"; grep -vi warn "$w"/encdec_t5.log | grep -E "t5|tok/s|encoder|Error|Traceback|failed" | cut -c1-400 | head -12
'
  grep -vi warning "$w/t5_engine.log" | tail -40 | cut -c1-400
  echo "== mxfp4_check"
  job mxfp4_check 62 bash -c '
      export PYTHONPATH=$PWD; timeout 28 $PYTHON -m pytest -q -x -p no:cacheprovider $($PYTHON -c '\''import xdist'\'' 2>/dev/null && echo "-n 8") tests/kernels/test_mxfp4_gemv.py -k "words_equal or given_routing or large_and_small or choice" 2>&1 | tail -4; timeout 30 $PYTHON -u benchmarks/kernels/moe_gemv_bench.py --model gpt_oss_20b --kinds mxfp4 --tokens 1 --gemv-candidates 1 --word-tiles 32,4,4 16,8,4 32,4,4,p --out "$w"/mxfp4_gemv.json 2>&1 | grep -v -i warn
'
  grep -vi warning "$w/mxfp4_check.log" | tail -40 | cut -c1-400
  echo "== gptoss_mxfp4"
  job gptoss_mxfp4 102 bash -c '
      export PYTHONPATH=$PWD; timeout 100 $PYTHON benchmarks/engine/engine_bench.py --sections bandwidth,decode --max-batch-size 16 --model gpt_oss_20b_mxfp4 --out "$w"/gptoss_mxfp4.json --results-md "$w"/gptoss_mxfp4.md > "$w"/gptoss_mxfp4.log 2>&1; echo "engine rc $?"; grep -E "batch-1|load " "$w"/gptoss_mxfp4.md "$w"/gptoss_mxfp4.log | cut -c1-260; $PYTHON -c "import json,sys; d=json.load(open(sys.argv[1]))['\''decode'\'']['\''gemm_choices'\'']; [print(k[:40], {n: v[n] for n in ('\''tiles'\'', '\''grouped_us'\'', '\''gemv_us'\'', '\''words_us'\'', '\''words_rel_diff'\'') if n in v}) for k,v in d.items() if '\''gemv'\'' in k]" "$w"/gptoss_mxfp4.json
'
  grep -vi warning "$w/gptoss_mxfp4.log" | tail -40 | cut -c1-400
  echo "== v2lite_general"
  job v2lite_general 80 bash -c '
      export PYTHONPATH=$PWD; TRITONLLM_MLA_DECODE=0 timeout 78 $PYTHON benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out "$w"/ds_general.json --results-md "$w"/ds_general.md 2>&1 | grep -E "Error|Traceback" | head -3; tail -3 "$w"/ds_general.md; timeout 2 $PYTHON -c "import json,sys; d=json.load(open(sys.argv[1]))['\''decode'\'']; print(d.get('\''graph_step_profile'\'')); print('\''pdl'\'', d.get('\''launch_choice'\''))" "$w"/ds_general.json
'
  grep -vi warning "$w/v2lite_general.log" | tail -40 | cut -c1-400
  echo "== t5enc_sweep"
  job t5enc_sweep 32 bash -c '
      timeout 30 $PYTHON benchmarks/kernels/t5_attention_bench.py --encoder 256x512 --encoder-defaults split,tma --encoder-sweep split/v4,tma,tma/v4 --no-sdpa --ceilings --decode "" --paths "" --out "$w"/t5_encoder3.json --encoder-md "$w"/t5_encoder3.md 2>&1 | grep "^  256x512" | cut -c1-160
'
  grep -vi warning "$w/t5enc_sweep.log" | tail -40 | cut -c1-400
  ;;
29)
  # Session 24's very last call (one H200, ~55 s): the Flan-T5-XL FP8 engine with t5enc's split/v2 encoder tiling as
  # the default (2.43 against 4.69 ms a layer in call 28's sweep).
  job t5_engine 60 "$PYTHON" -u benchmarks/engine/encdec_bench.py --sections t5 --quantization fp8 --cross-kv-cache-dtype fp8 \
    --hf-t5-batches "" --hf-whisper-batches "" --out "$w/encdec_t5.json" --results-md "$w/encdec_t5.md"
  grep -vi warn "$w/t5_engine.log" | grep -E "t5|tok/s|encoder|Error|Traceback|failed" | cut -c1-400 | head -12
  ;;
30)
  # Session 25's second call (~200 s, two lanes; one after the other on one GPU): lane 0 re-runs the suite's three
  # failures after their fixes (T5's 4-byte bias runs refused, the MXFP4 choice test reading the last choice's
  # marks, the engine-process cancel after the first token) and the wna16 files the T5 crash took down with its
  # worker; lane 1 the Flan-T5-XL engine with d0455ef's encoder default, FP8 then bf16 weights, then Whisper
  # large-v3 with the one-query cross kernel.
  export PYTHON w
  lane1_gpu=1; "$PYTHON" -c "import torch, sys; sys.exit(torch.cuda.device_count() < 2)" || lane1_gpu=0
  CUDA_VISIBLE_DEVICES=0 job fixes 150 bash -c '
      timeout 140 $PYTHON -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_t5_bias_attention.py tests/kernels/test_mxfp4_gemv.py tests/executor/test_engine_process.py tests/kernels/test_wna16.py tests/kernels/test_wna16_mma.py tests/kernels/test_wna16_mma_dense.py tests/kernels/test_wna16_mma_gemm.py tests/kernels/test_wna16_mma_rows.py 2>&1 | grep -E "passed|failed|FAILED|Error" | head -30
' &
  fixes_pid=$!
  [ "$lane1_gpu" = 0 ] && wait $fixes_pid
  CUDA_VISIBLE_DEVICES=$lane1_gpu job t5_whisper 260 bash -c '
      for q in fp8 none; do
        timeout 70 $PYTHON -u benchmarks/engine/encdec_bench.py --sections t5 --quantization $q --cross-kv-cache-dtype fp8 --hf-t5-batches "" --hf-whisper-batches "" --out "$w"/encdec_t5_$q.json --results-md "$w"/encdec_t5_$q.md > "$w"/encdec_t5_$q.log 2>&1; echo "t5 $q rc $?"; grep -vi warn "$w"/encdec_t5_$q.log | grep -E "tok/s|encoder|Error|Traceback" | tail -6 | cut -c1-300
      done
      timeout 110 $PYTHON -u benchmarks/engine/encdec_bench.py --sections whisper --hf-whisper-batches "" --out "$w"/encdec_whisper.json --results-md "$w"/encdec_whisper.md > "$w"/encdec_whisper.log 2>&1; echo "whisper rc $?"; grep -vi warn "$w"/encdec_whisper.log | grep -E "audio|tok/s|Error|Traceback" | tail -6 | cut -c1-300
'
  wait
  for name in fixes t5_whisper; do echo "== $name"; grep -vi warning "$w/$name.log" | tail -40 | cut -c1-400; done
  ;;
31)
  # Call 30's lane 0 again, file by file under their own guards (call 30's one pytest hit its 140-s guard with no
  # summary), and Whisper alone on the other GPU (call 30's ran beside eight test workers: its encoder took 0.84 s
  # in the run against 0.31 s after it).
  export PYTHON w
  lane1_gpu=1; "$PYTHON" -c "import torch, sys; sys.exit(torch.cuda.device_count() < 2)" || lane1_gpu=0
  CUDA_VISIBLE_DEVICES=0 job fixes 200 bash -c '
      for f in tests/kernels/test_t5_bias_attention.py tests/kernels/test_mxfp4_gemv.py tests/executor/test_engine_process.py "tests/kernels/test_wna16.py tests/kernels/test_wna16_mma.py tests/kernels/test_wna16_mma_dense.py tests/kernels/test_wna16_mma_gemm.py tests/kernels/test_wna16_mma_rows.py"; do
        s=$(date +%s); timeout 60 $PYTHON -m pytest -q -p no:cacheprovider -n 4 $f > "$w"/fix.log 2>&1; echo "$f: rc $? in $(( $(date +%s) - s )) s: $(tail -1 "$w"/fix.log)"; grep -E "^FAILED|^E  " "$w"/fix.log | head -8; cp "$w"/fix.log "$w"/fix_$s.log
      done
' &
  [ "$lane1_gpu" = 0 ] && wait
  CUDA_VISIBLE_DEVICES=$lane1_gpu job whisper 120 bash -c '
      timeout 110 $PYTHON -u benchmarks/engine/encdec_bench.py --sections whisper --hf-whisper-batches "" --out "$w"/encdec_whisper.json --results-md "$w"/encdec_whisper.md > "$w"/encdec_whisper.log 2>&1; echo "whisper rc $?"; grep -vi warn "$w"/encdec_whisper.log | grep -E "audio|tok/s|replay|Error|Traceback" | tail -6 | cut -c1-400
'
  wait
  for name in fixes whisper; do echo "== $name"; grep -vi warning "$w/$name.log" | tail -40 | cut -c1-400; done
  ;;
32)
  # Session 25's third call (~200 s, two lanes): lane 0 the Flan-T5-XL FP8 engine with the self pool in FP8 too
  # (call 30: 26,076 tok/s with a bf16 self pool, 4.94x), then the bf16 tower's profiler table at 448 x 448 batch 32
  # (issue 48's gap); lane 1 the engine-process tests after the cancel fix, then the Whisper batch-1 step's variants
  # with profiler tables (issue 49's roofline goal).
  export PYTHON w
  lane1_gpu=1; "$PYTHON" -c "import torch, sys; sys.exit(torch.cuda.device_count() < 2)" || lane1_gpu=0
  CUDA_VISIBLE_DEVICES=0 job t5_tower 200 bash -c '
      timeout 70 $PYTHON -u benchmarks/engine/encdec_bench.py --sections t5 --quantization fp8 --kv-cache-dtype fp8 --cross-kv-cache-dtype fp8 --hf-t5-batches "" --hf-whisper-batches "" --out "$w"/encdec_t5_fp8kv.json --results-md "$w"/encdec_t5_fp8kv.md > "$w"/encdec_t5_fp8kv.log 2>&1; echo "t5 fp8 kv rc $?"; grep -vi warn "$w"/encdec_t5_fp8kv.log | grep -E "tok/s|encoder|Error|Traceback" | tail -4 | cut -c1-400
      mkdir -p "$w"/towerprof; timeout 120 $PYTHON -u benchmarks/engine/vlm_bench.py --sections encoder --image-sizes 448 --encoder-batches 32 --encoder-repeats 2 --hf-batches "" --profile-dir "$w"/towerprof --out "$w"/vlm_tower.json > "$w"/vlm_tower.log 2>&1; echo "tower rc $?"; grep -vi warn "$w"/vlm_tower.log | grep -E "encoder|images/s|Error|Traceback" | tail -4 | cut -c1-300; ls "$w"/towerprof; head -45 "$w"/towerprof/*.txt | cut -c1-200
' &
  [ "$lane1_gpu" = 0 ] && wait
  CUDA_VISIBLE_DEVICES=$lane1_gpu job eproc_wstep 200 bash -c '
      timeout 75 $PYTHON -m pytest -q -p no:cacheprovider -n 4 tests/executor/test_engine_process.py > "$w"/eproc.log 2>&1; echo "engine_process rc $?: $(tail -1 "$w"/eproc.log)"; grep -E "^FAILED|^E  " "$w"/eproc.log | head -6
      mkdir -p "$w"/wprof; timeout 110 $PYTHON -u benchmarks/engine/encdec_bench.py --sections whisper_step --step-variants unfused,fused --profile-dir "$w"/wprof --out "$w"/wstep.json --results-md "$w"/wstep.md > "$w"/wstep.log 2>&1; echo "wstep rc $?"; grep -vi warn "$w"/wstep.md | tail -8 | cut -c1-300
' &
  wait
  for name in t5_tower eproc_wstep; do echo "== $name"; grep -vi warning "$w/$name.log" | tail -70 | cut -c1-300; done
  ;;
33)
  # Session 25's helpers' first call (two lanes, ~6 min; one after the other on one GPU): each helper's lines from
  # /tmp/notes/NAME.md "## GPU command" as they stood at 20:20 UTC, its $OUT a folder of this call's archive; then the
  # lead's: Whisper 64 clips with the encoder's planless attention and with torch's choice (TRITONLLM_PLANLESS_SDPA=0),
  # the Flan-T5-XL FP8 engine with the FP8 self pool again (call 32: 5.71-ms median step, 1.10 s over 127 steps).
  export PYTHON w
  lane1_gpu=1; "$PYTHON" -c "import torch, sys; sys.exit(torch.cuda.device_count() < 2)" || lane1_gpu=0
  cat > "$w/tower48.sh" <<'HELPER_LINES'
export PYTHONPATH=$PWD
timeout 40 $PYTHON -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_window_attention.py tests/kernels/test_gated_gemm.py tests/engine/test_qwen2_vl.py -k "window or gated or ((cuda_tower_rows_equal_cpu_rows or bf16_tower) and qwen2_5_vl)" > $OUT/t48_tests.log 2>&1; echo "tests rc $?"; tail -5 $OUT/t48_tests.log | cut -c1-300
timeout 35 $PYTHON benchmarks/kernels/tower_parts_bench.py --parts gated,window,residual --out $OUT/t48_parts.json 2>&1 | grep -E "^(gated|window|residual)|Error" | cut -c1-600
timeout 25 $PYTHON benchmarks/engine/vlm_bench.py --sections encoder --image-sizes 448 --encoder-batches 32 --encoder-repeats 3 --hf-batches= --tower-variants both-triton,window-triton,gated-triton --out $OUT/t48_tower.json > $OUT/t48_tower.log 2>&1; echo "tower rc $?"; grep -E "^encoder|Error" $OUT/t48_tower.log | cut -c1-300
HELPER_LINES
  cat > "$w/wstep49.sh" <<'HELPER_LINES'
export PYTHONPATH=$PWD; timeout 40 $PYTHON -m pytest -q -p no:cacheprovider tests/kernels/test_l2_prefetch.py tests/kernels/test_cross_attention_decode.py -k "graph or merge_switch" 2>&1 | tail -2; mkdir -p $OUT/wprof; timeout 105 $PYTHON -u benchmarks/engine/encdec_bench.py --sections whisper_step --step-variants default,fused,fused-prefetch2,fused-prefetch-kv,fused-merge,fused-prefetch,merge-kernel --profile-dir $OUT/wprof --out $OUT/wstep.json --results-md $OUT/wstep.md > $OUT/wstep.log 2>&1; echo "wstep rc $?"; grep -E "^whisper_step|Error|Traceback" $OUT/wstep.log | cut -c1-600 | tail -9
HELPER_LINES
  cat > "$w/mla55.sh" <<'HELPER_LINES'
export PYTHONPATH=$PWD
TRITONLLM_WEIGHT_PREFETCH=1 timeout 30 $PYTHON -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_linear.py tests/kernels/test_fused_moe.py tests/kernels/test_moe_router.py tests/kernels/test_mla_latent_write.py tests/kernels/test_mla_attention.py -k "prefetch or (split_k_equals and 2-1) or post_attention or w_uk_product or combine_applies" 2>&1 | tail -2
timeout 35 $PYTHON benchmarks/kernels/skinny_prefetch_bench.py --variants 16:512:4:4,32:256:4:4,32:256:4:4:2,64:128:4:6:1:1:1 --out $OUT/prefetch.json 2>&1 | grep -E "^[0-9]+x|Error|Traceback" | head -12
TRITONLLM_WEIGHT_PREFETCH=1 timeout 80 $PYTHON benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out $OUT/ds_pf.json --results-md $OUT/ds_pf.md 2>&1 | grep -E "Error|Traceback" | head -3; tail -3 $OUT/ds_pf.md; timeout 5 $PYTHON -c "import json,sys; d=json.load(open(sys.argv[1]))['decode']; print(d.get('graph_step_profile'))" $OUT/ds_pf.json
HELPER_LINES
  cat > "$w/moe53.sh" <<'HELPER_LINES'
timeout 60 $PYTHON -m pytest -q -x -n 4 -p no:cacheprovider tests/kernels/test_mxfp4_gemv.py 2>&1 | tail -4
timeout 85 $PYTHON benchmarks/kernels/moe_gemv_bench.py --model gpt_oss_20b --kinds mxfp4 --tokens 1 --gemv-candidates 1 --launches --word-tiles 32,4,4,p 16,8,4,p 32,4,4,p2 16,8,4,p2 32,4,4,px2 16,8,4,px 16,8,4 16,8,4,r 16,8,4,pr2 16,8,4,r2 --out $OUT/moe53.json 2>&1 | grep -v -i warn | tail -9
HELPER_LINES
  cat > "$w/lead_whisper.sh" <<'LEAD_LINES'
for planless in 1 0; do
  TRITONLLM_PLANLESS_SDPA=$planless timeout 75 $PYTHON -u benchmarks/engine/encdec_bench.py --sections whisper --hf-whisper-batches "" --out $OUT/whisper_p$planless.json --results-md $OUT/whisper_p$planless.md > $OUT/whisper_p$planless.log 2>&1; echo "whisper planless=$planless rc $?"; grep -vi warn $OUT/whisper_p$planless.log | grep -E "audio s/s|run:|Error|Traceback" | tail -3 | cut -c1-420
done
LEAD_LINES
  cat > "$w/lead_t5.sh" <<'LEAD_LINES'
timeout 70 $PYTHON -u benchmarks/engine/encdec_bench.py --sections t5 --quantization fp8 --kv-cache-dtype fp8 --cross-kv-cache-dtype fp8 --hf-t5-batches "" --hf-whisper-batches "" --out $OUT/t5_fp8kv.json --results-md $OUT/t5_fp8kv.md > $OUT/t5_fp8kv.log 2>&1; echo "t5 fp8 kv rc $?"; grep -vi warn $OUT/t5_fp8kv.log | grep -E "tok/s|run:|Error|Traceback" | tail -3 | cut -c1-480
LEAD_LINES
  declare -A LIMITS=([tower48]=105 [wstep49]=150 [mla55]=150 [moe53]=150 [lead_whisper]=155 [lead_t5]=75)
  script_lane 0 tower48 wstep49 lead_whisper &
  [ "$lane1_gpu" = 0 ] && wait
  script_lane "$lane1_gpu" mla55 moe53 lead_t5 &
  wait
  for name in tower48 wstep49 mla55 moe53 lead_whisper lead_t5; do echo "== $name"; grep -vi warning "$w/$name.log" | tail -40 | cut -c1-600; done
  ;;
34)
  # Session 25's helpers' second call (two lanes; one after the other on one GPU): each helper's lines from
  # /tmp/notes/NAME.md "## GPU command" as they stood at ~20:50 UTC, its $OUT a folder of this call's archive; then the
  # lead's: Whisper large-v3 and Flan-T5-XL (FP8 weights and pools) against transformers' best batches in the same
  # lease (issue 49's two 5x goals).
  export PYTHON w
  lane1_gpu=1; "$PYTHON" -c "import torch, sys; sys.exit(torch.cuda.device_count() < 2)" || lane1_gpu=0
  cat > "$w/tower48.sh" <<'HELPER_LINES'
export PYTHONPATH=$PWD
timeout 22 $PYTHON -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_window_attention.py tests/kernels/test_kernel_elementwise.py tests/engine/test_qwen2_vl.py -k "window or rms_norm_with_and_without or ((cuda_tower_rows_equal_cpu_rows or bf16_tower) and qwen2_5_vl)" > $OUT/t48_tests.log 2>&1; echo "tests rc $?"; tail -4 $OUT/t48_tests.log | cut -c1-300
timeout 108 $PYTHON benchmarks/engine/vlm_bench.py --sections encoder,offline --image-sizes 448 --encoder-batches 32 --hf-batches= --encode-batch 32 --also-encode-batches 32 --tower-variants window-triton,window-triton-h1w4,window-triton-h1w8l1,window-triton-h1w4l2,residual-product,window-triton+residual-product,window-sdpa+residual-norm --offline-variants window-triton+residual-product --out $OUT/vlm.json --results-md $OUT/vlm.md > $OUT/t48_vlm.log 2>&1; echo "vlm rc $?"; grep -E "^encoder 448|^offline (text|image)[a-z0-9_+-]*: [0-9]|Error|failed" $OUT/t48_vlm.log | cut -c1-200
HELPER_LINES
  cat > "$w/wstep49.sh" <<'HELPER_LINES'
export PYTHONPATH=$PWD; timeout 45 $PYTHON -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_l2_prefetch.py tests/engine/test_whisper_fused_decode.py tests/engine/test_encoder_decoder_graphs.py 2>&1 | tail -3; timeout 85 $PYTHON -u benchmarks/engine/encdec_bench.py --sections whisper_step --step-variants default,weight-prefetch,prefetch,prefetch-kv,weight-prefetch-kv,prefetch2,fused-prefetch-kv --out $OUT/wstep.json --results-md $OUT/wstep.md > $OUT/wstep.log 2>&1; echo "wstep rc $?"; grep -E "^whisper_step|Error|Traceback" $OUT/wstep.log | cut -c1-420 | tail -9
HELPER_LINES
  cat > "$w/mla55.sh" <<'HELPER_LINES'
export PYTHONPATH=$PWD TRITONLLM_PREFILL_GRAPHS=0
TRITONLLM_WEIGHT_PREFETCH=0 timeout 70 $PYTHON benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out $OUT/ds_off.json --results-md $OUT/ds_off.md 2>&1 | grep -E "Error|Traceback|load-time|decode graphs" | head -4; tail -2 $OUT/ds_off.md | cut -c1-160
TRITONLLM_WEIGHT_PREFETCH=1 timeout 58 $PYTHON benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode --max-batch-size 8 --max-num-tokens 256 --max-seq-len 1024 --out $OUT/ds_bulk.json --results-md $OUT/ds_bulk.md 2>&1 | grep -E "Error|Traceback|load-time|decode graphs" | head -4; tail -2 $OUT/ds_bulk.md | cut -c1-160; for f in off bulk; do timeout 3 $PYTHON -c "import json,sys; d=json.load(open(sys.argv[1]))['decode']; print(sys.argv[1], d.get('launch_choice')); print(d.get('graph_step_profile'))" $OUT/ds_$f.json 2>&1 | head -12; done
HELPER_LINES
  cat > "$w/moe53_mx.sh" <<'HELPER_LINES'
timeout 120 $PYTHON benchmarks/engine/engine_bench.py --sections bandwidth,decode --max-batch-size 16 --model gpt_oss_20b_mxfp4 --out $OUT/mx.json --results-md $OUT/mx.md 2>&1 | grep -v -i warn | tail -12
HELPER_LINES
  cat > "$w/moe53_bf.sh" <<'HELPER_LINES'
timeout 120 $PYTHON benchmarks/engine/engine_bench.py --sections bandwidth,decode --max-batch-size 16 --model gpt_oss_20b --out $OUT/bf.json --results-md $OUT/bf.md 2>&1 | grep -v -i warn | tail -12
HELPER_LINES
  cat > "$w/lead_hf.sh" <<'LEAD_LINES'
timeout 160 $PYTHON -u benchmarks/engine/encdec_bench.py --sections whisper,t5 --quantization fp8 --kv-cache-dtype fp8 --cross-kv-cache-dtype fp8 --hf-whisper-batches 64 --hf-t5-batches 256 --out $OUT/encdec_hf.json --results-md $OUT/encdec_hf.md > $OUT/encdec_hf.log 2>&1; echo "encdec rc $?"; grep -vi warn $OUT/encdec_hf.log | grep -E "audio s/s|tok/s|run:|Error|Traceback" | tail -8 | cut -c1-480
LEAD_LINES
  declare -A LIMITS=([tower48]=135 [wstep49]=135 [mla55]=135 [moe53_mx]=125 [moe53_bf]=125 [lead_hf]=165)
  script_lane 0 tower48 wstep49 moe53_bf &
  [ "$lane1_gpu" = 0 ] && wait
  script_lane "$lane1_gpu" mla55 moe53_mx lead_hf &
  wait
  for name in tower48 wstep49 mla55 moe53_mx moe53_bf lead_hf; do echo "== $name"; grep -vi warning "$w/$name.log" | tail -40 | cut -c1-600; done
  ;;
lanes)
  # Any session's lane scripts (from session 26 on): LANES_DIR holds NAME.sh files, each a bash script run with
  # $OUT its own folder and $PYTHON set, its first line "# limit SECONDS" (its guard; 150 if absent). LANE0 and
  # LANE1 name the scripts of each GPU's lane, run one after the other (both lanes on GPU 0 where one GPU is).
  # The scripts are committed beside the figures they made (benchmarks/engine/lanes/SESSION_CALL/).
  export PYTHON w
  lanes_dir=$(realpath "${LANES_DIR:?LANES_DIR: the folder of the lane scripts}")
  lane1_gpu=1; "$PYTHON" -c "import torch, sys; sys.exit(torch.cuda.device_count() < 2)" || lane1_gpu=0
  declare -A LIMITS=()
  for name in ${LANE0:-} ${LANE1:-}; do
    [ -f "$lanes_dir/$name.sh" ] || { echo "[x2] lanes: no $lanes_dir/$name.sh"; exit 2; }
    cp "$lanes_dir/$name.sh" "$w/$name.sh"
    limit=$(sed -n '1s/^# limit \([0-9]*\).*/\1/p' "$w/$name.sh"); LIMITS[$name]=${limit:-150}
  done
  # shellcheck disable=SC2086
  script_lane 0 ${LANE0:-} &
  [ "$lane1_gpu" = 0 ] && wait
  # shellcheck disable=SC2086
  script_lane "$lane1_gpu" ${LANE1:-} &
  wait
  for name in ${LANE0:-} ${LANE1:-}; do echo "== $name"; grep -vi warning "$w/$name.log" | tail -40 | cut -c1-600; done
  ;;
*) echo "x2_gpu_run.sh: CALL must be 1 to 34 or lanes, got '$call'"; exit 2 ;;
esac
tar czf "$out/call$call.tgz" -C /tmp "x2_call$call"
for md in "$w"/*.md; do [ -f "$md" ] && cp "$md" "$out/"; done
echo "[x2] call $call done in $(( $(date +%s) - t0 )) s; $out: $(ls "$out" | tr '\n' ' ')"
