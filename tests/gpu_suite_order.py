"""The order in which the GPU suite (tests/gpu_run.sh, which sets $TRITONLLM_GPU_SUITE=1) hands its tests
to the pytest-xdist workers: the long ones first, each on a worker of its own, so that no worker starts a
one-to-three-minute test when the others are running dry.

Why: xdist hands tests out in collection order. The kernels part (``--dist load``) gives each worker a
chunk of consecutive tests first (``max(2, tests // workers // 4)``, then smaller ones as they run dry),
so tests/kernels/test_wna16.py, collected last, started its factored-kernel tests (182 s and 178 s, Triton
compiles) at 92% of the part and ended it at 456 s (H200, 2026-11-29). The engine and executor parts
(``--dist loadfile``, a file per worker) took files by their number of tests, so test_gpt_oss.py
(>= 146 s) began at 41% of the engine part and test_throughput_bench.py (84 s) at 98% of the executor's.

The lists are the slowest of that run (seconds in the comments), longest first; a name no longer
collected is skipped. Outside the GPU suite (``make test``) nothing is reordered here.
"""
from __future__ import annotations

import os

GPU_SUITE_ENV = "TRITONLLM_GPU_SUITE"

# --dist load (kernels): each group opens one worker's first chunk, its tests one after the other on that
# worker in the order of its prefixes (tests of the same kernels, so a compile serves the rest of its group
# from the worker's memory: the factored tests of group sizes 128, 256 and per channel launch the same kernels).
SLOW_KERNEL_GROUPS = (
    ("tests/kernels/test_wna16.py::test_factored_kernels_match_the_reference[None-4]",  # 182 s
     "tests/kernels/test_wna16.py::test_factored_kernels_match_the_reference[128-4]",  # 178 s (concurrently)
     "tests/kernels/test_wna16.py::test_factored_kernels_match_the_reference[256-4]"),
    ("tests/kernels/test_wna16.py::test_factored_kernels_match_the_reference[None-8]",  # 70 s
     "tests/kernels/test_wna16.py::test_factored_kernels_match_the_reference[128-8]",  # 68 s
     "tests/kernels/test_wna16.py::test_factored_kernels_match_the_reference[256-8]"),
    ("tests/kernels/test_wna16.py::test_choose_variants_sets_a_tiling",  # 48 s: compiles every skinny tiling,
     "tests/kernels/test_wna16.py::test_every_decode_tiling_matches_the_reference"),  # then 21 x <= 12 s reuse them
    ("tests/kernels/test_fp8.py::test_every_fp8_load_time_variant_is_correct",),  # 39 s
    ("tests/kernels/test_wna16_mma_rows.py::test_opt_in_dispatch_through_prepare_and_a_cuda_graph",),  # 32 s
    ("tests/kernels/test_wna16_mma.py::test_groupings_dtypes_and_bias[dtype0",),  # 25 + 16 + 16 s
    ("tests/kernels/test_wna16_mma.py::test_groupings_dtypes_and_bias[dtype1",),  # 23 + 20 + 19 s
)

# --dist loadfile --no-loadscope-reorder (engine, executor): these files first, in this order.
SLOW_FILES = (
    "tests/engine/test_gpt_oss.py",  # 86 s adapters + 34 + 27 s mxfp4 engines
    "tests/engine/test_weight_only_engine.py",  # >= 86 s
    "tests/engine/test_sliding_window.py",  # >= 86 s
    "tests/engine/test_fp8_block_checkpoints.py",  # >= 84 s
    "tests/engine/test_hybrid_models.py",  # >= 71 s
    "tests/engine/test_moe.py",  # >= 64 s
    "tests/engine/test_build_and_errors.py",  # >= 42 s
    "tests/engine/test_fp8_engine.py",  # >= 39 s
    "tests/executor/test_engine_process.py",  # >= 106 s
    "tests/executor/test_throughput_bench.py",  # 84 s
    "tests/executor/test_speculative_executor.py",  # 77 s module setup
    "tests/executor/test_speculative_draft_model.py",  # >= 52 s
    "tests/executor/test_executor_guided_decoding.py",  # >= 50 s
    "tests/executor/test_executor_api.py",  # >= 26 s
    "tests/executor/test_multiturn_bench.py",  # >= 26 s
    "tests/executor/test_join_latency_bench.py",  # 23 s
)


def gpu_suite_order(items: list, dist: str | None, workers: int) -> list:
    """``items`` (pytest's, with .nodeid) in the GPU suite's order for xdist's ``dist`` mode over ``workers``."""
    if dist == "loadfile":
        rank = {path: i for i, path in enumerate(SLOW_FILES)}
        return sorted(items, key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
    if dist != "load" or workers < 2:
        return items
    groups, taken = [], set()
    for prefixes in SLOW_KERNEL_GROUPS:
        group = []
        for prefix in prefixes:  # in the order of the prefixes
            for item in items:
                if id(item) not in taken and item.nodeid.startswith(prefix):
                    group.append(item)
                    taken.add(id(item))
        if group:
            groups.append(group)
    rest = [item for item in items if id(item) not in taken]
    chunk = max(2, len(items) // workers // 4)  # xdist's first chunk per worker (LoadScheduling.schedule)
    ordered = []
    for group in groups[:workers]:
        fill = max(0, chunk - len(group))  # the worker's chunk: its group, then short tests up to the chunk
        ordered += group + rest[:fill]
        rest = rest[fill:]
    for group in groups[workers:]:  # more groups than workers: next in line
        ordered += group
    return ordered + rest


def reorder_for_gpu_suite(config, items: list) -> None:
    """In place, under $TRITONLLM_GPU_SUITE=1 (tests/gpu_run.sh) and xdist; else nothing."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if os.environ.get(GPU_SUITE_ENV) != "1" or not workers.isdigit():
        return
    dist = config.getoption("dist", None)
    items[:] = gpu_suite_order(items, dist, int(workers))
