# limit 400
# Issue 55: Llama-4-Scout's full shape in block-FP8 and per-channel FP8 (scout55); then host27's decode iteration's
# parts at batch 512 / 128 on Llama-3.1-8B's shape.
OUT=${1:?usage: scout_fp8_host.sh OUT}
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
E="--model llama4_scout --dtype bfloat16 --max-seq-len 2048 --max-num-tokens 8192 --max-batch-size 256"
timeout 150 $P benchmarks/engine/engine_bench.py $E --quantization fp8_block --sections bandwidth,decode,offline --offline 128x128x256 --out $OUT/scout_fp8_block.json > $OUT/scout_fp8_block.log 2>&1
echo "scout fp8_block rc=$?"
timeout 75 $P benchmarks/engine/engine_bench.py $E --quantization fp8 --sections bandwidth,decode --out $OUT/scout_fp8.json > $OUT/scout_fp8.log 2>&1
echo "scout fp8 rc=$?"
grep -hE "^\| (batch-1|decode roofline|offline|\.\.\.|executor KV)|^\[load|Error|error" $OUT/scout_fp8_block.log $OUT/scout_fp8.log | tail -40
timeout 150 $P benchmarks/engine/engine_bench.py --model llama8b --sections executor_decode --executor-decode-batches 512,128 --executor-decode-profile-seconds 0 --hf-batches= --out $OUT/host.json > $OUT/host.log 2>&1
echo "host rc=$?"; grep -v "^\[load" $OUT/host.log | tail -30
