# limit 150
export PYTHONPATH=$PWD
timeout 45 $PYTHON -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_moe_gemv.py tests/kernels/test_moe_router.py tests/engine/test_moe.py::test_engine_with_the_norm_in_the_router_launch_equals_transformers 2>&1 | tail -3
TRITONLLM_MOE_GEMV_AHEAD=1 TRITONLLM_MOE_NORM_ROUTER=1 timeout 95 $PYTHON benchmarks/engine/engine_bench.py --model qwen3_30b_a3b --sections decode --max-batch-size 16 --out $OUT/q.json --results-md $OUT/q.md 2>&1 | grep -v -i warn | tail -4
timeout 10 $PYTHON -c "import json; d=json.load(open('$OUT/q.json'))['decode']; print({k: d.get(k) for k in ('tok_s', 'overlapped_tok_s', 'step_ms_median', 'graph_replay_ms', 'roofline_fraction')}); print(d.get('graph_step_profile')); [print(k, str(v)[:2500]) for k, v in d.get('gemm_choices', {}).items() if 'gemv' in k]"
