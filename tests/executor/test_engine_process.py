"""EngineProcess: the executor in a child process behind the Executor API (what the Triton model uses).

The child is real (``python -m engine.executor.engine_process``), so these tests cover the
protocol, id numbering, coalescing in the client, stats, and what happens when the child dies.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import replace

import numpy as np
import pytest

from engine.executor.engine_process import READ_POLL_ENV, EngineProcess
from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.request import FinishReason, OutputConfig, Request, Response, SamplingConfig

from executor_testing import collect, final_tokens


def mixed_requests() -> list[Request]:
    prompts = [[1, 2, 3], [5] * 17, list(range(10, 40)), [7, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    return [Request(input_token_ids=prompt, max_tokens=6 + i, streaming=i % 2 == 0,
                    output=OutputConfig(exclude_input_from_output=True))
            for i, prompt in enumerate(prompts)]


@contextlib.contextmanager
def read_poll(microseconds: str):
    """READ_POLL_ENV for the clients made inside (read by the reader thread a client's constructor starts)."""
    saved = os.environ.get(READ_POLL_ENV)
    os.environ[READ_POLL_ENV] = microseconds
    try:
        yield
    finally:
        if saved is None:
            del os.environ[READ_POLL_ENV]
        else:
            os.environ[READ_POLL_ENV] = saved


@pytest.fixture(scope="module")
def shared_engine_process(tiny_engine, tmp_path_factory):
    """One engine process for both readers below (each start costs a torch import and a load): its
    owner, whose reader blocks, and the socket other clients attach to."""
    listen_path = str(tmp_path_factory.mktemp("engine_socket") / "engine.sock")
    with read_poll("0"):
        owner = EngineProcess(tiny_engine, ExecutorConfig(), listen_path=listen_path)
    yield owner, listen_path
    owner.shutdown()


@pytest.fixture(scope="module", params=["0", "300"], ids=["blocking-reader", "polling-reader"])
def engine_process(shared_engine_process, request):
    """The client's reader blocks in reads (the owner), or polls while requests are open (READ_POLL_ENV:
    a client attached to the same engine process; the reader is the same code for both kinds of client,
    and until 2026-11-30 each reader had an engine process of its own)."""
    owner, listen_path = shared_engine_process
    if request.param == "0":
        yield owner
        return
    with read_poll(request.param):
        client = EngineProcess.attach(listen_path, timeout_s=30)
    yield client
    client.shutdown()


def test_outputs_equal_the_in_process_executor(tiny_engine, engine_process):
    with Executor(tiny_engine, ExecutorConfig()) as local:
        expected = collect(local, local.enqueue_requests(mixed_requests()))
    ids = engine_process.enqueue_requests(mixed_requests())
    got = collect(engine_process, ids)
    assert [final_tokens(got[i]) for i in ids] == [final_tokens(r) for r in expected.values()]
    # Streams arrive as deltas with one final response each; finish reasons cross the process.
    for i in ids:
        assert [r.result.is_final for r in got[i]][-1] and sum(r.result.is_final for r in got[i]) == 1
        assert got[i][-1].result.finish_reasons == [FinishReason.LENGTH]


def test_bad_request_is_answered_with_an_error_and_others_are_served(engine_process):
    good = Request(input_token_ids=[1, 2, 3], max_tokens=4)
    bad = Request(input_token_ids=[], max_tokens=4)
    ids = engine_process.enqueue_requests([bad, good])
    got = collect(engine_process, ids)
    assert "input" in got[ids[0]][-1].error.lower()
    assert len(final_tokens(got[ids[1]])) == 4 + 3  # prompt + output (exclude_input_from_output off)


def test_cancel_frees_the_blocks_and_stats_cross_the_process(engine_process):
    """Cancelled right behind its enqueue (the engine reads both from one pipe, in order: a GPU decodes the tiny
    model's 120 tokens in a few ms, before any cancel sent after watching the stats or the first streamed token
    arrived, 2026-11-30's suite), the request ends CANCELLED short of its max_tokens and its blocks come back."""
    request_id = engine_process.enqueue_request(
        Request(input_token_ids=[1, 2, 3], max_tokens=120, streaming=True, sampling=SamplingConfig()))
    deadline = time.monotonic() + 30
    engine_process.cancel_request(request_id)
    responses = collect(engine_process, [request_id])[request_id]
    assert responses[-1].result.finish_reasons == [FinishReason.CANCELLED]
    assert sum(len(r.result.output_token_ids[0]) for r in responses if r.result is not None) < 3 + 120  # prompt + output
    # stats cross the process after an iteration: until the first arrive, this reader holds empty ones
    while ((stats := engine_process.get_latest_iteration_stats().kv_cache_stats).used_num_blocks != 0
           or stats.max_num_blocks == 0):
        assert time.monotonic() < deadline, f"the cancelled request's blocks were not freed: {stats}"
        time.sleep(0.02)


def test_a_dead_engine_process_fails_in_flight_and_new_requests(tiny_engine):
    process = EngineProcess(tiny_engine, ExecutorConfig())
    try:
        in_flight = process.enqueue_request(Request(input_token_ids=[1, 2, 3], max_tokens=120, streaming=True))
        collect_first = process.await_responses(timeout=30)
        assert collect_first, "no response from the engine process"
        os.kill(process._process.pid, signal.SIGKILL)
        started = time.monotonic()
        responses = collect(process, [in_flight], timeout=10)[in_flight]
        assert "engine process exited" in responses[-1].error
        assert time.monotonic() - started < 10
        assert process.failure is not None and not process.can_enqueue_requests()
        late = process.enqueue_request(Request(input_token_ids=[1, 2], max_tokens=2))
        assert "engine process exited" in collect(process, [late], timeout=5)[late][-1].error
    finally:
        process.shutdown()


def test_a_load_failure_is_raised_with_its_reason(tmp_path):
    with pytest.raises(RuntimeError, match="config.json|engine"):
        EngineProcess(str(tmp_path / "no_engine_here"), ExecutorConfig())


def test_responses_survive_the_wire_format():
    import torch

    from engine.executor.engine_process import pack_responses, unpack_responses
    from engine.executor.request import RequestPerfMetrics, Response, Result

    delta = Result(output_token_ids=[[5, 6]], is_final=False, finish_reasons=[FinishReason.NOT_FINISHED],
                   log_probs=[[-0.5, -1.0]], cum_log_probs=[-1.5], generation_logits=torch.randn(1, 2, 7),
                   sequence_index=1, perf=RequestPerfMetrics(1, 2, 3, 4, 5, 6, 11))
    delta._streaming_delta = True
    final = Result(output_token_ids=[[1, 2], [3]], is_final=True, finish_reasons=[FinishReason.END_ID, FinishReason.LENGTH],
                   context_logits=torch.randn(4, 7), context_phase_params=b"TLLMCTX\x01{}")
    sent = [Response(3, result=delta), Response(4, result=final), Response(5, error="invalid request: empty input")]
    got = unpack_responses(pack_responses(sent))
    assert [(r.request_id, r.error) for r in got] == [(3, None), (4, None), (5, "invalid request: empty input")]
    assert got[0].result.output_token_ids == [[5, 6]] and got[0].result.perf == delta.perf
    assert getattr(got[0].result, "_streaming_delta", False) and not hasattr(got[1].result, "_streaming_delta")
    # Logits cross as numpy (a client unpickles them without torch), equal to the tensors sent.
    assert isinstance(got[0].result.generation_logits, np.ndarray)
    assert np.array_equal(got[0].result.generation_logits, delta.generation_logits.numpy())
    assert np.array_equal(got[1].result.context_logits, final.context_logits.numpy())
    bf16 = torch.randn(1, 2, 7).to(torch.bfloat16)
    widened = unpack_responses(pack_responses([Response(6, result=replace(final, generation_logits=bf16))]))
    assert np.array_equal(widened[0].result.generation_logits, bf16.float().numpy())
    assert got[1].result.finish_reasons == [FinishReason.END_ID, FinishReason.LENGTH] and got[1].result.perf is None
    assert got[1].result.context_phase_params == b"TLLMCTX\x01{}" and got[0].result.context_phase_params is None


def test_the_engine_process_exits_when_its_client_is_gone(tiny_engine):
    """A killed Triton stub closes its end of the socket: the engine must not outlive it."""
    process = EngineProcess(tiny_engine, ExecutorConfig())
    process.enqueue_request(Request(input_token_ids=[1, 2, 3], max_tokens=120, streaming=True))
    process._stopping = True  # as if the stub vanished: no shutdown message, only a closed socket
    process._conn.close()
    try:
        assert process._process.wait(timeout=30) == 0
    finally:
        process._kill()


def test_attached_clients_share_one_engine_each_with_its_own_ids_and_one_that_leaves_has_its_requests_cancelled(
        tiny_engine, tmp_path):
    """Several Triton model instances relay one engine process: each numbers its requests alone,
    gets exactly its own responses, and reaches the others with peer messages. An attached client
    that leaves has its running requests cancelled while the owner's engine serves on; the owner's
    shutdown closes the socket. (One engine process for both halves: each start costs a torch import.)"""
    listen_path = str(tmp_path / "engine.sock")
    with Executor(tiny_engine, ExecutorConfig()) as local:
        expected = collect(local, local.enqueue_requests(mixed_requests()))
    owner = EngineProcess(tiny_engine, ExecutorConfig(), listen_path=listen_path)
    try:
        attached = EngineProcess.attach(listen_path, timeout_s=30)
        assert (owner.client_index, attached.client_index) == (0, 1)
        heard = []
        owner.on_peer_message = heard.append
        attached.send_peer_message(("stop", "user-7"))
        owner_ids = owner.enqueue_requests(mixed_requests())
        attached_ids = attached.enqueue_requests(mixed_requests())
        assert owner_ids == attached_ids  # the same numbers, two different requests each
        for client, ids in ((owner, owner_ids), (attached, attached_ids)):
            got = collect(client, ids)
            # A stray response of the other client's same-numbered request would add tokens here.
            assert [final_tokens(got[i]) for i in ids] == [final_tokens(r) for r in expected.values()]
        assert owner.await_responses(timeout=0.2) == [] and attached.await_responses(timeout=0.2) == []
        assert heard == [("stop", "user-7")]

        leaving = EngineProcess.attach(listen_path, timeout_s=30)
        iteration_before = owner.get_latest_iteration_stats().iter  # the engine is idle: the owner's requests are done
        leaving.enqueue_request(Request(input_token_ids=[1, 2, 3], max_tokens=120, streaming=True))
        # Its first streamed tokens say it runs. (Not the owner's view of the pool: the stats reach clients every
        # STATS_PERIOD_S, and on a GPU the tiny engine's 120 steps can all fit between two of them.)
        assert leaving.await_responses(timeout=30), "the attached client's request never ran"
        leaving.shutdown()  # an attached client's shutdown leaves the engine running for the owner
        deadline = time.monotonic() + 30
        while True:  # cancelled by the leave (or, on a fast GPU, finished before it): no blocks kept either way
            stats = owner.get_latest_iteration_stats()
            if stats.iter > iteration_before and stats.num_active_requests == 0 \
                    and stats.kv_cache_stats.used_num_blocks == 0:
                break
            assert time.monotonic() < deadline, "the leaving client's request kept its blocks"
            time.sleep(0.02)
        request_id = owner.enqueue_request(Request(input_token_ids=[1, 2], max_tokens=3))
        assert len(final_tokens(collect(owner, [request_id])[request_id])) == 2 + 3
    finally:
        owner.shutdown()
    with pytest.raises(RuntimeError, match="no engine process answered"):
        EngineProcess.attach(listen_path, timeout_s=0.3)  # the owner's shutdown closed the socket


def test_the_engine_keeps_the_running_ids_of_each_attached_client_to_cancel_when_it_leaves():
    from engine.executor.engine_process import CLIENT_ID_STRIDE, _Clients
    from engine.executor.request import Result

    clients = _Clients(owner=None)
    clients._conns[1] = clients._conns[2] = (None, None)  # as if attached (nothing is sent below)
    clients._running[1], clients._running[2] = set(), set()
    first, second = CLIENT_ID_STRIDE + 1, CLIENT_ID_STRIDE + 2
    clients.track(1, [first, second])
    clients.track(0, [5])  # the owner's requests end with the engine itself
    clients.send = lambda index, message: None
    clients.send_responses([Response(first, result=Result(output_token_ids=[[4]], is_final=True, finish_reasons=[FinishReason.LENGTH])),
                            Response(second, result=Result(output_token_ids=[[4]], is_final=False, finish_reasons=[FinishReason.LENGTH]))])
    assert clients.remove(1) == [second] and clients.remove(2) == [] and clients.remove(0) == []


def test_what_the_engine_process_sends_a_client_unpickles_without_torch(tiny_engine, tmp_path):
    """The tensorrt_llm stub imports no torch, and its reader thread unpickles every message. A
    message whose classes live in a module that imports torch made that reader import it on the
    first LoRA iteration's stats (LoraCacheStats, then in engine/lora/cache.py): 2-5 s of CPU under
    the GIL while the stream's tokens waited in the socket, then went out as one response. Here the
    messages of a real engine (LoRA on, a stream asking for every output, logits included) go
    through the reader's path in a fresh interpreter, merging in its ResponseQueue as they would."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    from engine.executor.engine_process import pack_responses

    steps = []  # each loop step's responses, as the engine process sends them
    output = OutputConfig(return_log_probs=True, num_top_log_probs=2, return_context_logits=True,
                          return_generation_logits=True, return_perf_metrics=True, exclude_input_from_output=True)
    config = ExecutorConfig(enable_lora=True, max_loras=1, max_lora_rank=8)
    with Executor(tiny_engine, config, response_callback=steps.append) as executor:
        executor.enqueue_requests([Request(input_token_ids=[1, 2, 3], max_tokens=3, streaming=True, output=output)])
        deadline = time.monotonic() + 60
        while not any(r.error or r.result.is_final for batch in steps for r in batch):
            assert time.monotonic() < deadline, "no final response"
            time.sleep(0.01)
        stats = executor.get_latest_iteration_stats()
    assert stats.lora_cache_stats is not None and len(steps) >= 2
    messages = [("ready", 0), ("stats", stats, None), *(("responses", pack_responses(batch)) for batch in steps),
                ("peer", ("stop", "user-7"))]
    (tmp_path / "messages").write_bytes(pickle.dumps([pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages]))
    check = ("import pickle, sys; from engine.executor.engine_process import EngineProcess, unpack_responses; "
             "from engine.executor.output import ResponseQueue; queue = ResponseQueue(); "
             f"messages = [pickle.loads(p) for p in pickle.loads(open({str(tmp_path / 'messages')!r}, 'rb').read())]; "
             "[queue.put(unpack_responses(m[1])) for m in messages if m[0] == 'responses']; "
             "(merged,) = queue.take(0); result = merged.result; "
             "assert result.is_final and len(result.output_token_ids[0]) == 3, result; "
             "assert result.generation_logits.shape[:2] == (1, 3), result.generation_logits.shape; "
             "loaded = [m for m in ('torch', 'engine.lora.cache') if m in sys.modules]; "
             "assert not loaded, f'a message made the client import {loaded}'")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]
