# Two commands for a newcomer on a fresh machine:
#   make serve   set everything up, build the embedded default engine, serve it on 127.0.0.1
#                (MODEL=<HF checkpoint dir or .gguf>: that checkpoint, its engine built once into a cache;
#                TP=<n> PP=<n>: tensor-parallel ranks x pipeline stages, one rank per GPU)
#   make test    set everything up and run the test suite (CPU only; make test-all: with the `extended` tests)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-all serve bench docs clean

setup:
	./scripts/setup_env.sh

# The suite on PYTEST_WORKERS pytest-xdist workers (0: in this process, one test at a time).
# --dist loadfile: each file's tests on one worker, so a module's servers and engines are built
# once (and the files of the integration package's session server are one unit: one worker starts it);
# --no-loadscope-reorder: files in collection order, which tests/file_order.py sets: that unit and the
# files that start servers first, so the many quick files come last and both workers finish together.
# Byte-compiled first: the suite starts many Python processes (engine processes, backend stubs,
# ranks, CLIs), and under PYTHONDONTWRITEBYTECODE each one compiled every module of the checkout it
# imports again (~0.2 CPU-s an engine process); compileall writes only the missing or stale .pyc files.
# Under it pytest never cached its assert-rewritten test modules either, so each worker rewrote all
# of them while collecting (~9 CPU-s a worker): tests/assertion_cache.py writes that cache once.
# make test leaves out the tests marked `extended` (pyproject.toml says what they are; each says which tests
# of make test reach the same code) to stay within CI's 10 minutes on 2 cores; make test-all runs them too.
PYTEST_WORKERS ?= 2
PYTEST_TIER ?= -m "not extended"
PACKAGES := engine kernels serving openai_frontend tritonllm all_models benchmarks tools scripts tests
test: setup
	$(PY) -m compileall -q $(PACKAGES)
	$(PY) tests/assertion_cache.py
	$(PY) -m pytest -q -x -ra -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_TIER) tests

test-all:
	$(MAKE) test PYTEST_TIER=

serve: setup
	$(PY) scripts/serve_default.py $(if $(MODEL),--model "$(MODEL)") $(if $(TP),--tp $(TP)) $(if $(PP),--pp_size $(PP))

# In-flight against static batching on CPU (the embedded engine); the table goes to benchmarks/results/engine.md.
bench: setup
	$(PY) benchmarks/engine/executor_bench.py

# The documentation site (mkdocs.yml, docs/) into site/; tests/tools/test_docs.py builds it strictly.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) engines build *.egg-info
