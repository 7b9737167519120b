"""Disaggregated serving across two executors of one process (engine/executor/disaggregated.py):
context_only -> generation_only gives the aggregated request's greedy ids; pinned blocks are freed
when fetched or expired (no leak on either side); bad params get named errors."""
from __future__ import annotations

import os
import threading
import time

import pytest

from engine.executor import Executor, ExecutorConfig, kv_peer, kv_transfer_cuda_ipc, kv_transfer_shm
from engine.executor.context_phase import decode, encode
from engine.executor.request import Request, SamplingConfig
from tests.executor.executor_testing import collect, dead_pid, final_tokens, wait_until

PROMPTS = [[(5 * i + 3 * j + 1) % 128 for j in range(n)] for i, n in enumerate((3, 9, 13, 4, 17))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pair(tiny_engine):
    """(context executor, generation executor) on one engine; a small pool so a leak would show.
    TRITONLLM_DISAGG_DEVICES=cuda:0,cuda:1 puts them on two GPUs (the local transport's peer copy;
    benchmarks/next_gpu_runs.md); by default both use the session's device."""
    cfg = ExecutorConfig(max_tokens_in_paged_kv_cache=256)
    devices = os.environ.get("TRITONLLM_DISAGG_DEVICES", "").split(",") if os.environ.get("TRITONLLM_DISAGG_DEVICES") else [None, None]
    with Executor(tiny_engine, cfg, device=devices[0]) as context, Executor(tiny_engine, cfg, device=devices[1]) as generation:
        yield context, generation


def run(ex, request: Request) -> list:
    """Every response of one request, up to its final one."""
    request_id = ex.enqueue_request(request)
    return collect(ex, [request_id])[request_id]


def greedy(prompt, **kw) -> Request:
    return Request(list(prompt), MAX_TOKENS, sampling=SamplingConfig(top_k=1), **kw)


def all_free(ex) -> bool:
    return ex.disagg.num_pinned_blocks == 0 and ex.blocks.num_free_blocks == ex.blocks.num_blocks


@pytest.fixture
def transport(request, pair, tmp_path, monkeypatch):
    """The context side's transport for one test; shm files go to tmp_path (checked empty after)."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    pair[0].disagg.transport = request.param
    yield request.param
    pair[0].disagg.transport = "local"
    assert not [f for f in tmp_path.iterdir() if f.suffix != ".ipc"], "a KV transfer file was left behind"
    # (.ipc: auto on CUDA shares the context pool once, for the executor's life: kv_transfer_cuda_ipc.PoolShare)


@pytest.mark.parametrize("transport,streaming", [("local", False), ("local", True), ("shm", False), ("auto", False)],
                         indirect=["transport"])
def test_context_then_generation_equals_aggregated(pair, transport, streaming):
    context, generation = pair
    for prompt in PROMPTS:
        expected = final_tokens(run(generation, greedy(prompt)))  # prompt + output
        ctx = run(context, greedy(prompt, request_type="context_only"))
        assert ctx[-1].error is None and ctx[-1].result.is_final
        assert ctx[-1].result.output_token_ids[0] == list(prompt) + expected[len(prompt):][:1]
        params = ctx[-1].result.context_phase_params
        assert decode(params)["prompt_len"] == len(prompt) and decode(params)["transport"] == transport
        assert context.disagg.num_pinned_blocks > 0 if transport in ("local", "auto") else \
            wait_until(lambda: all_free(context))  # (shm: freed once written)
        got = final_tokens(run(generation, greedy(prompt, streaming=streaming, request_type="generation_only",
                                                  context_phase_params=params)))
        assert (list(prompt) + got if streaming else got) == expected  # (a stream sends the output only)
    assert wait_until(lambda: all_free(context)) and wait_until(lambda: all_free(generation))
    imports = generation.disagg.imports
    assert imports.num_transfers >= len(PROMPTS) and imports.kv_cache_transfer_ms > 0
    stats = generation.get_latest_iteration_stats()  # what nv_trt_llm_disaggregated_serving_metrics shows
    assert stats.num_kv_transfers_total == imports.num_transfers and stats.kv_cache_transfer_ms_total > 0


@pytest.mark.parametrize("transport", ["local", "shm", "auto"], indirect=True)
def test_pinned_blocks_expire_and_fetch_is_one_shot(pair, transport):
    context, generation = pair
    prompt = PROMPTS[2]
    params = run(context, greedy(prompt, request_type="context_only"))[-1].result.context_phase_params
    assert final_tokens(run(generation, greedy(prompt, request_type="generation_only", context_phase_params=params)))
    again = run(generation, greedy(prompt, request_type="generation_only", context_phase_params=params))
    assert "context_phase_params: the context phase's KV cache is gone" in again[-1].error
    context.disagg.timeout_s = 0.2
    try:
        expired = run(context, greedy(prompt, request_type="context_only"))[-1].result.context_phase_params
        assert wait_until(lambda: all_free(context) and not context.disagg.exports._pins), "not freed while idle"
        late = run(generation, greedy(prompt, request_type="generation_only", context_phase_params=expired))
        assert "context_phase_params: the context phase's KV cache is gone" in late[-1].error
    finally:
        context.disagg.timeout_s = 60.0
    assert context.disagg.exports.num_expired >= 1 and wait_until(lambda: all_free(generation))


def test_a_request_chooses_shm_over_the_executors_local_default(pair, tmp_path, monkeypatch):
    """kv_transfer on the context_only request (what disaggregated_serving_bls sends when its two
    models are two engine processes) wins over the executor's default; a bad one is named."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    context, generation = pair
    assert context.disagg.transport == "local"
    prompt = PROMPTS[3]
    params = run(context, greedy(prompt, request_type="context_only", kv_transfer="shm"))[-1].result.context_phase_params
    assert decode(params)["transport"] == "shm" and wait_until(lambda: all_free(context))  # (freed once written)
    got = final_tokens(run(generation, greedy(prompt, request_type="generation_only", context_phase_params=params)))
    assert got == final_tokens(run(generation, greedy(prompt)))
    bad = run(context, greedy(prompt, request_type="context_only", kv_transfer="nccl"))
    assert bad[-1].error == "kv_transfer: 'nccl' is not supported; allowed: local, shm, nixl, cuda_ipc, auto"
    assert not list(tmp_path.iterdir()) and wait_until(lambda: all_free(generation))


def test_a_failing_export_fails_its_request_alone(pair, monkeypatch):
    """An export that raises (here: a /dev/shm too full for the file) fails that context_only request by name, pins
    nothing and frees its blocks; the request decoding beside it goes on (it was failed with every other)."""
    context, _ = pair

    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096,) * 2 + (0,) * 8))
    beside = context.enqueue_request(Request(list(PROMPTS[0]), 32, sampling=SamplingConfig(top_k=1), streaming=True))
    first = context.await_responses(timeout=30)  # (decoding now)
    assert first and first[0].error is None and not first[0].result.is_final
    failing = context.enqueue_request(greedy(PROMPTS[1], request_type="context_only", kv_transfer="shm"))
    got = collect(context, [beside, failing])
    assert got[failing][-1].error.startswith("context_phase_params: exporting the context phase's KV (kv_transfer "
                                             "shm) failed: OSError(28, '")
    assert "has 0 bytes free, the KV file needs 6144'" in got[failing][-1].error  # (3 blocks of 2,048 bytes)
    assert all(r.error is None for r in got[beside]) and got[beside][-1].result.is_final
    assert wait_until(lambda: all_free(context)) and not context.disagg.exports._pins


