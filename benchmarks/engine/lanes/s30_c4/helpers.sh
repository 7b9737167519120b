# limit 590
# Session 30 call 4: the helpers' second-hour work: long30 (the 91 x 21,000 decode step in the engine against the kernel
# bench), attnkm30 (keys-major the FP8 default), mla30 (FP8-score MLA, tables ahead, the parts rule), step30 (head graphs at
# batch 1), then Qwen3-30B-A3B block-FP8 batch 1 with the 256-column expert step a candidate. Each part tars its files.
OUTROOT=${1:?usage: helpers.sh OUT}
export COLUMNS=400
pack() { (cd $OUTROOT/$1 && tar czf ../$1.tgz *) && rm -rf $OUTROOT/$1; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUTROOT/gpu.txt

# 1. long30 (<= 118 s)
mkdir -p $OUTROOT/long; ( OUT=$OUTROOT/long
export PYTHONPATH=$PWD TRITONLLM_DECODE_KEYS_MAJOR=1; P=/opt/torch/.venv/bin/python3; B=benchmarks/kernels/attention_kernel_bench.py; K='--grid --pool fp8 --pool_layout head_major --grid_no_standard'; C='decode 91x21000'
timeout 118 nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 500 > $OUT/smi.csv 2>&1 & S=$!
timeout 78 $P benchmarks/engine/step_profile.py --model llama8b --quantization fp8 --kv_cache_dtype fp8 --graph --decode 91x21000 --bucket 96 --page_order in_order,shuffled --kv_gib 123.5 --out $OUT/profile.json > $OUT/profile.log 2>&1; echo "profile rc $?"
timeout 20 $P $B $K --grid_cases "$C" --grid_more "km rotary splits=1;km rotary splits=2;km rotary splits=4;km rotary" --markdown $OUT/bench.md > $OUT/bench_l1.log 2>&1; echo "l1 rc $?"
timeout 18 $P $B $K --grid_cases "$C" --grid_more "km rotary splits=4;km rotary splits=2" --layers 32 --pool_gib 120 --markdown $OUT/bench.md > $OUT/bench_l32_shuffled.log 2>&1; echo "l32 shuffled rc $?"
kill $S; grep -h "pool:\|decode 91x21000 |" $OUT/bench_*.log; sort -t, -k4 -n $OUT/smi.csv | tail -3; grep -v -i warn $OUT/profile.log | cut -c1-200 | tail -45
 ); pack long

# 2. attnkm30 (<= 120 s)
mkdir -p $OUTROOT/km; ( OUT=$OUTROOT/km
P=/opt/torch/.venv/bin/python3; export PYTHONPATH=$PWD COLUMNS=400; (timeout -s INT -k 5 55 $P -m pytest -q -rfE --tb=short -p no:cacheprovider -n 4 -m gpu tests/kernels/test_keys_major_decode.py > $OUT/km_tests.log 2>&1 & timeout -s INT -k 5 55 $P -m pytest -q -rfE --tb=short -p no:cacheprovider -n 4 -m gpu tests/kernels/test_kernel_attention.py -k "fp16_math or rotary_and_kv_append or residency or graph_replay or head_major" > $OUT/attn_tests.log 2>&1; wait); tail -3 $OUT/km_tests.log $OUT/attn_tests.log; timeout 40 $P benchmarks/kernels/attention_kernel_bench.py --grid --pool fp8 --pool_layout head_major --grid_no_standard --grid_cases "decode 48x21000,decode 64x20480,decode 256x20480,decode 8x20480,decode 256x8192,decode 64x8192,decode 8x8192,decode 256x2048,decode 64x2048,decode 1024x2048" --grid_more "bits=auto;bits=auto km=0" --markdown $OUT/km30_fp8.md > $OUT/km30_fp8.log 2>&1; timeout 25 $P benchmarks/kernels/attention_kernel_bench.py --grid --pool bf16 --pool_layout head_major --grid_no_standard --grid_cases "decode 8x8192,decode 8x20480,decode 64x8192,decode 256x8192,decode 256x2048" --grid_more "default;km" --markdown $OUT/km30_bf16.md > $OUT/km30_bf16.log 2>&1; grep -v -i warn $OUT/km30_fp8.log $OUT/km30_bf16.log | cut -c1-120 | grep "decode\|passed\|failed" | head -40
 ); pack km

# 3. mla30 (<= 120 s)
( OUT=$OUTROOT
export PYTHONPATH=$PWD; P=/opt/torch/.venv/bin/python3; D=$OUT/mla30; mkdir -p $D
B="benchmarks/kernels/mla_kernel_bench.py --shape v2_lite --check --repeat 10"
timeout 45 $P $B --pool fp8 --batches 64,32,8 --contexts 32768,8192 --configs auto,auto+p1,auto+p1+t,d16:4:4+p8+t,auto+t+q8 --out $D/fp8.json > $D/fp8.log 2>&1; echo "fp8 rc $?"
timeout 25 $P $B --pool bf16 --batches 64,32,8 --contexts 32768,8192 --configs auto,auto+p1,auto+p1+t,d16:4:4+p8+t --out $D/bf16.json > $D/bf16.log 2>&1; echo "bf16 rc $?"
timeout 12 $P $B --pool fp8 --batches 1,32 --contexts 1024,32768 --configs auto,auto+t+q8 --out $D/small.json > $D/small.log 2>&1; echo "small rc $?"
timeout 38 $P -m pytest -q -rfEs --tb=short -p no:cacheprovider -n 0 tests/kernels/test_mla_attention.py -k "fp8_score or a_tile_ahead or column_parts_by_the_grid" > $D/tests.log 2>&1; echo "tests rc $?"
grep -hE "batch|Error|Traceback" $D/fp8.log $D/bf16.log $D/small.log | cut -c1-150 | tail -45; tail -3 $D/tests.log
 ); pack mla30

# 4. step30 (<= 117 s)
mkdir -p $OUTROOT/step; ( OUT=$OUTROOT/step
export PYTHONPATH=$PWD; P=/opt/torch/.venv/bin/python3; S=$SECONDS; timeout 95 $P benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections decode --max-batch-size 16 --out $OUT/v2lite.json > $OUT/v2lite.log 2>&1; echo "v2lite rc $? $((SECONDS-S)) s"; S=$SECONDS; timeout 22 $P -m pytest -v -rfE -p no:cacheprovider -n 0 "tests/engine/test_cuda_graphs.py::test_head_graph_logits_and_greedy_ids_match_the_eager_head" > $OUT/t.log 2>&1; echo "tests rc $? $((SECONDS-S)) s"; grep -hE "batch-1|Error|Traceback|stays eager" $OUT/v2lite.log | cut -c1-1500; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/t.log | tail -6
 ); pack step

# 5. Qwen3-30B-A3B block-FP8 batch 1 (<= 95 s; last: a cut loses only this)
mkdir -p $OUTROOT/qwen; ( OUT=$OUTROOT/qwen; export PYTHONPATH=$PWD; P=/opt/torch/.venv/bin/python3
timeout 95 $P benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode --max-batch-size 16 --quantization fp8_block --out $OUT/fp8_block.json > $OUT/fp8_block.log 2>&1; echo "qwen rc $?"
grep -hE "\[load|batch-1 decode|Error|Traceback" $OUT/fp8_block.log | cut -c1-300 | tail -6 ); pack qwen
