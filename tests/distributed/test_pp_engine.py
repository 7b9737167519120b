"""Pipeline parallelism at the engine level with real processes (the leader on tp_driver.py, the
other ranks the real ``python -m engine.tensor_parallel.worker``), gloo on CPU: tp 2 x pp 2 on four
ranks decodes exactly as one rank, overlapped (placeholder ids from the sampled-token ring) as the
executor drives it, and a killed stage fails the leader within seconds.

Four ranks on the 2-core CI machine cost more than this file may add to the suite: it runs with
TRITONLLM_PP_RANKS=1. In CI, pp 2 is held to pp 1 on the shared gloo pair
(tests/engine/test_pipeline_parallel.py) and served through a real tritonserver job
(tests/distributed/test_tp_serving.py)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tp_testing import PROMPTS, build_tiny_engine, kill_idle_worker, run_ranks, tiny_llama

pytestmark = pytest.mark.skipif(os.environ.get("TRITONLLM_PP_RANKS") != "1",
                                reason="four real ranks; set TRITONLLM_PP_RANKS=1 to run")

DRIVER = os.path.join(os.path.dirname(__file__), "tp_driver.py")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    hf = tiny_llama()
    root = tmp_path_factory.mktemp("pp_engines")
    return {mapping: build_tiny_engine(hf, str(root / f"tp{mapping[0]}pp{mapping[1]}"), tp_size=mapping[0],
                                       pp_size=mapping[1]) for mapping in ((1, 1), (1, 2), (2, 2))}


def run_driver(engine_dir: str, world_size: int, out: str, *extra: str) -> dict:
    cmd = [sys.executable, DRIVER, "--engine_dir", engine_dir, "--prompts", json.dumps(PROMPTS),
           "--max_tokens", "6", "--out", out, *extra]
    return run_ranks(cmd, engine_dir, world_size, out)


def test_tp2_pp2_on_four_ranks_decodes_like_one(engines, tmp_path):
    one = run_driver(engines[(1, 1)], 1, str(tmp_path / "one.json"))
    four = run_driver(engines[(2, 2)], 4, str(tmp_path / "four.json"), "--overlapped", "--then_refuse_a_bad_batch")
    assert four["tokens"] == one["tokens"]
    assert four["refusal"].startswith("ValueError: ForwardBatch is inconsistent") and four["failure_after_refusal"] is None
    assert four["tokens_after"] == one["tokens"]  # a refused plan leaves the stages in step


def test_killed_stage_fails_the_leader_within_seconds(engines, tmp_path):
    out = str(tmp_path / "fault.json")
    cmd = [sys.executable, DRIVER, "--engine_dir", engines[(1, 2)], "--prompts", json.dumps(PROMPTS),
           "--max_tokens", "2", "--out", out, "--then_wait_for_failure", "20"]
    result, elapsed = kill_idle_worker(cmd, engines[(1, 2)], out)
    assert result["failure"] and "rank failure" in result["failure"]
    assert result["step_error"].startswith("RankFailureError") and elapsed < 15
