# limit 560
# Session 29 call 4: the helpers' second versions: attn29 (the H200 key-split policy, widenings, tests), mla29 (FP8
# widened not pure, split policy, keys-major products), moe29 (cold load after pruning, down prefetch A/B), then
# DeepSeek-V2-Lite batch 1 in the engine (the chunked MLA combine). Each part tars its own files.
OUT=${1:?usage: helpers_v2.sh OUT}
export PYTHONPATH=$PWD COLUMNS=400
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
pack() { (cd $OUT/$1 && tar czf ../$1.tgz *) && rm -rf $OUT/$1; }

# 1. attn29 (<= 175 s)
D=$OUT/attn; mkdir -p $D
T=tests/kernels/test_fp8_attention_widening.py
timeout 40 $P -m pytest -q -rfE --tb=line -p no:cacheprovider -n 0 "$T::test_llama_heads_decode_on_a_head_major_pool_is_the_same_whichever_way_e4m3_widens" > $D/tests1.log 2>&1; echo "attn tests1 rc $?"
timeout 35 $P -m pytest -q -rfE --tb=line -p no:cacheprovider -n 0 tests/kernels/test_kernel_attention.py -k "graph_replay or residency or fp8_pool_fp16 or split" > $D/tests2.log 2>&1; echo "attn tests2 rc $?"
timeout 100 $P benchmarks/kernels/attention_kernel_bench.py --grid --pool fp8 --pool_layout head_major --grid_no_standard --grid_cases "decode 48x21000,decode 69x21000,decode 64x20480,decode 256x20480,decode 8x20480,decode 256x8192,decode 64x8192,decode 8x8192,decode 256x2048,decode 64x2048,decode 8x2048,decode 1024x2048" --grid_more "bits=0;bits=0 policy=h100;bits=vcvt;bits=0 tile=64:4:3;bits=vcvt tile=64:4:3;bits=0 rotary" --markdown $D/grid.md > $D/grid.log 2>&1; echo "attn grid rc $?"
grep -v -i warn $D/grid.log | cut -c1-130 | tail -80; tail -4 $D/tests1.log | cut -c1-800; tail -4 $D/tests2.log | cut -c1-600
pack attn

# 2. mla29 (<= 150 s)
D=$OUT/mla; mkdir -p $D
B="benchmarks/kernels/mla_kernel_bench.py --shape v2_lite --repeat 3 --check"; G="--batches 1,8,32,64 --contexts 1024,8192,32768"
timeout 45 $P $B $G --pool fp8 --configs auto+bp+L0,auto+L0,auto,auto+bs --out $D/fp8.json > $D/fp8.log 2>&1; echo "mla fp8 rc $?"
timeout 40 $P $B $G --pool bf16 --configs auto+L0,auto,d64:4:2+k,d64:8:2+k --out $D/bf16.json > $D/bf16.log 2>&1; echo "mla bf16 rc $?"
timeout 10 $P $B --pool bf16 --batches 8,32 --contexts 8192,32768 --configs d32:4:3:128:128:3,d32:4:3:128:128:6 --out $D/waves.json > $D/waves.log 2>&1
timeout 55 $P -m pytest -q -rfE -p no:cacheprovider -n 0 tests/kernels/test_mla_attention.py -k "extremes or decode_kernel_equals or w_uv" > $D/tests.log 2>&1; echo "mla tests rc $?"
tail -3 $D/tests.log; grep -hE "batch|Error|Traceback" $D/fp8.log $D/bf16.log $D/waves.log | cut -c1-170 | tail -110
pack mla

# 3. moe29 (<= 150 s)
D=$OUT/moe; mkdir -p $D
( export TRITON_CACHE_DIR=$(mktemp -d) TRITONLLM_KERNEL_CHOICE_CACHE=$(mktemp -d)
E="benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode --max-batch-size 16 --quantization fp8_block"
timeout 80 $P $E --out $D/fp8_block.json > $D/fp8_block.log 2>&1; echo "moe fp8_block rc $?"
TRITONLLM_MOE_DOWN_PREFETCH=1 timeout 40 $P $E --out $D/fp8_prefetch.json > $D/fp8_prefetch.log 2>&1; echo "moe prefetch rc $?"
timeout 25 $P -m pytest -q -rfE -p no:cacheprovider -n 0 tests/kernels/test_moe_gemv.py tests/kernels/test_fp8_block_skinny.py -k "down_prefetch_keeps or (dot_tiles_equal and (tiles11 or tiles12 or tiles13)) or (every_bits_tiling and (variant3 or variant4))" > $D/tests.log 2>&1
timeout 5 $P benchmarks/engine/decode_profile_summary.py $D/fp8_block.json $D/fp8_prefetch.json --rows 12 --tokens 1 2 4 8 > $D/summary.txt 2>&1 )
tail -3 $D/tests.log; grep -h "\[load" $D/fp8_block.log $D/fp8_prefetch.log | cut -c1-300; grep -hE "batch-1 decode|Error|Traceback" $D/fp8_block.log $D/fp8_prefetch.log | cut -c1-300 | tail -8; head -30 $D/summary.txt | cut -c1-250
pack moe

# 4. DeepSeek-V2-Lite batch 1 (<= 60 s; last: a cut loses only this)
D=$OUT/v2; mkdir -p $D
timeout 60 $P benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode --max-batch-size 16 --out $D/v2lite.json > $D/v2lite.log 2>&1; echo "v2lite rc $?"
grep -hE "batch-1 decode|Error|Traceback" $D/v2lite.log | cut -c1-300
timeout 5 $P benchmarks/engine/decode_profile_summary.py $D/v2lite.json --rows 12 > $D/summary.txt 2>&1; head -16 $D/summary.txt | cut -c1-200
pack v2
