"""The nixl transport of disaggregated serving (engine/executor/kv_transfer_nixl.py) between two processes:
the context executor in an engine process, the generation executor here; the KV moves only through NIXL
(UCX), claimed and released by NIXL notifications. Greedy ids equal the aggregated request's, pins are
freed on both sides (also after a cancel while the transfer is pending), bad params are named.
Skipped when NIXL is not installed (scripts/setup_env.sh installs nixl-cu12; the GPU suite carries nixl-cu13)."""
from __future__ import annotations

import os
import time

import pytest
import torch

from engine.executor import Executor, ExecutorConfig
from engine.executor import kv_transfer_nixl
from engine.executor.context_phase import decode, encode
from engine.executor.engine_process import EngineProcess
from engine.executor.request import Request, SamplingConfig
from tests.executor.executor_testing import collect, dead_pid, final_tokens, wait_until

pytestmark = pytest.mark.skipif(not kv_transfer_nixl.available(),
                                reason="NIXL is not installed (scripts/setup_env.sh installs nixl-cu12)")

PROMPTS = [[(7 * i + 5 * j + 2) % 128 for j in range(n)] for i, n in enumerate((5, 13, 17))]
MAX_TOKENS = 6
CONFIG = ExecutorConfig(max_tokens_in_paged_kv_cache=256)


@pytest.fixture(scope="module")
def sides(tiny_engine):
    """(context engine process, generation executor of this process) on the same tiny engine.
    TRITONLLM_DISAGG_DEVICES=cuda:0,cuda:1 puts them on two GPUs (pools registered as VRAM)."""
    devices = os.environ.get("TRITONLLM_DISAGG_DEVICES", "").split(",") if os.environ.get("TRITONLLM_DISAGG_DEVICES") \
        else [None, None]
    context = EngineProcess(tiny_engine, CONFIG, device=devices[0])
    try:
        with Executor(tiny_engine, CONFIG, device=devices[1]) as generation:
            yield context, generation
    finally:
        context.shutdown()


def greedy(prompt, **kw) -> Request:
    return Request(list(prompt), MAX_TOKENS, sampling=SamplingConfig(top_k=1), **kw)


def run(ex, request: Request) -> list:
    request_id = ex.enqueue_request(request)
    return collect(ex, [request_id])[request_id]


def export(context, prompt) -> bytes:
    responses = run(context, greedy(prompt, request_type="context_only", kv_transfer="nixl"))
    assert responses[-1].error is None, responses[-1].error
    return responses[-1].result.context_phase_params


def context_free(context) -> bool:
    """No block used in the context process: a READ's "done" notification wakes its loop, which frees the pin
    (and refreshes the idle executor's pool stats)."""
    return context.get_latest_iteration_stats().kv_cache_stats.used_num_blocks == 0


def generation_free(generation) -> bool:
    return generation.disagg.num_importing == 0 and generation.blocks.num_free_blocks == generation.blocks.num_blocks


def test_context_process_then_generation_equals_aggregated_and_frees_both_sides(sides):
    context, generation = sides
    for prompt in PROMPTS:
        aggregated = final_tokens(run(generation, greedy(prompt)))
        params = export(context, prompt)
        fields = decode(params)
        assert fields["transport"] == "nixl" and len(params) < 2048  # metadata inline, small
        responses = run(generation, greedy(prompt, request_type="generation_only", context_phase_params=params))
        assert responses[-1].error is None, responses[-1].error
        assert final_tokens(responses) == aggregated
    assert wait_until(lambda: generation_free(generation)) and wait_until(lambda: context_free(context))
    # one fetch per blob: the context side answers a second claim "gone"
    again = run(generation, greedy(PROMPTS[-1], request_type="generation_only", context_phase_params=params))
    assert "KV cache is gone" in again[-1].error and generation_free(generation)


def test_a_cancel_while_the_transfer_is_pending_leaks_no_block(sides, monkeypatch):
    context, generation = sides
    held = {"on": True}
    real_done = kv_transfer_nixl.NixlPull.done
    monkeypatch.setattr(kv_transfer_nixl.NixlPull, "done", lambda self: not held["on"] and real_done(self))
    params = export(context, PROMPTS[2])
    request_id = generation.enqueue_request(greedy(PROMPTS[2], request_type="generation_only",
                                                   context_phase_params=params))
    assert wait_until(lambda: generation.disagg.num_importing == 1)
    generation.cancel_request(request_id)
    assert collect(generation, [request_id])[request_id][-1].is_final  # ends at once; the pull keeps its blocks
    assert generation.blocks.num_free_blocks < generation.blocks.num_blocks
    held["on"] = False
    assert wait_until(lambda: generation_free(generation)) and wait_until(lambda: context_free(context))