def dead_peer() -> dict:
    """The kv_peer identity of a process of this host that has exited."""
    return {**kv_peer.identity(), "pid": dead_pid()}


def test_a_dead_context_process_fails_the_file_wait_at_once(pair, tmp_path, monkeypatch):
    """shm: the generation side waits for a file still being written; when the blob's context process is gone
    (same host: its pid), the request fails at once by name (not after the transfer timeout) and the partial file
    that nobody would remove goes."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    context, generation = pair
    writing, real_write = threading.Event(), kv_transfer_shm._write
    monkeypatch.setattr(kv_transfer_shm, "_write", lambda *args: writing.wait(30) and real_write(*args))
    monkeypatch.setattr(generation.disagg, "timeout_s", 5.0)
    prompt = PROMPTS[3]
    fields = decode(run(context, greedy(prompt, request_type="context_only", kv_transfer="shm"))[-1].result.context_phase_params)
    assert os.path.exists(fields["path"] + ".partial") and context.disagg.num_pinned_blocks > 0  # (until written)
    started = time.monotonic()
    error = run(generation, greedy(prompt, request_type="generation_only",
                                   context_phase_params=encode({**fields, "peer": dead_peer()})))[-1].error
    assert error.startswith("context_phase_params: the context process (pid ") and "is gone" in error
    assert time.monotonic() - started < 2.5 and not os.path.exists(fields["path"] + ".partial")
    writing.set()
    assert wait_until(lambda: os.path.exists(fields["path"]))  # (the writer went on: the file is deleted below)
    kv_transfer_shm.expire(fields["path"])
    assert wait_until(lambda: all_free(context)) and wait_until(lambda: all_free(generation))


def test_bad_params_are_refused_by_name(pair):
    context, generation = pair
    prompt = PROMPTS[1]
    params = run(context, greedy(prompt, request_type="context_only"))[-1].result.context_phase_params
    fields = decode(params)
    cases = {
        params[:12]: "context_phase_params: truncated or corrupted blob",
        b"junk": "context_phase_params: not a context phase blob",
        encode({**fields, "layout": {**fields["layout"], "tokens_per_block": 8}}):
            "context_phase_params: the context engine's KV layout differs from this engine's (tokens_per_block 8 vs 4)",
        encode({**fields, "layout": {**fields["layout"], "dtype": "float16"}}): "(dtype float16 vs float32)",
    }
    for blob, message in cases.items():
        response = run(generation, greedy(prompt, request_type="generation_only", context_phase_params=blob))
        assert message in response[-1].error
    other = run(generation, greedy(PROMPTS[0], request_type="generation_only", context_phase_params=params))
    assert "context_phase_params: they belong to another prompt" in other[-1].error
    missing = run(generation, greedy(prompt, request_type="generation_only"))
    assert "needs the context_phase_params output" in missing[-1].error
    kind = run(generation, greedy(prompt, request_type="prefill"))
    assert kind[-1].error.startswith("request_type: 'prefill' is not supported; allowed: context_and_generation")
    beams = run(context, Request(list(prompt), 4, sampling=SamplingConfig(beam_width=2), request_type="context_only"))
    assert beams[-1].error.startswith("request_type: context_only is not supported with beam_width > 1")
    # the good params were never fetched: fetch them now, so nothing stays pinned
    assert final_tokens(run(generation, greedy(prompt, request_type="generation_only", context_phase_params=params)))
    assert wait_until(lambda: all_free(context)) and wait_until(lambda: all_free(generation))


def test_cancel_at_each_phase_leaks_no_block(pair):
    """A context_only request cancelled before its first token pins nothing; a generation_only one
    cancelled while decoding frees its imported blocks (and the context side's pin was released)."""
    context, generation = pair
    prompt = PROMPTS[4]
    request_id = context.enqueue_request(greedy(prompt, request_type="context_only"))
    context.cancel_request(request_id)
    collect(context, [request_id])
    params = run(context, greedy(prompt, request_type="context_only"))[-1].result.context_phase_params
    long = Request(list(prompt), 64, sampling=SamplingConfig(top_k=1), streaming=True, request_type="generation_only",
                   context_phase_params=params)
    request_id = generation.enqueue_request(long)
    first = generation.await_responses(timeout=30)
    assert first and first[0].error is None
    generation.cancel_request(request_id)
    responses = first + collect(generation, [request_id])[request_id] if not first[0].is_final else first
    assert responses[-1].is_final
    assert wait_until(lambda: all_free(context)) and wait_until(lambda: all_free(generation))
    assert not context.disagg.ready.pending  # the cancelled prompt's ready mark was dropped, the other's exported


class HeldPulls:
    """The generation side's pulls kept in progress until ``held`` is cleared: the CUDA path's timing (a pull
    finishes at a later step, engine/executor/kv_pull.py) on any device."""

    def __init__(self, real):
        self.real, self.held = real, True

    def pull(self, *args):
        return _HeldPull(self.real.pull(*args), self)


class _HeldPull:
    def __init__(self, pull, owner):
        self.pull, self.owner = pull, owner

    def done(self) -> bool:
        return not self.owner.held and self.pull.done()

    def wait(self) -> None:
        self.pull.wait()

    def order_before(self) -> None:
        self.pull.order_before()

    def elapsed_ms(self) -> float:
        return self.pull.elapsed_ms()


@pytest.mark.parametrize("transport", ["local", "cuda_ipc (choice faked)"])
def test_a_pull_in_progress_keeps_its_blocks_until_done_even_when_cancelled(pair, transport, tmp_path, monkeypatch):
    """While a pull is in progress the source stays pinned and the sequence waits (no response); a cancel
    meanwhile ends the request at once and the pull's blocks are freed when it is done (both sides).
    cuda_ipc: an auto blob whose choice is faked to return the context's pool (what CUDA IPC maps in another
    process): the offer's claim and release (kv_transfer_cuda_ipc.IpcPull, files) around kv_pull's CPU copy."""
    context, generation = pair
    if transport != "local":
        monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
        monkeypatch.setattr(context.disagg, "transport", "auto")
        monkeypatch.setattr(kv_transfer_cuda_ipc, "choose",
                            lambda fields, pool, peers, in_process: ("cuda_ipc", context.runner.kv_cache, "faked"))
        chosen = generation.disagg.ipc.chosen.get("cuda_ipc", 0)
    held = HeldPulls(generation.disagg.imports.pulls)
    monkeypatch.setattr(generation.disagg.imports, "pulls", held)
    prompt = PROMPTS[2]
    expected = final_tokens(run(generation, greedy(prompt)))
    params = run(context, greedy(prompt, request_type="context_only"))[-1].result.context_phase_params
    request_id = generation.enqueue_request(greedy(prompt, request_type="generation_only", context_phase_params=params))
    assert wait_until(lambda: generation.disagg.num_importing == 1)
    assert not generation.await_responses(timeout=0.05) and context.disagg.num_pinned_blocks > 0
    held.held = False
    assert final_tokens(collect(generation, [request_id])[request_id]) == expected
    held.held = True
    params = run(context, greedy(prompt, request_type="context_only"))[-1].result.context_phase_params
    request_id = generation.enqueue_request(greedy(prompt, request_type="generation_only", context_phase_params=params))
    assert wait_until(lambda: generation.disagg.num_importing == 1)
    generation.cancel_request(request_id)
    assert collect(generation, [request_id])[request_id][-1].result.is_final
    assert generation.blocks.num_free_blocks < generation.blocks.num_blocks and context.disagg.num_pinned_blocks > 0
    held.held = False
    assert wait_until(lambda: all_free(context)) and wait_until(lambda: all_free(generation))
    if transport != "local":
        assert generation.disagg.ipc.chosen["cuda_ipc"] == chosen + 2
        assert not [f for f in tmp_path.iterdir() if f.suffix != ".ipc"]  # (.ipc: the pool's share, on CUDA)
