# limit 560
# Session 29 call 2: fi29's FlashInfer decode-attention anchor beside ours (issue 51; carry .anchors), then moe29's
# block-FP8 Qwen3-30B-A3B batch 1 against bf16 with a cold load (issue 53). Each part tars its own files.
OUT=${1:?usage: anchor_moe.sh OUT}
export PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3} PYTHONPATH=$PWD
P=$PYTHON
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
pack() { (cd $OUT/$1 && tar czf ../$1.tgz *) && rm -rf $OUT/$1; }

# 1. fi29 (<= 250 s)
D=$OUT/fi; mkdir -p $D
nproc; which nvcc ninja
timeout 250 $P benchmarks/kernels/decode_attention_anchor_bench.py --out $D --jit_timeout 150 > $D/log.txt 2>&1; echo "fi rc $?"
tail -c 5000 $D/log.txt
pack fi

# 2. moe29 (<= 180 s)
D=$OUT/moe; mkdir -p $D
( export TRITON_CACHE_DIR=$(mktemp -d) TRITONLLM_KERNEL_CHOICE_CACHE=$(mktemp -d)
E="benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode --max-batch-size 16"
timeout 85 $P $E --quantization fp8_block --out $D/fp8_block.json > $D/fp8_block.log 2>&1; echo "fp8_block rc $?"
timeout 30 $P -m pytest -q -rfE -p no:cacheprovider -n 0 tests/kernels/test_fused_moe.py tests/kernels/test_fp8_block_skinny.py tests/kernels/test_moe_gemv.py -k "half_logits or every_bits_tiling or (kernel_equals_reference and fp8_block) or (dot_tiles_equal and (tiles6 or tiles9 or tiles10))" > $D/tests.log 2>&1
TRITONLLM_MOE_GEMV_DOT=0 timeout 60 $P $E --out $D/bf16.json > $D/bf16.log 2>&1; echo "bf16 rc $?"
timeout 5 $P benchmarks/engine/decode_profile_summary.py $D/fp8_block.json $D/bf16.json --rows 12 --tokens 1 2 4 8 > $D/summary.txt 2>&1 )
tail -3 $D/tests.log; grep -h "\[load" $D/fp8_block.log $D/bf16.log | cut -c1-400; grep -hE "batch-1 decode|Error|Traceback" $D/fp8_block.log $D/bf16.log | cut -c1-400 | tail -8; head -40 $D/summary.txt | cut -c1-250
pack moe