def test_bad_params_are_named(sides, monkeypatch):
    context, generation = sides
    params = export(context, PROMPTS[1])
    fields = decode(params)
    bad = encode({**fields, "block_ids": [10 ** 6] * len(fields["block_ids"])})
    error = run(generation, greedy(PROMPTS[1], request_type="generation_only", context_phase_params=bad))[-1].error
    assert error.startswith("context_phase_params: truncated or corrupted blob (pool, block_ids)")
    short = encode({**fields, "block_ids": fields["block_ids"][:-1]})
    error = run(generation, greedy(PROMPTS[1], request_type="generation_only", context_phase_params=short))[-1].error
    assert "block ids for a 13-token prompt" in error
    # the good blob still works (nothing was claimed), then the pin is gone on both sides
    good = run(generation, greedy(PROMPTS[1], request_type="generation_only", context_phase_params=params))
    assert good[-1].error is None
    assert wait_until(lambda: generation_free(generation)) and wait_until(lambda: context_free(context))
    monkeypatch.setattr(kv_transfer_nixl, "available", lambda: False)
    error = run(generation, greedy(PROMPTS[0], request_type="context_only", kv_transfer="nixl"))[-1].error
    assert error == kv_transfer_nixl.MISSING and error.startswith("kv_transfer 'nixl' needs NIXL (pip install")


def test_the_nixl_build_of_torchs_cuda_major_is_tried_first():
    """nixl-cu12 and nixl-cu13 differ in UCX's CUDA memory hooks, which link that major's libcudart: the other
    build's do not load next to torch's runtime (VRAM then registered as host: NIXL_ERR_BACKEND)."""
    assert kv_transfer_nixl.package_names("13.0") == ["nixl_cu13", "nixl_cu12", "nixl"]
    assert kv_transfer_nixl.package_names("12.8") == ["nixl_cu12", "nixl_cu13", "nixl"]
    assert kv_transfer_nixl.package_names(None) == ["nixl_cu12", "nixl_cu13", "nixl"]


def test_a_failing_nixl_call_fails_its_request_alone(sides, monkeypatch):
    """A NIXL call that raises (a READ NIXL refuses, a peer gone) ends that request with a named error, gives the
    pin back to the context side at once, and the generation loop (which polls pulls outside its error handling)
    keeps serving."""
    context, generation = sides

    def refused(self, fields, dst_ids):
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(kv_transfer_nixl.NixlSide, "read", refused)
    params = export(context, PROMPTS[0])
    error = run(generation, greedy(PROMPTS[0], request_type="generation_only", context_phase_params=params))[-1].error
    assert error.startswith("context_phase_params: the NIXL transfer of the context phase's KV failed") \
        and "NIXL_ERR_BACKEND" in error
    assert wait_until(lambda: generation_free(generation)) and wait_until(lambda: context_free(context))
    monkeypatch.undo()
    good = run(generation, greedy(PROMPTS[0], request_type="generation_only",
                                  context_phase_params=export(context, PROMPTS[0])))
    assert good[-1].error is None


def test_a_claim_nixl_cannot_answer_leaves_the_context_side_serving(sides):
    """A claim notification whose metadata NIXL cannot load (a foreign agent's) is dropped once: the pin stays
    for a real claim, and the context side's later steps do not fail on it (it was retried at every step)."""
    context, generation = sides
    params = export(context, PROMPTS[1])
    fields = decode(params)
    api = kv_transfer_nixl.load_api()
    stranger = api.nixl_agent("review16-stranger", api.nixl_agent_config(backends=["UCX"]))
    name = stranger.add_remote_agent(kv_transfer_nixl.unpack_metadata(fields["metadata"]))
    stranger.send_notif(name.decode() if isinstance(name, bytes) else name,
                        b"C" + int(fields["handle"]).to_bytes(8, "little") + b"not nixl metadata")
    again = run(context, greedy(PROMPTS[0], request_type="context_only", kv_transfer="nixl"))
    assert again[-1].error is None, again[-1].error
    good = run(generation, greedy(PROMPTS[1], request_type="generation_only", context_phase_params=params))
    assert good[-1].error is None, good[-1].error
    good = run(generation, greedy(PROMPTS[0], request_type="generation_only",
                                  context_phase_params=again[-1].result.context_phase_params))
    assert good[-1].error is None, good[-1].error
    assert wait_until(lambda: generation_free(generation)) and wait_until(lambda: context_free(context))


