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
GPU_SUITE_DIST_ENV = "TRITONLLM_GPU_SUITE_DIST"  # the part's --dist (load / loadfile), set by gpu_run.sh

# --dist load (kernels): each group opens one worker's first chunk, its tests one after the other on that
# worker in the order of its prefixes (tests of the same kernels, so a compile serves the rest of its group
# from the worker's memory: the factored tests of group sizes 128, 256 and per channel launch the same kernels).
WIDENING_LLAMA = ("tests/kernels/test_fp8_attention_widening.py::"
                  "test_llama_heads_decode_on_a_head_major_pool_is_the_same_whichever_way_e4m3_widens")
FACTORED = "tests/kernels/test_wna16.py::test_factored_kernels_match_the_reference"
SLOW_KERNEL_GROUPS = (  # H200, session 29's suite (2026-12-01, its kernels.log's durations)
    (f"{WIDENING_LLAMA}[800]",),  # 56 s (its pools' random bytes made on the CPU until 2026-12-01 session 29)
    (f"{FACTORED}[None-4]", f"{FACTORED}[128-4]", f"{FACTORED}[256-4]"),  # 31 + 29 s + (< 5 s)
    ("tests/kernels/test_wna16_mma.py::test_groupings_dtypes_and_bias[dtype0",),  # 14 + 13 + 9 s
    (f"{WIDENING_LLAMA}[400]",),  # 34 s
    ("tests/kernels/test_wna16_mma.py::test_groupings_dtypes_and_bias[dtype1",),  # 14 + 10 + 10 s
    (f"{FACTORED}[None-8]", f"{FACTORED}[128-8]", f"{FACTORED}[256-8]"),  # 19 + 20 s
    ("tests/kernels/test_choice_cache.py::test_second_load_hits_every_choice_and_chooses_the_same",),  # 24 s
    ("tests/kernels/test_mxfp4_gemv.py::test_choice_times_the_word_path_and_its_mark_dispatches",),  # 21 s
    ("tests/kernels/test_w4a8_gemm.py::test_the_sweeps_tilings_match_the_reference",),  # 17 s
    ("tests/kernels/test_fused_moe.py::test_fused_moe_kernel_equals_reference[1-2048-768-128-8-None]",  # 12 s
     "tests/kernels/test_fused_moe.py::test_fused_moe_kernel_equals_reference[260-128-64-16-8-None]"),  # 11 s
)

# --dist loadfile --no-loadscope-reorder (engine, executor): these files first, in this order.
SLOW_FILES = (
    # engine: session 29's engine part was cut with none of these first (the order was never applied in the
    # workers: reorder_for_gpu_suite); its log has no durations, so the figures are older, but for test_moe.py
    # (its Qwen3-MoE bf16 CUDA case the last test running, 2026-12-01) and test_equivalence.py (541 tests, one unit).
    "tests/engine/test_moe.py",  # >= 64 s (2026-11-29), cold load-time MoE choices on CUDA
    "tests/engine/test_gpt_oss.py",  # 86 s adapters + 34 + 27 s mxfp4 engines
    "tests/engine/test_equivalence.py",  # 541 tests
    "tests/engine/test_weight_only_engine.py",  # >= 86 s
    "tests/engine/test_sliding_window.py",  # >= 86 s
    "tests/engine/test_fp8_block_checkpoints.py",  # >= 84 s
    "tests/engine/test_hybrid_models.py",  # >= 71 s
    "tests/engine/test_llama4.py",  # Llama 4's CUDA engines: cold MoE choices
    "tests/engine/test_deepseek.py",  # DeepSeek's CUDA engines: cold MLA / MoE choices
    "tests/engine/test_build_and_errors.py",  # >= 42 s
    "tests/engine/test_fp8_engine.py",  # >= 39 s
    # executor: session 29's durations (setup: the file's module fixtures)
    "tests/executor/test_executor_guided_decoding.py",  # 108 s setup + 16 s
    "tests/executor/test_engine_process.py",  # 24 s setup + 14 + 12 + 11 + 6 s
    "tests/executor/test_speculative_executor.py",  # 64 s setup
    "tests/executor/test_speculative_draft_model.py",  # 54 + 6 + 5 s
    "tests/executor/test_speculative_lookahead.py",  # 42 s
    "tests/executor/test_join_latency_bench.py",  # 27 s
    "tests/executor/test_disaggregated.py",  # 20 s setup
    "tests/executor/test_throughput_bench.py",  # 20 s
    "tests/executor/test_multiturn_bench.py",  # 15 s
    "tests/executor/test_executor_api.py",  # >= 26 s (2026-11-29)
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
    """In place, under $TRITONLLM_GPU_SUITE=1 (tests/gpu_run.sh) and xdist; else nothing.

    The order that counts is the workers' (xdist's controller schedules the node ids its workers collected), and
    a worker's config says --dist "no" (xdist's remote.py sets it so), so the mode comes from
    $TRITONLLM_GPU_SUITE_DIST, which gpu_run.sh sets per part; the config's is the fallback (a controller, a
    hand-run -n). Until session 29 only the config was read: the workers never reordered (session 29's engine
    part started its files in name order, test_moe.py last on its worker, after test_equivalence.py's 541)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if os.environ.get(GPU_SUITE_ENV) != "1" or not workers.isdigit():
        return
    dist = os.environ.get(GPU_SUITE_DIST_ENV) or config.getoption("dist", None)
    items[:] = gpu_suite_order(items, dist, int(workers))
