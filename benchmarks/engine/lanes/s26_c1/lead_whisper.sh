# limit 110
timeout 100 $PYTHON -u benchmarks/engine/lanes/s26_c1/whisper_repeat.py 2>&1 | grep -E "^run|Error|Traceback" | cut -c1-300
