# limit 360
# Issue 53: block-FP8 decode products without activation quantization (fp8blk), the engines' batch-1 decode and the
# new CUDA tests; then SGLang's Triton fused-MoE kernel beside ours (anchor53; carry .anchors).
OUT=${1:?usage: fp8blk_anchor.sh OUT}
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
timeout 40 $P benchmarks/quantization/fp8_block_bench.py --model qwen3_moe --rows 1 8 16 > $OUT/bench.log 2>&1
E="benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode --max-batch-size 16"
timeout 70 $P $E --quantization fp8_block --out $OUT/fp8_block.json > $OUT/fp8_block.log 2>&1
timeout 50 $P $E --out $OUT/bf16.json > $OUT/bf16.log 2>&1
timeout 30 $P -m pytest -q -rfEs -p no:cacheprovider -n 0 tests/kernels/test_fp8_block_skinny.py "tests/engine/test_fp8_block_checkpoints.py::test_bf16_block_engine_decodes_on_the_unquantized_skinny_kernel[qwen3_moe]" > $OUT/tests.log 2>&1
timeout 8 $P benchmarks/engine/decode_profile_summary.py $OUT/bf16.json $OUT/fp8_block.json --rows 9 > $OUT/summary.txt 2>&1
cat $OUT/bench.log; grep -hE "batch-1 decode|^\[load|Error" $OUT/fp8_block.log $OUT/bf16.log | tail -16; head -40 $OUT/summary.txt; tail -6 $OUT/tests.log
timeout 150 $P -u benchmarks/kernels/moe_anchor_bench.py --out $OUT > $OUT/anchor.log 2>&1; echo "anchor rc $?"; grep -vi warning $OUT/anchor.log | tail -45
(cd $OUT && tar czf fp8blk.tgz bench.log fp8_block.log bf16.log tests.log fp8_block.json bf16.json && rm -f bench.log fp8_block.log bf16.log tests.log fp8_block.json bf16.json)
ls $OUT
