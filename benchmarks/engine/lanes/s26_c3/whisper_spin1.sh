# limit 80
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,pstate --format=csv,noheader -i $CUDA_VISIBLE_DEVICES -lms 250 > $OUT/clocks.csv 2>&1 &
smi=$!
timeout 70 $PYTHON -u benchmarks/engine/lanes/s26_c3/whisper_clocks.py --spin 2>&1 | grep -E "run|spun|Error|Traceback" | cut -c1-300
kill $smi; awk -F, '{print $2, $3, $4, $5}' $OUT/clocks.csv | uniq -c | head -30
