# limit 420
# Session 32, call 2 on one H200: split51.sh (decode splits of any count, issue 51), fa51.sh (prompt-chunk attention
# at 20000/2000's shapes), then the GPU tests of what they added (the padded merge, FP8 Q.K^T prompt tiles).
OUT=${1:?usage: all.sh OUT}
export PYTHONPATH=$PWD
P=${PYTHON:-/opt/torch/.venv/bin/python3}
L=benchmarks/engine/lanes/s32_c2
mkdir -p $OUT/split51 $OUT/fa51
echo "== split51 $(date -u +%T)"; timeout 125 bash $L/split51.sh $OUT/split51 2>&1 | tail -n 45
echo "== fa51 $(date -u +%T)"; timeout 170 bash $L/fa51.sh $OUT/fa51 2>&1 | tail -n 60
echo "== gpu tests $(date -u +%T)"
timeout 90 $P -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/kernels/test_decode_split_waves.py \
  tests/kernels/test_prefill_fp8_qk.py tests/kernels/test_prefill_config_sm90.py 2>&1 | tail -n 8
echo "== done $(date -u +%T)"
