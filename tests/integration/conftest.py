"""One real tritonserver for the whole integration session, on 127.0.0.1 with free ports,
serving the SmolLM2 engine from the `smollm2_engine_dir` fixture through the five-model
repository (decoupled, so both unary and streaming calls work)."""
import pytest

from triton_helpers import running_server


@pytest.fixture(scope="session")
def triton_server(smollm2_engine_dir, tmp_path_factory):
    """The decoupled server most tests share (streaming and unary both work on it)."""
    with running_server(smollm2_engine_dir, tmp_path_factory.mktemp("triton")) as server:
        yield server
