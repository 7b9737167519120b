# limit 60
timeout 55 $PYTHON -u benchmarks/engine/lanes/s26_c3/whisper_clocks.py --gc-off 2>&1 | grep -E "run|Error|Traceback" | cut -c1-300
