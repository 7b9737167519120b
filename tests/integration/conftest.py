"""One real tritonserver for the whole integration session, on 127.0.0.1 with free ports,
serving the SmolLM2 engine from the `smollm2_engine_dir` fixture through the five-model
repository (decoupled, so both unary and streaming calls work); its generation phase loaded
when a test first asks for it (``disaggregated_server``). A second one, non-decoupled, for the files
that need one response per request (``unary_server``)."""
import contextlib
import subprocess
import sys

import pytest
import requests

from triton_helpers import (ROOT, add_generation_phase, alive, running_frontend, running_server, running_unary_server,
                            wait_for, write_peft_adapter)


@pytest.fixture(scope="session")
def triton_server(smollm2_engine_dir, tmp_path_factory):
    """The decoupled server most tests share (streaming and unary both work on it; guided decoding on).
    Its generation phase comes with ``disaggregated_server``."""
    with running_server(smollm2_engine_dir, tmp_path_factory.mktemp("triton"), guided=True) as server:
        yield server


@pytest.fixture(scope="session")
def disaggregated_server(triton_server):
    """``triton_server`` with disaggregated_serving_bls over tensorrt_llm and a second engine process,
    `generation` (add_generation_phase), added and loaded on first use: only the disaggregated tests use
    them (`extended`), so `make test`'s server starts without that engine process and its three stubs (started with the server until 2026-11-30: ~5 of its ~18 CPU-s)."""
    if not (triton_server.repo / "generation").exists():
        add_generation_phase(triton_server.repo, decoupled=True)
        triton_server.load_models("generation", "disaggregated_serving_bls")
    return triton_server


# The test of the unary server's draft_target copy (`extended`): the copy is served only where it runs.
DRAFT_TARGET_TEST = "test_draft_target_decoding_mode_keeps_the_greedy_ids"


@pytest.fixture(scope="session")
def unary_servers(smollm2_engine_dir, tmp_path_factory, request):
    """unary_server's maker: the running one, or a fresh one where a test killed the last."""
    draft_target = any(item.originalname == DRAFT_TARGET_TEST for item in request.session.items)
    with contextlib.ExitStack() as stack:
        started = []

        def current():
            if not started or not alive(started[-1].pid):
                work = tmp_path_factory.mktemp("unary")
                started.append(stack.enter_context(running_unary_server(smollm2_engine_dir, work, draft_target)))
            return started[-1]
        yield current


@pytest.fixture(scope="module")
def unary_server(unary_servers):
    """The non-decoupled repository (triton_helpers.running_unary_server: the five models, the BLS naming a
    draft model, tensorrt_llm's n-gram copy and, for an `extended` test, its draft-target one) that
    test_speculative_served.py and test_unary_served.py share (they started one each, the same five models,
    until 2026-11-30). Started
    once a session; again only for a module after one whose test killed it (test_unary_served.py's last
    test does, and `make test` runs that file after the other: tests/tools/test_file_order.py checks)."""
    return unary_servers()


@pytest.fixture(scope="session")
def lora_adapters(smollm2_engine_dir, tmp_path_factory):
    """Two PEFT adapters of SmolLM2 (ranks 8 and 16, random weights) and the first converted to
    TensorRT-LLM's two .npy files by tools/hf_lora_convert.py: (peft dirs, converted dir)."""
    tmp = tmp_path_factory.mktemp("lora")
    peft_dirs = [write_peft_adapter(smollm2_engine_dir, tmp / f"r{rank}", rank, seed=rank) for rank in (8, 16)]
    converted = tmp / "r8_trtllm"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "hf_lora_convert.py"), "-i", str(peft_dirs[0]),
                          "-o", str(converted), "--storage-type", "float16"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    return peft_dirs, converted


@pytest.fixture(scope="session")
def frontend(triton_server, smollm2_engine_dir, lora_adapters, tmp_path_factory):
    """The OpenAI frontend the OpenAI tests share, in front of ``triton_server``, serving the two
    ``lora_adapters`` as models "sql" (rank 8) and "chat16"; its base URL."""
    peft_dirs, _ = lora_adapters
    with running_frontend(triton_server.grpc_url, smollm2_engine_dir, tmp_path_factory.mktemp("openai"),
                          "--lora_modules", f"sql={peft_dirs[0]}", f"chat16={peft_dirs[1]}") as url:
        assert wait_for(lambda: requests.get(f"{url}/health", timeout=2).status_code == 200, timeout=30)
        yield url
