# limit 160
# both GPUs (TP 2 over NCCL): run alone, before the lanes
export PYTHONPATH=$PWD; timeout 65 $PYTHON -m pytest -q -x -p no:cacheprovider -n 0 tests/distributed/test_encdec_tp.py 2>&1 | tail -25 | cut -c1-600; timeout 80 $PYTHON -u benchmarks/engine/encdec_bench.py --sections t5 --tp 1,2 --t5-requests 128 --hf-t5-batches "" --out $OUT/tp49_t5.json > $OUT/tp49_t5.log 2>&1; echo "bench rc $?"; grep -vi warn $OUT/tp49_t5.log | grep -E "^t5|tok/s|Error|Traceback|failed|run:" | cut -c1-420 | tail -12
