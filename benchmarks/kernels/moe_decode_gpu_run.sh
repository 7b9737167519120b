#!/bin/bash
# Issue 53's decode-sized experts in one device call (~200 s on one H200; BUDGET_S, default 260, caps
# it): the one-launch kernel's GPU tests (and the tiny MoE engines with it against transformers);
# engine_bench batch-1 decode of Qwen3-30B-A3B with the switch on (bf16); the kernel bench against the default path (Qwen3-30B-A3B and gpt-oss-20b shapes, bf16,
# block-FP8 and INT4, 1/8/16 tokens, tile sweep); engine_bench block-FP8 with the switch if time is left.
# Logs under $1.
#   bash benchmarks/kernels/moe_decode_gpu_run.sh OUT_DIR
set -u
# shellcheck source=benchmarks/gpu_run_common.sh
. "$(dirname "$0")/../gpu_run_common.sh"
budget_start "${1:-/tmp/moe_decode_gpu_run}" "${BUDGET_S:-260}"
timeout 70 "$PYTHON" -m pytest -q tests/kernels/test_moe_decode.py \
  tests/engine/test_moe.py::test_engine_with_one_launch_decode_experts_equals_transformers -p no:cacheprovider \
  > "$out/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR" "$out/tests.log" | tail -12
engine() {  # $1: none | fp8_block; $2: seconds at most
  qwen3_moe_decode "fused_$1" "$1" "$2" TRITONLLM_MOE_DECODE=fused
}
engine none 110  # a cold Triton cache compiles the engine's kernels first
timeout $(( $(left) > 110 ? 110 : $(left) )) "$PYTHON" benchmarks/kernels/moe_decode_bench.py --sweep > "$out/kernel_bench.log" 2>&1
echo "kernel bench (rc $?):"; cat "$out/kernel_bench.log"
[ "$(left)" -gt 40 ] && engine fp8_block "$(left)" || echo "engine_bench fp8_block skipped: $(left) s left"
echo "total $(( $(date +%s) - t0 )) s"
