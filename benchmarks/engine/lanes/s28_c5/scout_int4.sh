# limit 300
# Issue 55: Llama-4-Scout's full shape in INT4 weight-only (scoutint4), then the first CUDA run of its GPU test.
OUT=${1:?usage: scout_int4.sh OUT}
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
E="--model llama4_scout --dtype bfloat16 --max-seq-len 2048 --max-num-tokens 8192 --max-batch-size 256"
timeout 200 $P benchmarks/engine/engine_bench.py $E --quantization int4_wo --sections bandwidth,decode,offline --offline 128x128x256 --out $OUT/scout_int4.json > $OUT/scout_int4.log 2>&1
echo "scout int4 rc=$?"
timeout 90 $P -m pytest -q -rfEs -p no:cacheprovider -n 0 -m gpu tests/engine/test_llama4_int4.py > $OUT/gpu_test.log 2>&1
grep -hE "^\| (batch-1|decode roofline|offline|\.\.\.|executor KV)|^\[load|Error|error|passed|failed" $OUT/scout_int4.log $OUT/gpu_test.log | tail -40
