# limit 230
# Session 28 call 8: Scout loads again with the shared-expert stacking opt-in (549358c); batch-1 decode in block-FP8
# (with moegemv28's DOT / BITS candidates, default since 312a175) and per-channel FP8.
OUT=${1:?usage: scout_verify.sh OUT}
P=${PYTHON:-/opt/torch/.venv/bin/python3}
E="--model llama4_scout --dtype bfloat16 --max-seq-len 2048 --max-num-tokens 8192 --max-batch-size 256"
timeout 140 $P benchmarks/engine/engine_bench.py $E --quantization fp8_block --sections bandwidth,decode --out $OUT/scout_fp8_block.json > $OUT/scout_fp8_block.log 2>&1; echo "scout fp8_block rc $?"
grep -hE "^\| (batch-1|decode roofline)|Error|^\[load" $OUT/scout_fp8_block.log | cut -c1-700
timeout 75 $P benchmarks/engine/engine_bench.py $E --quantization fp8 --sections bandwidth,decode --out $OUT/scout_fp8.json > $OUT/scout_fp8.log 2>&1; echo "scout fp8 rc $?"
grep -hE "^\| (batch-1|decode roofline)|Error|^\[load" $OUT/scout_fp8.log | cut -c1-700