def test_an_export_nixl_cannot_describe_pins_no_block(sides, monkeypatch):
    """The context side's agent failing at export (here: describing its pool) leaves no block pinned."""
    _, ex = sides  # (this process's executor exports too)

    def broken(self):
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(kv_transfer_nixl.NixlSide, "describe", broken)
    error = run(ex, greedy(PROMPTS[0], request_type="context_only", kv_transfer="nixl"))[-1].error
    assert error.startswith("context_phase_params: exporting the context phase's KV (kv_transfer nixl) failed: "
                            "RuntimeError('NIXL_ERR_BACKEND')")
    assert wait_until(lambda: generation_free(ex) and ex.disagg.num_pinned_blocks == 0)


def test_a_read_nixl_cannot_cancel_keeps_its_blocks_out_of_the_pool(sides, monkeypatch):
    """check_xfer_state raising mid-READ: the READ's handle is released first (NIXL cancels it); when that raises
    too, UCX may still write the destination blocks: they are quarantined (never freed, counted in the stats), the
    request fails by name, the pin goes back and the generation loop serves on."""
    context, generation = sides
    api = kv_transfer_nixl.load_api()

    def broken(*args):
        raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")

    real_read = kv_transfer_nixl.NixlSide.read

    def read(self, fields, dst_ids):
        monkeypatch.setattr(self.agent, "check_xfer_state", broken)
        return real_read(self, fields, dst_ids)

    monkeypatch.setattr(kv_transfer_nixl.NixlSide, "read", read)
    monkeypatch.setattr(api.nixl_xfer_handle, "release", broken)
    params = export(context, PROMPTS[1])
    error = run(generation, greedy(PROMPTS[1], request_type="generation_only", context_phase_params=params))[-1].error
    assert error == "context_phase_params: the NIXL transfer of the context phase's KV failed: " \
                    "RuntimeError('NIXL_ERR_REMOTE_DISCONNECT')"
    quarantined = len(decode(params)["block_ids"])
    assert generation.disagg.imports.num_quarantined_blocks == quarantined
    assert generation.blocks.num_free_blocks == generation.blocks.num_blocks - quarantined
    assert wait_until(lambda: context_free(context))
    monkeypatch.undo()
    good = run(generation, greedy(PROMPTS[0], request_type="generation_only",
                                  context_phase_params=export(context, PROMPTS[0])))
    assert good[-1].error is None, good[-1].error
    assert generation.get_latest_iteration_stats().num_kv_blocks_quarantined == quarantined
    for pull in generation.disagg.imports._quarantined:  # (the READ ended long ago here: the module's pool back whole)
        pull._xfer.release()
        generation.blocks.free(pull.dst_ids)
    generation.disagg.imports._quarantined, generation.disagg.imports.num_quarantined_blocks = [], 0
    assert generation_free(generation)


