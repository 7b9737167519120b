# limit 560
# Session 30 call 1: what session 29 built and never ran on a GPU (benchmarks/next_gpu_runs.md "First", items 1, 3, 5):
# the new CUDA tests, keys-major decode attention's grid (attnkm29), the MLA column parts (mlacol29), the block-FP8
# experts' wide-step tiles (moe29). Each part tars its own files.
OUT=${1:?usage: measure29.sh OUT}
export PYTHONPATH=$PWD COLUMNS=400
P=${PYTHON:-/opt/torch/.venv/bin/python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
pack() { (cd $OUT/$1 && tar czf ../$1.tgz *) && rm -rf $OUT/$1; }

# 1. the new CUDA tests (<= 150 s)
D=$OUT/tests; mkdir -p $D
timeout 110 $P -m pytest -q -rfEs --tb=short -p no:cacheprovider -n 0 -m gpu --durations=8 "tests/engine/test_moe.py::test_engine_on_cuda_in_bf16_is_close_to_transformers" tests/kernels/test_keys_major_decode.py tests/kernels/test_moe_gemv.py -k "close_to_transformers or keys_major or shared_expert" > $D/gpu_tests.log 2>&1; echo "gpu tests rc $?"
timeout 40 $P -m pytest -q -rfEs --tb=short -p no:cacheprovider -n 0 tests/engine/test_llama4.py tests/kernels/test_mla_attention.py -k "one_launch_routing or column_parts" > $D/cpu_tests_on_gpu.log 2>&1; echo "llama4/mla parts tests rc $?"
tail -14 $D/gpu_tests.log | cut -c1-300; tail -4 $D/cpu_tests_on_gpu.log | cut -c1-300
pack tests

# 2. keys-major decode attention grid (<= 110 s)
D=$OUT/km; mkdir -p $D
timeout 105 $P benchmarks/kernels/attention_kernel_bench.py --grid --pool fp8 --pool_layout head_major --grid_no_standard --grid_cases "decode 48x21000,decode 64x20480,decode 256x20480,decode 8x20480,decode 256x8192,decode 64x8192,decode 8x8192,decode 256x2048,decode 64x2048,decode 1024x2048" --grid_more "bits=auto;bits=auto km;bits=auto tile=64:4:3;bits=auto km tile=64:4:3;bits=auto km tile=128:4:3;bits=auto km tile=64:4:5;bits=0 km tile=64:4:3;bits=auto km rotary" --markdown $D/km_grid.md > $D/km_grid.log 2>&1; echo "km grid rc $?"
grep -v -i warn $D/km_grid.log | cut -c1-140 | tail -70
pack km

# 3. MLA column parts (<= 80 s)
D=$OUT/mla; mkdir -p $D
B="benchmarks/kernels/mla_kernel_bench.py --shape v2_lite --repeat 10 --check --batches 8,32,64 --contexts 8192,32768"
timeout 45 $P $B --pool fp8 --configs auto,auto+p8,auto+p4,d16:4:3+p8 --out $D/mla_parts_fp8.json > $D/fp8.log 2>&1; echo "mla parts fp8 rc $?"
timeout 30 $P $B --pool bf16 --configs auto,auto+p8,d16:4:3+p8 --out $D/mla_parts_bf16.json > $D/bf16.log 2>&1; echo "mla parts bf16 rc $?"
grep -hE "batch|Error|Traceback" $D/fp8.log $D/bf16.log | cut -c1-170 | tail -60
pack mla

# 4. block-FP8 experts' wide-step tiles (<= 120 s)
D=$OUT/moe; mkdir -p $D
timeout 115 $P benchmarks/kernels/moe_gemv_bench.py --kinds fp8_block --tokens 1 2 --gemv-tiles 16,128,1,4,db 16,256,1,4,db 16,512,1,3,db --out $D/wide.json > $D/wide.log 2>&1; echo "moe wide rc $?"
grep -v -i warn $D/wide.log | cut -c1-200 | tail -30
pack moe
