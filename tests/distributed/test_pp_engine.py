"""Pipeline parallelism at the engine level with real processes (the leader on tp_driver.py, the
other ranks the real ``python -m engine.tensor_parallel.worker``), gloo on CPU: tp 2 x pp 2 on four
ranks decodes exactly as one rank, overlapped (placeholder ids from the sampled-token ring) as the
executor drives it, a killed stage fails the leader within seconds, and every other architecture
check_pipeline_supported admits (tests/engine/pipeline_ranks.py PP_MORE_LAYERS) decodes at pp 2 on two
ranks exactly as on one.

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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
from engine_testing import tiny_hf  # noqa: E402
from pipeline_ranks import PP_MORE_LAYERS  # noqa: E402

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


@pytest.mark.parametrize("family", list(PP_MORE_LAYERS))
def test_pp2_of_each_admitted_family_decodes_like_one_rank(family, tmp_path):
    hf = tiny_hf(family)
    one_rank = build_tiny_engine(hf, str(tmp_path / "pp1"), tp_size=1)
    two_stages = build_tiny_engine(hf, str(tmp_path / "pp2"), tp_size=1, pp_size=2, pp_layers=PP_MORE_LAYERS[family])
    one = run_driver(one_rank, 1, str(tmp_path / "one.json"))
    two = run_driver(two_stages, 2, str(tmp_path / "two.json"))
    assert two["tokens"] == one["tokens"] and all(len(tokens) == 6 for tokens in one["tokens"])
