# limit 420
# Session 29 call 1: what session 28 built and never ran on a GPU (benchmarks/next_gpu_runs.md "First"): the Llama 4
# CUDA tests, bf16 experts on the DOT tiles (Qwen3-30B-A3B), and today's baselines for this session's helpers: the
# paged decode attention's bandwidth on FP8 / bf16 pools (issue 51) and DeepSeek-V2-Lite batch 1 (issue 55). Each part
# tars its own files, so a cut call keeps the rest.
OUT=${1:?usage: first.sh OUT}
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
pack() { (cd $OUT/$1 && tar czf ../$1.tgz *) && rm -rf $OUT/$1; }

# 1. the decode attention kernel's baseline at issue 51's grid (80 s)
D=$OUT/attn; mkdir -p $D
timeout 80 $P benchmarks/kernels/attention_kernel_bench.py --pool fp8,bf16 --cases "decode 8x2048,decode 64x2048,decode 256x2048,decode 8x8192,decode 64x8192,decode 256x8192,decode 8x20000,decode 64x20000,decode 256x20000,decode 48x21000" --markdown $D/attn.md > $D/attn.log 2>&1; echo "attn rc $?"
cat $D/attn.md 2>/dev/null | cut -c1-250 | tail -24
pack attn

# 2. bf16 experts: DOT tiles against the default, then DeepSeek-V2-Lite bf16 (150 s)
D=$OUT/moe; mkdir -p $D
B="benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode --max-batch-size 16"
timeout 55 $P $B --out $D/bf16.json > $D/bf16.log 2>&1; echo "qwen3 bf16 rc $?"
TRITONLLM_MOE_GEMV_DOT=1 timeout 55 $P $B --out $D/bf16_dot.json > $D/bf16_dot.log 2>&1; echo "qwen3 bf16 DOT rc $?"
timeout 60 $P benchmarks/engine/engine_bench.py --model deepseek_v2_lite --sections bandwidth,decode --max-batch-size 16 --out $D/v2lite.json > $D/v2lite.log 2>&1; echo "v2lite rc $?"
timeout 8 $P benchmarks/engine/decode_profile_summary.py $D/bf16.json $D/bf16_dot.json $D/v2lite.json --rows 8 --tokens 1 2 4 8 > $D/summary.txt 2>&1
grep -hE "batch-1 decode|roofline|Error|Traceback" $D/*.log | cut -c1-600 | tail -12; head -60 $D/summary.txt | cut -c1-250
pack moe

# 3. the Llama 4 CUDA tests (scout28's split routing launch and one-kernel attention in the engine) (150 s)
D=$OUT/llama4; mkdir -p $D
timeout 150 $P -m pytest -q -rfEs -p no:cacheprovider -n 0 tests/kernels/test_llama4_router.py tests/kernels/test_llama4_attention.py tests/engine/test_llama4.py tests/engine/test_llama4_fp8.py tests/engine/test_llama4_int4.py -m gpu > $D/tests.log 2>&1; echo "llama4 tests rc $?"
grep -E "passed|failed|FAILED|ERROR" $D/tests.log | tail -12
pack llama4
