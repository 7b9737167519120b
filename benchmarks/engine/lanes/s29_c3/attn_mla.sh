# limit 320
# Session 29 call 3: attn29's FP8-pool decode attention widening variants over issue 51's grid, then mla29's MLA decode
# kernel with FP8 pools widened by bits, 16-bit partials and the chunked combine (issue 55). Each part tars its files.
OUT=${1:?usage: attn_mla.sh OUT}
export PYTHONPATH=$PWD
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
pack() { (cd $OUT/$1 && tar czf ../$1.tgz *) && rm -rf $OUT/$1; }

# 1. attn29 (<= 150 s)
D=$OUT/attn; mkdir -p $D
timeout 100 $P benchmarks/kernels/attention_kernel_bench.py --grid --pool_layout head_major --grid_widenings 0,v,vcvt --markdown $D/grid.md > $D/grid.log 2>&1; echo "grid rc $?"
timeout 45 $P -m pytest -q -rfEs -p no:cacheprovider -n 0 tests/kernels/test_fp8_attention_widening.py tests/kernels/test_kernel_attention.py -k "widen or fp8 or rotary or tma or head_major" > $D/tests.log 2>&1; echo "attn tests rc $?"
grep -v -i warn $D/grid.log | cut -c1-160 | tail -70; tail -4 $D/tests.log
pack attn

# 2. mla29 (<= 150 s)
D=$OUT/mla; mkdir -p $D
B="benchmarks/kernels/mla_kernel_bench.py --shape v2_lite --repeat 3 --check"; G="--batches 1,8,32,64 --contexts 1024,8192,32768"
timeout 60 $P $B $G --pool fp8 --configs auto+cvt,auto,auto+h,d32:8:0+bits,d32:8:3+bits --out $D/fp8.json > $D/fp8.log 2>&1; echo "mla fp8 rc $?"
timeout 45 $P $B $G --pool bf16 --configs auto,16:128:32,auto+h,d32:4:3:128:128:4+h --out $D/bf16.json > $D/bf16.log 2>&1; echo "mla bf16 rc $?"
timeout 20 $P $B --pool bf16 --batches 1,8 --contexts 128,384,1024 --graph-max-context 4096 --v-dim 128 --configs auto,auto+c0 --out $D/graph.json > $D/graph.log 2>&1; echo "mla graph rc $?"
timeout 25 $P -m pytest -q -rfE -p no:cacheprovider -n 0 tests/kernels/test_mla_attention.py -k "bits or decode_kernel_equals or widen or w_uv" > $D/tests.log 2>&1; echo "mla tests rc $?"
tail -3 $D/tests.log; grep -hE "batch|Error|Traceback" $D/fp8.log $D/bf16.log $D/graph.log | cut -c1-200 | tail -90
pack mla
