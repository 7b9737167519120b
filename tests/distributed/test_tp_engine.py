"""Tensor parallelism at the engine level: real processes, gloo on CPU, no server.

The leader runs ``tests/distributed/tp_driver.py`` (greedy decoding on ``make_runner``); workers
are the real ``python -m engine.tensor_parallel.worker``. TP 2 must reproduce TP 1 (same random weights) token
for token, and a killed worker must turn into a clear error within seconds, a hung one after the step timeout.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from engine.config import EngineFormatError
from engine.tensor_parallel.distributed import DistSettings, RankInfo, check_world_matches_engine, make_runner, rank_info_from_env
from engine.tensor_parallel.step_protocol import decode_batch, encode_batch
from engine.executor.runner import ForwardBatch, ModelRunner
from tp_driver import GreedyDecoder
from tp_testing import PROMPTS, build_tiny_engine, kill_idle_worker, start_ranks, stop, tiny_llama

DRIVER = os.path.join(os.path.dirname(__file__), "tp_driver.py")
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    hf = tiny_llama()
    root = tmp_path_factory.mktemp("tp_engines")
    return {tp: build_tiny_engine(hf, str(root / f"tp{tp}"), tp_size=tp) for tp in (1, 2)}


@pytest.fixture(scope="module")
def tp1_run(engines) -> dict:
    """The driver's plain greedy decoding on one rank, in this process (make_runner gives a plain
    ModelRunner at world size 1; a process of its own cost a torch import), once for the module: the
    reference of every TP 2 run below (deterministic; plan channels and overlapping are TP 2 matters)."""
    runner = make_runner(engines[1], device="cpu", environ={})
    tokens, first_logits = GreedyDecoder(runner, PROMPTS, MAX_TOKENS).run()
    return {"tokens": tokens, "first_logits": first_logits, "runner": type(runner).__name__}


# The shared-memory job's step timeout (60 s by default): its worker hangs (tp2_job), and heartbeats every 0.5 s still
# have four chances to pass on a loaded machine. 3 s until 2026-11-30; at 2 s the leader noticed and exited ~2.5 s
# sooner (6.3 -> 3.8 s after the SIGSTOP, load 5).
HANG_TIMEOUT_S = 2


@pytest.fixture(scope="module", params=["gloo", "shared memory"])
def tp2_job(request, engines, tmp_path_factory) -> dict:
    """One launch of two ranks per plan channel (gloo, the CPU default; shared memory, the GPU one)
    for four checks, each of which started its own ranks before: plain greedy decoding, overlapped
    decoding (tp_driver --then_overlapped), an inconsistent batch refused (--then_refuse_a_bad_batch),
    then idle with heartbeats every 0.5 s until the worker is lost (--then_wait_for_failure): SIGKILLed in
    the gloo job, SIGSTOPped (hung: alive, sockets open, never answering) in the shared-memory one, whose
    step timeout is HANG_TIMEOUT_S (the hung worker was a job of its own over gloo until 2026-11-30: 14.8 s
    of CI's fresh clone). Every rank of a job that ends by SHUTDOWN exiting 0 is test_kv_host_tier_tp.py's
    check (run_ranks, both channels): this job's worker is lost."""
    out = str(tmp_path_factory.mktemp("tp2_job") / "tp2.json")
    cmd = [sys.executable, DRIVER, "--engine_dir", engines[2], "--prompts", json.dumps(PROMPTS),
           "--max_tokens", str(MAX_TOKENS), "--out", out, "--then_overlapped", "--then_refuse_a_bad_batch",
           "--then_wait_for_failure", "20"]
    hang = request.param == "shared memory"
    env = dict(TRITONLLM_SHM_PLANS="1", TRITONLLM_DIST_TIMEOUT_S=str(HANG_TIMEOUT_S)) if hang else \
        dict(TRITONLLM_SHM_PLANS="0")
    result, lost_to_exit_s = kill_idle_worker(cmd, engines[2], out, hang=hang, **env)
    return {**result, "channel": request.param, "lost_by": "hang" if hang else "kill", "lost_to_exit_s": lost_to_exit_s}


# ---- the plan encoding and the environment ------------------------------------------------------


def test_batch_encoding_round_trips():
    batch = ForwardBatch(token_ids=[5, 6, 7, 8], positions=[0, 1, 2, 9], seq_lens_q=[3, 1], context_lens=[3, 10],
                         block_tables=[[4], [0, 2]], logits_indices=[2, 3])
    payload = encode_batch(batch)
    assert payload.dtype == torch.int32
    assert decode_batch(payload, ForwardBatch) == batch
    empty_rows = ForwardBatch([1], [0], [1], [1], [[]], [])
    assert decode_batch(encode_batch(empty_rows), ForwardBatch) == empty_rows
    tree = dataclasses.replace(batch, tree_parents=[None, [-1]])  # a plain chunk beside a 1-token tree
    assert decode_batch(encode_batch(tree), ForwardBatch) == tree
    # Every sent field set, at int32's ends (the payload is packed through a C int array), and sent as the
    # shared-memory channel does (bytes)
    top, bottom = 2**31 - 1, -2**31
    full = ForwardBatch(token_ids=[top, 0, bottom], positions=[0, top, 2], seq_lens_q=[2, 1], context_lens=[top, 1],
                        block_tables=[[top, 0], []], logits_indices=[], sampled_tokens_slot=top, lora_slots=[bottom, top],
                        state_slots=[], cross_lengths=[0, top], cross_block_tables=[[], [top]],
                        tree_parents=[[-1, 0], None], micro_batches=top)
    sent = torch.frombuffer(bytearray(encode_batch(full).numpy().tobytes()), dtype=torch.int32)
    assert decode_batch(sent, ForwardBatch) == full
    with pytest.raises(OverflowError):  # not wrapped around
        encode_batch(dataclasses.replace(full, token_ids=[2**31]))
    masked = dataclasses.replace(batch, cross_masks=[object(), None])  # host objects: never sent, named
    with pytest.raises(TypeError, match="'cross_masks' holds host objects the step protocol does not send"):
        encode_batch(masked)


@pytest.mark.parametrize("environ, expected", [
    ({}, RankInfo(0, 1, 0, 1)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, RankInfo(2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, RankInfo(1, 2, 1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, RankInfo(1, 2, 1, 2)),
])
def test_rank_info_from_launcher_variables(environ, expected):
    assert rank_info_from_env(environ) == expected


def test_multi_node_without_rendezvous_address_is_a_clear_error():
    with pytest.raises(ValueError, match="TRITONLLM_DIST_ADDR"):
        DistSettings.from_env(RankInfo(0, 4, 0, 2), {})
    with pytest.raises(ValueError, match="HEARTBEAT"):
        DistSettings.from_env(RankInfo(0, 2, 0, 2), {"TRITONLLM_DIST_TIMEOUT_S": "1", "TRITONLLM_DIST_HEARTBEAT_S": "5"})


def test_world_size_must_equal_tp_size(engines):
    with pytest.raises(ValueError, match=r"tp_size 2 but is running on world_size 3.*--world_size 2"):
        check_world_matches_engine(engines[2], 3)
    with pytest.raises(ValueError, match="tp_size 2 but is running on world_size 1"):
        make_runner(engines[2], device="cpu", environ={})
    with pytest.raises(EngineFormatError):
        check_world_matches_engine("/nonexistent/engine", 1)


def test_single_rank_gets_a_plain_model_runner(engines):
    assert type(make_runner(engines[1], device="cpu", environ={})) is ModelRunner


# ---- real ranks ----------------------------------------------------------------------------------


# The shared-memory channel's leader-death case is `make test-all`'s (~7 s on 2 cores): make test runs that channel in
# the tp2 jobs above (greedy, overlapped, a refused batch, a hung worker) and the leader's death over gloo.
@pytest.fixture(params=["gloo", pytest.param("shared memory", marks=pytest.mark.extended)])
def plans(request, monkeypatch):
    """Both plan channels: gloo (the CPU default) and the shared-memory one (the GPU default)."""
    monkeypatch.setenv("TRITONLLM_SHM_PLANS", "1" if request.param == "shared memory" else "0")
    return request.param


def test_tp2_greedy_and_overlapped_decoding_equal_tp1(tp2_job, tp1_run):
    """Plain decoding, then overlapped decoding on the same two ranks. Overlapped: placeholder ids in the
    plans, every rank resolves them from the tokens the leader sampled and broadcast
    (LeaderRunner.store_sampled_tokens), so TP 2 still equals plain TP 1 decoding."""
    single, double = tp1_run, tp2_job
    assert (single["runner"], double["runner"]) == ("ModelRunner", "LeaderRunner")
    assert double["plans"] == double["channel"]
    assert double["tokens"] == single["tokens"]
    # fp32 partial sums are added in another order across ranks: equal to rounding.
    torch.testing.assert_close(torch.tensor(double["first_logits"]), torch.tensor(single["first_logits"]),
                               rtol=1e-4, atol=1e-4)
    assert len({tuple(t) for t in single["tokens"]}) > 1  # the prompts really lead different ways
    assert double["overlapped_tokens"] == single["tokens"]


def test_a_refused_batch_keeps_the_ranks_in_step(tp2_job, tp1_run):
    # An inconsistent batch is the caller's error, not a rank failure: every rank refuses it
    # before any collective, and the next steps run normally.
    assert tp2_job["refusal"].startswith("ValueError") and "inconsistent" in tp2_job["refusal"]
    assert tp2_job["failure_after_refusal"] is None
    assert tp2_job["tokens_after"] == tp1_run["tokens"]


def test_a_killed_or_hung_worker_fails_the_leader(tp2_job):
    """Killed (the gloo job): noticed while idle (heartbeat) within seconds. Hung (the shared-memory job):
    the heartbeat times out after the step timeout, not never. Either way the next step fails at once
    and the leader exits 0."""
    result = tp2_job
    assert result["failure"] and "rank failure" in result["failure"]
    assert result["step_error"].startswith("RankFailureError") and result["step_error_after_s"] < 1
    assert result["lost_to_exit_s"] < 15
    if result["lost_by"] == "kill":
        assert result["detected_after_s"] < 5
    else:
        assert "heartbeat" in result["failure"]
        assert HANG_TIMEOUT_S - 0.5 < result["detected_after_s"] < 10


def test_worker_exits_when_the_leader_dies(engines, tmp_path, plans):
    """... also with its load frozen (engine/executor/gc_freeze.py, forced on the CPU), as rank 0's is."""
    cmd = [sys.executable, DRIVER, "--engine_dir", engines[2], "--prompts", json.dumps(PROMPTS),
           "--max_tokens", "2", "--out", str(tmp_path / "x.json"), "--then_wait_for_failure", "60"]
    leader, (worker,) = start_ranks(cmd, engines[2], 2, TRITONLLM_DIST_HEARTBEAT_S="0.5", TRITONLLM_GC_FREEZE="1")
    try:
        assert leader.stdout.readline().strip() == "IDLE"
        leader.send_signal(signal.SIGKILL)
        worker_log, _ = worker.communicate(timeout=15)  # a lost leader closes the sockets: the worker leaves, non-zero
        assert worker.returncode == 1
    finally:
        stop([leader, worker])
    assert "objects of the load frozen" in worker_log, worker_log
