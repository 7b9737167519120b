"""One real tritonserver for the whole integration session, on 127.0.0.1 with free ports,
serving the SmolLM2 engine from the `smollm2_engine_dir` fixture through the five-model
repository (decoupled, so both unary and streaming calls work)."""
import pytest
import requests

from triton_helpers import running_frontend, running_server, wait_for


@pytest.fixture(scope="session")
def triton_server(smollm2_engine_dir, tmp_path_factory):
    """The decoupled server most tests share (streaming and unary both work on it)."""
    with running_server(smollm2_engine_dir, tmp_path_factory.mktemp("triton")) as server:
        yield server


@pytest.fixture(scope="session")
def frontend(triton_server, smollm2_engine_dir, tmp_path_factory):
    """The OpenAI frontend the OpenAI tests share, in front of ``triton_server``; its base URL."""
    with running_frontend(triton_server.grpc_url, smollm2_engine_dir, tmp_path_factory.mktemp("openai")) as url:
        assert wait_for(lambda: requests.get(f"{url}/health", timeout=2).status_code == 200, timeout=30)
        yield url
