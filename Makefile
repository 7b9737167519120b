# Two commands for a newcomer on a fresh machine:
#   make serve   set everything up, build the embedded default engine, serve it on 127.0.0.1
#                (MODEL=<HF checkpoint dir or .gguf>: that checkpoint, its engine built once into a cache)
#   make test    set everything up and run the test suite (CPU only)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test serve bench clean

setup:
	./scripts/setup_env.sh

test: setup
	$(PY) -m pytest -q -x -ra tests

serve: setup
	$(PY) scripts/serve_default.py $(if $(MODEL),--model "$(MODEL)")

bench: setup
	$(PY) benchmarks/executor_bench.py

clean:
	rm -rf $(VENV) engines build *.egg-info
