#!/bin/bash
# Issue 53's GEMV expert path (kernels/moe_gemv.py) in one device call on one H200 (BUDGET_S, default 120, caps
# it): the kernel bench against the grouped path at 1/2/4/8 tokens (Qwen3-30B-A3B experts: KINDS, default
# block-FP8 and bf16, ~20 s a kind with a cold Triton cache: 17 compiles), the GEMV GPU tests (~30 s), then
# engine_bench batch-1 decode of Qwen3-30B-A3B with block-FP8 weights (--quantization fp8_block) and bf16, each
# only if 100 s are left (load, the choices at load, graphs: ~110 s with a cold Triton cache). Logs under $1.
#   bash benchmarks/kernels/moe_gemv_gpu_run.sh OUT_DIR
set -u
# shellcheck source=benchmarks/gpu_run_common.sh
. "$(dirname "$0")/../gpu_run_common.sh"
budget_start "${1:-/tmp/moe_gemv_gpu_run}" "${BUDGET_S:-120}"
timeout $(( $(left) - 40 )) "$PYTHON" -u benchmarks/kernels/moe_gemv_bench.py --kinds ${KINDS:-fp8_block bf16} \
  --out "$out/moe_gemv.json" > "$out/kernel_bench.log" 2>&1
echo "kernel bench (rc $?, $(( $(date +%s) - t0 )) s in):"; grep -v Warning "$out/kernel_bench.log"
timeout $(( $(left) > 45 ? 45 : $(left) )) "$PYTHON" -m pytest -q tests/kernels/test_moe_gemv.py -p no:cacheprovider \
  > "$out/tests.log" 2>&1
echo "tests (rc $?, $(( $(date +%s) - t0 )) s in):"; grep -E "passed|failed|^FAILED|^ERROR" "$out/tests.log" | tail -8
engine() {  # $1: none | fp8_block; $2: seconds at most
  qwen3_moe_decode "$1" "$1" "$2"
  "$PYTHON" -c "import json, sys; d = json.load(open(sys.argv[1])).get('decode', {}).get('gemm_choices', {})
for k, v in d.items():
    print(' ', k, v) if k.startswith('moe_decode') else None" "$out/engine_$1.json" 2>/dev/null | cut -c1-400
}
[ "$(left)" -gt 100 ] && engine fp8_block "$(left)" || echo "engine_bench fp8_block skipped: $(left) s left"
[ "$(left)" -gt 100 ] && engine none "$(left)" || echo "engine_bench bf16 skipped: $(left) s left"
echo "total $(( $(date +%s) - t0 )) s"
