# limit 195
# both GPUs (TP 2 over NCCL): run alone
export PYTHONPATH=$PWD; timeout -k 10 -s USR1 125 $PYTHON -u benchmarks/engine/encdec_bench.py --sections t5 --tp 2,1 --hf-t5-batches "" --out $OUT/tp49_t5.json > $OUT/tp49_t5.log 2>&1; echo "t5 rc $?"; grep -vi warn $OUT/tp49_t5.log | grep -E "^t5|tok/s|Error|Traceback|failed|run:|File \"/|Thread 0x|Current thread|ready on" | cut -c1-300 | tail -50
timeout -k 5 -s USR1 55 $PYTHON -u benchmarks/engine/encdec_bench.py --sections whisper --tp 2 --hf-whisper-batches "" --out $OUT/tp49_whisper.json > $OUT/tp49_whisper.log 2>&1; echo "whisper rc $?"; grep -vi warn $OUT/tp49_whisper.log | grep -E "^whisper|audio s/s|Error|Traceback|failed|run:|File \"/|Thread 0x" | cut -c1-300 | tail -30
