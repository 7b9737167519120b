# limit 560
# Session 28 call 7 (the session's last device time): scout28's Llama 4 decode (split router launch, one-launch
# routing with the stacked shared expert), moegemv28's DOT / BITS expert and dense block-FP8 tiles, graphin28's
# staging checks and the step's parts outside the graph. Each part tars its own files, so a cut call keeps the rest.
OUT=${1:?usage: helpers_final.sh OUT}
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
pack() { (cd $OUT/$1 && tar czf ../$1.tgz *) && rm -rf $OUT/$1; }

# 1. scout28 (200 s)
D=$OUT/scout; mkdir -p $D
E="--model llama4_scout --dtype bfloat16 --max-seq-len 2048 --max-num-tokens 8192 --max-batch-size 256"
timeout 110 $P benchmarks/engine/engine_bench.py $E --quantization fp8 --sections bandwidth,decode --out $D/scout_fp8.json > $D/scout_fp8.log 2>&1; echo "scout fp8 rc $?"
timeout 65 $P benchmarks/engine/engine_bench.py $E --quantization fp8_block --sections bandwidth,decode --out $D/scout_fp8_block.json > $D/scout_fp8_block.log 2>&1; echo "scout fp8_block rc $?"
timeout 25 $P -m pytest -q -rfE -p no:cacheprovider -n 0 tests/kernels/test_llama4_router.py tests/engine/test_llama4.py::test_one_launch_routing_with_the_norm_equals_the_unfused_moe_block > $D/tests.log 2>&1; echo "scout tests rc $?"
grep -hE "^\| (batch-1|decode roofline)|Error|error" $D/scout_fp8.log $D/scout_fp8_block.log | cut -c1-700 | tail -20; tail -4 $D/tests.log
pack scout

# 2. moegemv28 (200 s)
D=$OUT/moe; mkdir -p $D
B="benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode --max-batch-size 16"
TRITONLLM_MOE_GEMV_DOT=1 TRITONLLM_FP8_BLOCK_BITS=1 timeout 115 $P $B --quantization fp8_block --out $D/fp8_block.json > $D/fp8_block.log 2>&1; echo "qwen3 fp8_block (DOT, BITS) rc $?"
timeout 50 $P $B --out $D/bf16.json > $D/bf16.log 2>&1; echo "qwen3 bf16 rc $?"
timeout 30 $P -m pytest -q -rfE -p no:cacheprovider -n 0 tests/kernels/test_moe_gemv.py tests/kernels/test_fp8_block_skinny.py -k "(dot_tiles_equal and (tiles0 or tiles5 or tiles6 or tiles8 or tiles9)) or (kernel_equals and bits)" > $D/tests.log 2>&1; echo "moe tests rc $?"
timeout 5 $P benchmarks/engine/decode_profile_summary.py $D/fp8_block.json $D/bf16.json --rows 8 --tokens 1 2 4 8 > $D/summary.txt 2>&1
tail -3 $D/tests.log; grep -hE "batch-1 decode|Error|Traceback" $D/fp8_block.log $D/bf16.log | cut -c1-900 | tail -8; head -30 $D/summary.txt | cut -c1-300
timeout 5 $P -c "import json, sys; d = json.load(open(sys.argv[1]))['decode']['gemm_choices']; [print(k, str(v)[:300]) for k, v in d.items() if 'fp8_block_skinny' in k]" $D/fp8_block.json
pack moe

# 3. graphin28's GPU checks of the staged copies (55 s)
D=$OUT/graph; mkdir -p $D
T=tests/engine/test_cuda_graphs.py
timeout 55 $P -m pytest -v -rfE -p no:cacheprovider -n 0 "$T::test_graph_mixed_steps_match_eager[5-None-None]" "$T::test_tree_graph_steps_and_layer_taps_match_eager[None]" "$T::test_graph_decode_matches_eager_decode[9]" > $D/t.log 2>&1; echo "graph tests rc $?"
grep -E "PASSED|FAILED|ERROR|passed|failed|Error" $D/t.log | tail -8
pack graph

# 4. graphin28's step parts, Qwen3 block-FP8 without the DOT / BITS tiles (60 s; last: a cut loses only this)
D=$OUT/steps; mkdir -p $D
timeout 60 $P benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode --max-batch-size 16 --quantization fp8_block --out $D/qwen3_fp8_block.json > $D/qwen3.log 2>&1; echo "qwen3 steps rc $?"
grep -hE "batch-1|Error|Traceback" $D/qwen3.log | cut -c1-1500
pack steps
