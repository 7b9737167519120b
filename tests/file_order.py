"""The order `make test` hands files to its pytest-xdist workers, and the files it keeps together.

`make test` runs ``--dist loadfile --no-loadscope-reorder``: each file's tests on one worker, files
handed out in collection order as a worker runs dry (a worker gets its next file while the last two
tests of its current one run). Two things that scheme does not know, fixed here:

- Every worker is a pytest session of its own, so the integration package's session server
  (tests/integration/conftest.py: ``triton_server``, its generation phase ``disaggregated_server``,
  ``frontend``, ``lora_adapters``, and the non-decoupled ``unary_server``) would be started on both
  workers. The files that use it are one unit of work (``scope_of``, ``SHARED_SERVER_SCOPE``), handed
  out first: one worker starts that server once and runs them all while the other does everything else.
  (Two units, the OpenAI frontend's files and the rest, one a worker, from 2026-11-30 to 12-01: as one
  unit they were ~680 of the ~1,000 worker-s the suite took on 2 cores then, so one worker ran them
  while the other finished everything else and idled. Since, requests sent at once and fewer tokens
  brought them to ~380 of ~1,120 worker-s (session 26's last fresh clone), well under a worker's half,
  so the second unit's own start of the server, the SmolLM2 engine build and the model copy's load
  bought nothing.)
- That unit starts with the session fixtures of tests/conftest.py: the first worker to ask for
  ``smollm2_engine_dir`` builds it from the GGUF (``python -m engine.build``, dequantizing it: ~12-15 s
  on CI's cores) while the other would wait on its file lock, idle, to take it. So the second unit
  handed out is a long file that needs no SmolLM2 (``WHILE_THE_MODEL_LOADS``), which outlasts it.
- A long file handed out last runs alone while the other worker has nothing left. Longest first:
  that unit, then the files that start servers or ranks (``LONG_FIRST``), then the rest in
  collection order, whose many short files let both workers finish together (``file_rank``).

Plain Python (no xdist import): tests/conftest.py makes the scheduler from it.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

# The integration package's session fixtures (tests/integration/conftest.py) and the unit of work
# of every file that uses one of them.
SHARED_SERVER_FIXTURES = frozenset({"triton_server", "disaggregated_server", "frontend", "lora_adapters",
                                    "unary_server"})
SHARED_SERVER_SCOPE = "tests/integration[session server]"
INTEGRATION = "tests/integration/"
# Files first after the shared unit: each starts tritonserver, mpirun ranks or a built wheel's server
# (~10-50 s each on CI's two cores), so none of them is left for the end; so do the two longest of
# tests/serving (Python-backend stubs in processes of their own, tokenizers loaded a dozen times: 17 and
# 12 s of session 25's fresh clone), which came among the last files handed out.
LONG_FIRST = ("tests/tools/test_wheel.py", INTEGRATION, "tests/distributed/",
              "tests/serving/test_torchless_preprocessing.py", "tests/serving/test_tokenization.py")
# Handed out second, beside the session-server unit: tiny random Llamas on two ranks (~47 s of CI), no
# SmolLM2 fixture (see the module docstring).
WHILE_THE_MODEL_LOADS = "tests/distributed/test_tp_engine.py"


def uses_shared_server(root: str, path: str) -> bool:
    """Whether the test file at ``path`` (relative to ``root``) names a session fixture of the
    integration package: as a parameter of a function (a test or a fixture of its own), or as a
    string (``request.getfixturevalue("triton_server")``, a parametrized fixture name)."""
    return bool(_fixtures_named(root, path) & SHARED_SERVER_FIXTURES)


@lru_cache(maxsize=None)
def _fixtures_named(root: str, path: str) -> frozenset[str]:
    """The integration package's session fixtures the file at ``path`` names (see uses_shared_server)."""
    if not path.startswith(INTEGRATION) or not path.endswith(".py"):
        return frozenset()
    try:
        tree = ast.parse((Path(root) / path).read_text())
    except (OSError, SyntaxError):
        return frozenset()
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg in SHARED_SERVER_FIXTURES:
            named.add(node.arg)
        if isinstance(node, ast.Constant) and node.value in SHARED_SERVER_FIXTURES:
            named.add(node.value)
    return frozenset(named)


def scope_of(root: str, nodeid: str) -> str:
    """The unit of work of a test: its file, or SHARED_SERVER_SCOPE for a file of the session server."""
    path = nodeid.split("::", 1)[0]
    return SHARED_SERVER_SCOPE if _fixtures_named(root, path) else path


def file_rank(root: str, nodeid: str) -> int:
    """0: the session server's files, 1: WHILE_THE_MODEL_LOADS, 2: LONG_FIRST, 3: the rest (a stable sort
    keeps each file's tests together and in their order)."""
    path = nodeid.split("::", 1)[0]
    if scope_of(root, path) == SHARED_SERVER_SCOPE:
        return 0
    if path == WHILE_THE_MODEL_LOADS:
        return 1
    return 2 if path.startswith(LONG_FIRST) else 3
