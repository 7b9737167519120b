# limit 120
# Session 33, helper pf51 (issue 51): sm_90's bf16 prompt tiles are now 128 x 128 over 8 warps, 3 stages at every
# context (kernels/triton_attention.py PREFILL_SM90_TILINGS; the tile maps count 128 // group tokens a tile there).
# 1. The GPU tests of what that touches, on this H200 (real sm_90, so the bf16 cases run the new rows): prompt and mixed
#    steps (tile maps with padding, windows, soft-caps, sinks, ALiBi, group 3 and 1, heads of 96), long prompts, the
#    short tree steps (split, in-launch append: 128 rows, 64 keys, 8 warps, 2 stages), the config tests.
# 2. attention_kernel_bench.py's prompt cases on the bf16 pool (Llama-8B heads, paged, served tile map, CUDA graphs):
#    the default (its rows must name 128x128x8x3) against --sweep_prefill 64:64:4:2 (the old default), as fa51.sh.
# ~70-100 s. (A CPU dry run: TRITON_INTERPRET=1 DEV="--device cpu" CASES="chunk 40 over 56" WARM_CASE="chunk 40 over
# 56" TESTS=0 BENCH_LIMIT=300; its verdict is NO: the CPU is not sm_90)
OUT=${1:?usage: pf51.sh OUT}
export PYTHONPATH=$PWD COLUMNS=400 TRITON_DEFAULT_FP_FUSION=1
P=${PYTHON:-/opt/torch/.venv/bin/python3}
B=benchmarks/kernels/attention_kernel_bench.py
DEV=${DEV:-}
CASES=${CASES:-"prompt20k,prefill 4x2048,chunk 1024 over 2048"}
WARM_CASE=${WARM_CASE:-"chunk 1024 over 2048"}
T0=$(date +%s)
timeout 20 nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader | tee $OUT/gpu.txt
# The bench's two tilings compile into Triton's cache while the tests run (its timed run below then loads them).
( timeout 75 $P $B $DEV --pool bf16 --cases "$WARM_CASE" > $OUT/warm_default.log 2>&1 || echo "warm default: rc $?"
) & WD=$!
( timeout 75 $P $B $DEV --pool bf16 --cases "$WARM_CASE" --sweep_prefill 64:64:4:2 > $OUT/warm_old.log 2>&1 \
  || echo "warm 64:64:4:2: rc $?" ) & WO=$!
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests $(date -u +%T)"
  timeout 62 $P -m pytest -q -p no:cacheprovider -n 8 -m gpu \
    tests/kernels/test_kernel_attention.py tests/kernels/test_tree_attention.py tests/kernels/test_attention_sinks.py \
    tests/kernels/test_attention_alibi.py \
    -k "(prefill or mixed_batch or short_tree_step or tree_mask_kernel or long_context) and not fp8_pool_fp16" \
    > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $? ($(( $(date +%s) - T0 )) s)"
  tail -n 4 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-250 | head -12
  # the config tests (unmarked: CPU logic, the capability faked) and their interpreter cases skip themselves here
  timeout 30 $P -m pytest -q -p no:cacheprovider -n 0 tests/kernels/test_prefill_config_sm90.py > $OUT/config_tests.log \
    2>&1; echo "config tests rc $?: $(tail -n 1 $OUT/config_tests.log)"
fi
wait $WD $WO
echo "warm-up done ($(( $(date +%s) - T0 )) s)"
echo "== bench $(date -u +%T)"
timeout ${BENCH_LIMIT:-38} $P $B $DEV --pool bf16 --cases "$CASES" --sweep_prefill 64:64:4:2 --check --pivot \
  --json $OUT/bf16.json --markdown $OUT/bf16.md > $OUT/bf16.log 2>&1; echo "bf16 rc $? ($(( $(date +%s) - T0 )) s)"
[ -s $OUT/bf16.md ] && cat $OUT/bf16.md
grep -h "'error'\|FAIL\|Error" $OUT/bf16.log | grep -v -i warn | cut -c1-300 | head -8
# The verdict: every prompt case's default launched 128x128x8x3, checked ok where checked; old / new per case.
timeout 30 $P - $OUT/bf16.json <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
rows = data["rows"] if isinstance(data, dict) else data
default = {r["case"]: r for r in rows if r["tiling"] == "default"}
old = {r["case"]: r for r in rows if r["tiling"] == "prefill 64:64:4:2"}
took = all(r["config"] == "128x128x8x3" for r in default.values() if r["config"] != "-")
bad = [r["case"] for r in rows if r.get("check", "ok") not in ("ok", "-")]
print("| case | default (config) us | 64x64x4x2 us | old / new |")
for case, r in default.items():
    o = old.get(case, {}).get("us")
    ratio = "-" if not o else "%.2fx" % (o / r["us"])
    print(f"| {case} | {r['us']} ({r['config']}, {r.get('check', '')}) | {o} | {ratio} |")
print(f"DEFAULT TOOK 128x128x8x3: {'yes' if took and default else 'NO'}; checks: {'all ok' if not bad else bad}")
EOF
echo "== done $(date -u +%T) ($(( $(date +%s) - T0 )) s)"
