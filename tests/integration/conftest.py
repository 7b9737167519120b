"""One real tritonserver for the whole integration session, on 127.0.0.1 with free ports,
serving the SmolLM2 engine from the `smollm2_engine_dir` fixture through the five-model
repository (decoupled, so both unary and streaming calls work)."""
import subprocess
import sys

import pytest
import requests

from triton_helpers import ROOT, running_frontend, running_server, wait_for, write_peft_adapter


@pytest.fixture(scope="session")
def triton_server(smollm2_engine_dir, tmp_path_factory):
    """The decoupled server most tests share (streaming and unary both work on it; guided decoding on;
    disaggregated_serving_bls over tensorrt_llm and a second engine process, `generation`)."""
    with running_server(smollm2_engine_dir, tmp_path_factory.mktemp("triton"), guided=True,
                        generation_phase=True) as server:
        yield server


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
