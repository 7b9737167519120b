# limit 100
timeout 90 $PYTHON -u benchmarks/engine/lanes/s26_c2/whisper_first_pass.py 2>&1 | grep -E "^run|encode_into|Error|Traceback" | cut -c1-300
