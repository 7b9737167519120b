# limit 580
# Issue 53: the new defaults (q/k norms in attention; normed router for bf16 experts) against both off, and the
# AHEAD GEMV tiles now that the choice cache keys them (0d44849); then issue 48's offline VLM run with transformers.
OUT=${1:?usage: moe53_defaults_vlm48.sh OUT}
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3}
mkdir -p $OUT/runs
run() {  # name, extra env..., -- engine_bench args
  local n=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 90 $PYTHON benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode \
    --max-batch-size 16 --out $OUT/runs/$n.json "$@" > $OUT/runs/$n.log 2>&1
  echo "$n rc=$?: $(grep "batch-1 decode" $OUT/runs/$n.log | cut -c1-150)"
}
run bf16_both_off TRITONLLM_MOE_NORM_ROUTER=0 TRITONLLM_QK_NORM_IN_ATTENTION=0 --
run bf16_default X=1 --
run bf16_default_ahead TRITONLLM_MOE_GEMV_AHEAD=1 --
run fp8_default X=1 -- --quantization fp8_block
run fp8_default_ahead TRITONLLM_MOE_GEMV_AHEAD=1 -- --quantization fp8_block
timeout 10 $PYTHON benchmarks/engine/decode_profile_summary.py $OUT/runs/*.json --rows 9 > $OUT/moe53_summary.txt 2>&1
grep "json {" $OUT/moe53_summary.txt
timeout 300 $PYTHON benchmarks/engine/vlm_bench.py --sections offline --encode-batch 32 --also-encode-batches 32 \
  --offline-variants fp8-tower --out $OUT/vlm_bench.json > $OUT/vlm.log 2>&1
echo "vlm rc=$?"; grep -v "^\[load" $OUT/vlm.log | tail -40
(cd $OUT/runs && tar czf ../moe53_runs.tgz * ) && rm -rf $OUT/runs
