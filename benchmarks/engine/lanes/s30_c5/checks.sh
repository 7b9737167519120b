# limit 200
# Session 30 call 5: the last checks: the head graph's GPU test (step30), keys-major on bf16 pools' split launches
# (attnkm30), the 91 x 21,000 decode graph profiled with PDL on and off (long30).
OUTROOT=${1:?usage: checks.sh OUT}
nvidia-smi --query-gpu=name --format=csv,noheader > $OUTROOT/gpu.txt
( OUT=$OUTROOT
export PYTHONPATH=$PWD; P=/opt/torch/.venv/bin/python3; S=$SECONDS; timeout 45 $P -m pytest -v -rfE -p no:cacheprovider -n 0 "tests/engine/test_cuda_graphs.py::test_head_graph_logits_and_greedy_ids_match_the_eager_head" > $OUT/t.log 2>&1; echo "tests rc $? $((SECONDS-S)) s"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" $OUT/t.log | tail -8
 )
( OUT=$OUTROOT
P=/opt/torch/.venv/bin/python3; export PYTHONPATH=$PWD COLUMNS=400; timeout -s INT -k 3 20 $P -m pytest -q -rfE --tb=short -p no:cacheprovider -n 8 -m gpu tests/kernels/test_keys_major_decode.py -k "switch_and_tiling or graph_replay or own_residency" > $OUT/km_tests2.log 2>&1; tail -n 3 $OUT/km_tests2.log; timeout 25 $P benchmarks/kernels/attention_kernel_bench.py --grid --pool bf16 --pool_layout head_major --grid_no_standard --grid_cases "decode 8x8192,decode 8x20480,decode 64x8192,decode 64x2048,decode 256x2048,decode 256x8192,decode 1024x2048,decode 1x8192,decode 1x2048" --grid_more "default;km=0" --markdown $OUT/km30_bf16b.md > $OUT/km30_bf16b.log 2>&1; grep -v -i warn $OUT/km30_bf16b.log | cut -c1-150
 )
( OUT=$OUTROOT
export PYTHONPATH=$PWD TRITONLLM_DECODE_KEYS_MAJOR=1; P=/opt/torch/.venv/bin/python3
timeout 75 $P -u benchmarks/engine/step_profile.py --model llama8b --quantization fp8 --kv_cache_dtype fp8 --graph --decode 91x21000 --bucket 96 --page_order in_order --kv_gib 123.5 --pdl_ab --out $OUT/profile2.json > $OUT/profile2.log 2>&1; echo "profile rc $?"; grep -v -i warn $OUT/profile2.log | cut -c1-200 | grep -v "at::native" | tail -45
 )
