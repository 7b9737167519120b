# limit 520
# Session 28 call 6: scout28's Llama 4 decode (one-kernel attention, one-launch top-1 routing) on Scout's full shape
# with its CUDA tests; graphin28's decode-graph input copy A/B and the step's parts; the MoE block-tiled kernel's
# prefill-size tilings (128-row blocks) in bf16 and block-FP8.
OUT=${1:?usage: scout_graphin_sweep.sh OUT}
P=${PYTHON:-/opt/torch/.venv/bin/python3}
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
E="--model llama4_scout --dtype bfloat16 --max-seq-len 2048 --max-num-tokens 8192 --max-batch-size 256"
timeout 80 $P benchmarks/engine/engine_bench.py $E --quantization fp8 --sections bandwidth,decode --out $OUT/scout_fp8.json > $OUT/r/scout_fp8.log 2>&1; echo "scout fp8 rc $?"
timeout 75 $P benchmarks/engine/engine_bench.py $E --quantization fp8_block --sections bandwidth,decode --out $OUT/scout_fp8_block.json > $OUT/r/scout_fp8_block.log 2>&1; echo "scout fp8_block rc $?"
timeout 40 $P -m pytest -q -rfEs -p no:cacheprovider -n 0 tests/kernels/test_llama4_attention.py tests/kernels/test_llama4_router.py tests/engine/test_llama4.py::test_engine_on_cuda_equals_transformers tests/engine/test_llama4_fp8.py::test_fp8_engine_on_cuda_with_decode_graphs > $OUT/r/scout_tests.log 2>&1
grep -hE "^\| (batch-1|decode roofline)|Error|error" $OUT/r/scout_fp8.log $OUT/r/scout_fp8_block.log | tail -20; tail -8 $OUT/r/scout_tests.log
B=benchmarks/engine/engine_bench.py
timeout 70 $P $B --model qwen3_30b_a3b --sections decode --max-batch-size 16 --quantization fp8_block --out $OUT/qwen3_fp8_block.json > $OUT/r/qwen3.log 2>&1; echo "qwen3 rc $?"
timeout 45 $P $B --model llama8b --sections decode --out $OUT/r/llama8b.json > $OUT/r/llama8b.log 2>&1; echo "llama8b rc $?"
grep -hE "batch-1|Error|Traceback" $OUT/r/qwen3.log $OUT/r/llama8b.log | cut -c1-1200
timeout 110 $P benchmarks/kernels/moe_kernel_bench.py --tokens 2048 8192 --sweep > $OUT/r/moe_sweep.log 2>&1; echo "sweep rc $?"
grep -vE "^    .*failed" $OUT/r/moe_sweep.log | grep -E "block_m 128|block_m 64|^\| (2048|8192)" | sort -t: -k2 -n | head -40
timeout 60 $P benchmarks/quantization/moe_fp8_bench.py --sweep_prefill 2048 8192 > $OUT/r/fp8_sweep.log 2>&1; echo "fp8 sweep rc $?"; grep -E "T(2048|8192)" $OUT/r/fp8_sweep.log
(cd $OUT/r && tar czf ../logs.tgz *) && rm -rf $OUT/r
