"""tests/conftest.py's failure log ($TRITONLLM_TEST_FAILURE_LOG): failures and errors written with
their tracebacks as they are reported, so a run cut by a time limit still names them."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASES = '''
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "arithmetic went wrong"

@pytest.fixture
def broken():
    raise RuntimeError("fixture is down")

def test_errors(broken):
    pass
'''


def test_each_failure_is_logged_with_its_traceback(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    log = tmp_path / "failures.txt"
    # The outer run may be an xdist worker, whose variables would make the inner run act as one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["TRITONLLM_TEST_FAILURE_LOG"] = str(log)
    # --rootdir: node ids relative to tmp_path, whatever directory holds the checkout.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          f"--rootdir={tmp_path}", str(tmp_path / "test_cases.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    text = log.read_text()
    assert "FAILED test_cases.py::test_fails" in text and "arithmetic went wrong" in text
    assert "ERROR at setup test_cases.py::test_errors" in text and "fixture is down" in text
    assert "test_passes" not in text
