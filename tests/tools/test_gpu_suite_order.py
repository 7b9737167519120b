"""tests/gpu_suite_order.py: the GPU suite's long tests open the workers' first chunks (--dist load), its
long files come first (--dist loadfile); pytest's items stood in for by their node ids."""
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: gpu_suite_order

from gpu_suite_order import SLOW_FILES, SLOW_KERNEL_GROUPS, gpu_suite_order  # noqa: E402


def items(*ids):
    return [SimpleNamespace(nodeid=i) for i in ids]


def test_each_slow_group_opens_a_first_chunk_of_its_own():
    short = [f"tests/kernels/test_short.py::test_{i}" for i in range(60)]
    slow = [SLOW_KERNEL_GROUPS[0][0], SLOW_KERNEL_GROUPS[1][0],
            SLOW_KERNEL_GROUPS[2][0] + "[3-200-576]"]  # (a parametrized id under the third group's prefix)
    collected = items(*short[:30], *slow, *short[30:])
    workers = 2
    chunk = max(2, len(collected) // workers // 4)  # 7
    ordered = [item.nodeid for item in gpu_suite_order(collected, "load", workers)]
    assert sorted(ordered) == sorted(i.nodeid for i in collected)
    assert ordered[0] == slow[0] and ordered[chunk] == slow[1]  # a worker each, at the head of its chunk
    assert ordered[1:chunk] == short[:chunk - 1]
    assert ordered[2 * chunk] == slow[2]  # more groups than workers: next in line after the first chunks
    assert gpu_suite_order(collected, "load", 1) == collected


def test_slow_files_first_in_their_order_the_rest_as_collected():
    collected = items("tests/engine/test_a.py::t1", f"{SLOW_FILES[1]}::t1", "tests/engine/test_b.py::t1",
                      f"{SLOW_FILES[0]}::t1", f"{SLOW_FILES[1]}::t2")
    ordered = [item.nodeid for item in gpu_suite_order(collected, "loadfile", 5)]
    assert ordered == [f"{SLOW_FILES[0]}::t1", f"{SLOW_FILES[1]}::t1", f"{SLOW_FILES[1]}::t2",
                       "tests/engine/test_a.py::t1", "tests/engine/test_b.py::t1"]


def test_the_conftest_hook_orders_a_gpu_suite_collection(monkeypatch):
    """tests/conftest.py's collection hook applies it under $TRITONLLM_GPU_SUITE=1 as one xdist worker of two
    (whose config says --dist "no", as xdist's remote.py sets it; the part's mode in $TRITONLLM_GPU_SUITE_DIST,
    as tests/gpu_run.sh exports it): the third slow group opens the first chunk; without the variable, the
    make-test file order; without the part's mode, a worker cannot know it and leaves the order."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    # tests/conftest.py by its path: a bare `import conftest` finds whichever conftest a full run loaded first
    spec = importlib.util.spec_from_file_location("tests_root_conftest", root / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    config = SimpleNamespace(rootpath=root, getoption=lambda name, default=None: "no" if name == "dist" else default)
    collection = ["tests/tools/test_gpu_suite_order.py::test_a", "tests/tools/test_gpu_suite_order.py::test_b",
                  SLOW_KERNEL_GROUPS[2][0] + "[3-200-576]"]

    def collected(suite: str, dist: str = "load") -> list[str]:
        monkeypatch.setenv("TRITONLLM_GPU_SUITE", suite)
        monkeypatch.setenv("TRITONLLM_GPU_SUITE_DIST", dist)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        ordered = items(*collection)
        conftest.pytest_collection_modifyitems(None, config, ordered)
        return [item.nodeid for item in ordered]

    assert collected("1")[0] == collection[2]
    assert collected("0")[0] == collection[0]  # (file order: tools before kernels)
    assert collected("1", dist="")[0] == collection[0]  # the worker's own "no": nothing to order by
