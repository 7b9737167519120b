"""The KV host tier in leader mode (real processes, gloo on CPU): rank 0's BlockManager decides the
copies, every rank makes them on its own shard (ModelRunner.copy_kv_host_blocks through the step
plan), so conversations whose prefixes came back from host memory answer on two ranks exactly as
one rank without reuse does."""
from __future__ import annotations

import os
import sys

import pytest

from kv_host_tier_driver import PROMPTS, converse
from tp_testing import build_tiny_engine, run_ranks, tiny_llama

from engine.executor.executor import Executor, ExecutorConfig

DRIVER = os.path.join(os.path.dirname(__file__), "kv_host_tier_driver.py")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    hf = tiny_llama()
    root = tmp_path_factory.mktemp("host_tier_engines")
    return {tp: build_tiny_engine(hf, str(root / f"tp{tp}"), tp_size=tp) for tp in (1, 2)}


@pytest.fixture(scope="module")
def one_rank_without_reuse(engines) -> list[list[int]]:
    """The conversations on one rank, no prefix reuse: what both plan channels' runs must answer."""
    with Executor(engines[1], ExecutorConfig(max_tokens_in_paged_kv_cache=96, enable_kv_cache_reuse=False),
                  device="cpu") as executor:
        return converse(executor, PROMPTS)


# over shared memory in `make test-all` (~9 s on 2 cores): make test runs that channel in test_tp_engine.py's tp2 jobs
@pytest.mark.parametrize("plans", ["gloo", pytest.param("shared memory", marks=pytest.mark.extended)])
def test_two_ranks_with_the_host_tier_answer_like_one_rank_without_reuse(engines, one_rank_without_reuse, tmp_path,
                                                                         plans):
    """Also every rank's exit 0 once the leader's executor shut down (run_ranks), over each plan channel:
    test_tp_engine.py's jobs end with a killed rank."""
    want = one_rank_without_reuse
    out = str(tmp_path / "tp2.json")
    result = run_ranks([sys.executable, DRIVER, "--engine_dir", engines[2], "--out", out], engines[2], 2, out,
                       TRITONLLM_SHM_PLANS="1" if plans == "shared memory" else "0")
    assert result["runner"] == "LeaderRunner" and result["leaked"] == 0
    assert result["comm_threads"] == []  # joined at shutdown, not left to interpreter finalization
    assert result["onboarded"] > 0 and result["offloaded"] >= result["onboarded"]
    assert result["histories"] == want
