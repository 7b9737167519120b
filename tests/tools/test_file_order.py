"""tests/file_order.py: the files of the integration package's session server are one unit of work for
`make test`'s workers and go first, a long file that needs no SmolLM2 second, the long files next, the rest
after them."""
from pathlib import Path

from file_order import SHARED_SERVER_SCOPE, WHILE_THE_MODEL_LOADS, file_rank, scope_of, uses_shared_server

ROOT = str(Path(__file__).resolve().parents[2])


def test_the_session_server_files_are_one_unit_and_first():
    shared = sorted(str(path.relative_to(ROOT)) for path in (Path(ROOT) / "tests" / "integration").glob("test_*.py")
                    if uses_shared_server(ROOT, str(path.relative_to(ROOT))))
    # a test's parameter, a fixture's parameter and a parametrized fixture name (getfixturevalue) all count
    for path in ("tests/integration/test_grpc_stream.py", "tests/integration/test_streaming_relay.py",
                 "tests/integration/test_disaggregated_served.py",
                 "tests/integration/test_openai_frontend.py", "tests/integration/test_lora_served.py"):  # (frontend)
        assert path in shared
        assert scope_of(ROOT, f"{path}::test_x[a]") == SHARED_SERVER_SCOPE and file_rank(ROOT, path) == 0
    # second: a long file whose tests use no SmolLM2 fixture (the unit's worker loads it meanwhile)
    assert file_rank(ROOT, WHILE_THE_MODEL_LOADS) == 1
    assert "smollm2" not in (Path(ROOT) / WHILE_THE_MODEL_LOADS).read_text()
    # own servers: files of their own, in the long files' rank
    for path in ("tests/integration/test_soak.py", "tests/integration/test_model_families_served.py",
                 "tests/distributed/test_tp_serving.py", "tests/tools/test_wheel.py"):
        assert path not in shared and scope_of(ROOT, f"{path}::test_x") == path and file_rank(ROOT, path) == 2
    assert file_rank(ROOT, "tests/serving/test_metrics_math.py") == 3
    assert file_rank(ROOT, "tests/serving/test_torchless_preprocessing.py") == 2  # long, not left for the end
    # the session's non-decoupled server: its files in the shared unit, test_unary_served.py (whose last test
    # kills it) after every other that names it
    unary = [path for path in shared if "unary_server" in (Path(ROOT) / path).read_text()]
    assert {"tests/integration/test_speculative_served.py", "tests/integration/test_unary_served.py"} <= set(unary)
    assert all(scope_of(ROOT, path) == SHARED_SERVER_SCOPE for path in unary)
    assert max(unary) == "tests/integration/test_unary_served.py"
    assert scope_of(ROOT, "tests/engine/test_moe.py::test_x") == "tests/engine/test_moe.py"
