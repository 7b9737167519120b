# limit 560
# Issue 53: Qwen3-30B-A3B batch-1 decode, the default against each opt-in option, bf16 then block-FP8, one engine
# process an option (benchmarks/next_gpu_runs.md, "First: issue 53's Qwen3-30B-A3B options").
OUT=${1:?usage: moe53_options.sh OUT}
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3}
for o in none TRITONLLM_MOE_NORM_ROUTER=1 TRITONLLM_QK_NORM_IN_ATTENTION=1 TRITONLLM_MOE_GEMV_AHEAD=1; do
  n=bf16_${o%%=*}
  env $([ $o = none ] || echo $o) timeout 75 $PYTHON benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode \
    --max-batch-size 16 --out $OUT/$n.json > $OUT/$n.log 2>&1
  echo "$n rc=$?: $(grep "batch-1 decode" $OUT/$n.log | cut -c1-150)"
done
for o in none TRITONLLM_MOE_NORM_ROUTER=1 TRITONLLM_MOE_GEMV_AHEAD=1; do
  n=fp8_${o%%=*}
  env $([ $o = none ] || echo $o) timeout 75 $PYTHON benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --quantization fp8_block \
    --sections decode --max-batch-size 16 --out $OUT/$n.json > $OUT/$n.log 2>&1
  echo "$n rc=$?: $(grep "batch-1 decode" $OUT/$n.log | cut -c1-150)"
done
timeout 10 $PYTHON benchmarks/engine/decode_profile_summary.py $OUT/bf16_*.json $OUT/fp8_*.json --rows 9 > $OUT/summary.txt 2>&1
cat $OUT/summary.txt | head -120
# at most 8 files come back from a device call: the runs' JSONs and logs in one tarball
(cd $OUT && tar czf moe53_runs.tgz *.json *.log && rm -f *.json *.log)