def test_a_dead_or_silent_context_side_fails_the_claim_at_once(sides, monkeypatch):
    """Peer death, not the 60-s transfer timeout: a blob whose context process is gone (same host: its pid) fails
    at the first poll; an agent that never acknowledges the claim (another host, dead or unreachable) fails after
    ACK_TIMEOUT_S. The context side acknowledges a claim it cannot grant yet (its prefill still on the GPU)."""
    context, generation = sides
    monkeypatch.setattr(generation.disagg, "timeout_s", 10.0)
    monkeypatch.setattr(kv_transfer_nixl, "ACK_TIMEOUT_S", 0.5)
    fields = decode(export(context, PROMPTS[2]))
    pid = dead_pid()
    started = time.monotonic()
    dead = encode({**fields, "peer": {**fields["peer"], "pid": pid}})
    error = run(generation, greedy(PROMPTS[2], request_type="generation_only", context_phase_params=dead))[-1].error
    assert error == (f"context_phase_params: the context process (pid {pid}) that holds this KV cache is gone; "
                     f"run the context_only request again") and time.monotonic() - started < 2
    assert wait_until(lambda: context_free(context))  # (its claim was given back: the live process freed the pin)
    api = kv_transfer_nixl.load_api()
    silent = api.nixl_agent("disaggfix-silent", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    fields = decode(export(context, PROMPTS[2]))
    blob = encode({**fields, "agent": "disaggfix-silent",
                   "metadata": kv_transfer_nixl.pack_metadata(silent.get_agent_metadata())})
    started = time.monotonic()
    error = run(generation, greedy(PROMPTS[2], request_type="generation_only", context_phase_params=blob))[-1].error
    assert "did not acknowledge the claim of its KV cache within 0.5 s: its process is gone or unreachable" in error
    assert time.monotonic() - started < 5 and generation_free(generation)
    good = run(generation, greedy(PROMPTS[2], request_type="generation_only", context_phase_params=encode(fields)))
    assert good[-1].error is None, good[-1].error  # (the real pin, never claimed, frees the context side)
    # the acknowledgement itself, agent to agent: a claim seen, not grantable yet
    pool = torch.zeros(2, 2, 4, 4, 2, 8)
    a, b = kv_transfer_nixl.NixlSide(pool), kv_transfer_nixl.NixlSide(pool.clone())
    try:
        name = b.connect(a.metadata)
        b.claim(name, 7)
        assert wait_until(lambda: b.poll() + a.poll() >= 0 and a.claims, timeout=5)  # (polls progress both)
        a.answer(*a.claims[0], None)
        a.answer(*a.claims[0], None)  # (sent once per claim)
        assert wait_until(lambda: a.poll() + b.poll() >= 0 and (a.name, 7) in b.acks, timeout=5)
        b.acks.clear()
        for _ in range(5):
            time.sleep(0.01)
            a.poll(), b.poll()
        assert not b.acks and b.answers == {}
    finally:
        a.close()
        b.close()


class _Gate:
    """A ready event (kv_pull.ReadyEvents) that passes when ``open``: a prefill still on the GPU until then."""
    open = False

    def query(self) -> bool:
        return self.open


def test_a_claim_waiting_for_its_prefill_does_not_spin_the_context_loop(sides, monkeypatch):
    """Roles swapped (this process's executor exports, the engine process imports): while the prompt's KV is not
    final the claim is acknowledged and waits without a step per poll; once it is, the claim is granted at the
    next poll and the ids equal the aggregated request's."""
    context, ex = sides
    gate, steps, real_step = _Gate(), [], ex._step
    monkeypatch.setattr(ex.disagg.ready, "take", lambda request_id: gate)
    monkeypatch.setattr(ex, "_step", lambda *args: steps.append(1) or real_step(*args))
    prompt = PROMPTS[1]
    aggregated = final_tokens(run(ex, greedy(prompt)))
    params = run(ex, greedy(prompt, request_type="context_only", kv_transfer="nixl"))[-1].result.context_phase_params
    request_id = context.enqueue_request(greedy(prompt, request_type="generation_only", context_phase_params=params))
    assert wait_until(lambda: ex.disagg._nixl.acknowledged)
    steps.clear()
    time.sleep(0.3)
    assert len(steps) <= 3, f"{len(steps)} steps of an idle loop in 0.3 s"
    gate.open = True
    assert final_tokens(collect(context, [request_id])[request_id]) == aggregated
    assert wait_until(lambda: generation_free(ex) and ex.disagg.num_pinned_blocks == 0)
    assert wait_until(lambda: context_free(context)) and not ex.disagg._nixl.acknowledged


def test_shutdown_gives_back_a_claim_whose_read_has_not_started():
    """NixlPull.wait (executor shutdown): a pull granted (its READ waiting for the loop's step) or still claiming
    starts no READ and waits for nothing; its claim goes back to the context side at once."""

    class Side:
        answers, acks, sent = {}, set(), []

        def connect(self, metadata):
            return "context"

        def claim(self, agent, handle):
            self.sent.append(("claim", handle))

        def release(self, agent, handle):
            self.sent.append(("done", handle))

        def read(self, fields, dst_ids):
            raise AssertionError("a READ started at shutdown")

        def poll(self):
            return False

    side, fields = Side(), {"metadata": kv_transfer_nixl.pack_metadata(b"x"), "handle": 3}
    for granted in (True, False):
        side.sent.clear()
        pull = kv_transfer_nixl.NixlPull(side, fields, [1, 2], 60.0, lambda: False, after_step=_Gate())
        if granted:
            side.answers[("context", 3)] = True
            assert not pull.done() and pull._state == "granted"  # (the loop's step in flight not done yet)
        started = time.monotonic()
        pull.wait()
        assert time.monotonic() - started < 0.5 and side.sent == [("claim", 3), ("done", 3)] and pull.done()
