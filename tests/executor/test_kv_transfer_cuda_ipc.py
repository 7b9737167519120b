"""The cuda_ipc transport and the auto choice (engine/executor/kv_transfer_cuda_ipc.py).

CPU: the offer's life as files (pending -> offered -> claimed -> released; expiry; a claimer that died), the
generation side's claim (IpcPull with a fake copy), the choice and the named refusals. The auto transport's
served path on CPU (offer -> shm) runs in test_disaggregated.py's parametrized tests.
GPU (gpu mark): a context engine process on cuda:0 and a generation executor here on cuda:1 (cuda:0 on one
GPU): the KV pulled through CUDA IPC gives the aggregated greedy ids, auto chooses cuda_ipc, no block stays
used on either side."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine.executor import Executor, ExecutorConfig
from engine.executor import kv_peer, kv_transfer_nixl
from engine.executor import kv_transfer_cuda_ipc as ipc
from engine.executor.context_phase import decode, encode
from engine.executor.engine_process import EngineProcess
from engine.executor.request import Request, SamplingConfig
from tests.executor.executor_testing import collect, dead_pid, final_tokens, wait_until

PROMPTS = [[(11 * i + 3 * j + 2) % 128 for j in range(n)] for i, n in enumerate((5, 13, 17))]
CONFIG = ExecutorConfig(max_tokens_in_paged_kv_cache=256)


class _Ready:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


class _CopyDone:
    """A finished kv_pull.Pull."""
    def done(self):
        return True

    def elapsed_ms(self):
        return 1.0

    def order_before(self):
        pass


def test_an_offer_lives_as_files_and_a_claim_is_one_shot(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    path = ipc.offer_path("ab" * 16, 7)
    ready = _Ready()
    offer = ipc.Offer(path, ready, deadline=100.0, timeout_s=50.0)
    assert os.path.exists(f"{path}.pending") and offer.advance(ready, 1.0) == "pinned"
    started = []
    pull = ipc.IpcPull(path, lambda: started.append(1) or _CopyDone(), deadline=1e12, cancelled=lambda: False)
    assert not pull.done() and not started  # (a pending offer: its prefill is still on the context GPU)
    ready.done = True
    assert offer.changed(ready, 1.0) and offer.advance(ready, 1.0) == "pinned" and os.path.exists(path)
    assert pull.done() and pull.error is None and started == [1]  # claimed, copied, released
    assert offer.advance(ready, 2.0) == "released" and not os.listdir(tmp_path)
    again = ipc.IpcPull(path, lambda: _CopyDone(), deadline=1e12, cancelled=lambda: False)
    assert again.done() and "KV cache is gone" in again.error

    # expiry takes the offer back (no late claim), and a claimer that died is noticed
    offer = ipc.Offer(path, None, deadline=100.0, timeout_s=50.0)
    assert offer.advance(None, 100.0) == "expired" and not os.listdir(tmp_path)
    offer = ipc.Offer(path, None, deadline=100.0, timeout_s=50.0)
    os.rename(path, f"{path}.ipc")
    with open(f"{path}.ipc", "w") as f:
        json.dump({**kv_peer.identity(), "pid": dead_pid()}, f)
    assert offer.advance(None, 1.0) == "released" and not os.listdir(tmp_path)
    offer = ipc.Offer(path, None, deadline=100.0, timeout_s=50.0)
    cancelled = ipc.IpcPull(path, lambda: pytest.fail("copied for a cancelled request"), 1e12, lambda: True)
    assert cancelled.done() and cancelled.error is None  # taken and given back at once
    assert offer.advance(None, 1.0) == "released" and not os.listdir(tmp_path)
    ready = _Ready()  # ... also when it was cancelled while its offer was still pending
    offer = ipc.Offer(path, ready, deadline=100.0, timeout_s=50.0)
    cancelled = ipc.IpcPull(path, lambda: pytest.fail("copied for a cancelled request"), 1e12, lambda: True)
    assert not cancelled.done()
    ready.done = True
    assert offer.advance(ready, 1.0) == "pinned" and cancelled.done() and cancelled.error is None
    assert offer.advance(ready, 1.0) == "released" and not os.listdir(tmp_path)


def test_a_claimer_is_looked_at_every_check_interval_also_when_its_claim_was_read_empty(tmp_path, monkeypatch):
    """The context loop polls a claimed offer every POLL_S (a stat of its claim file) but reads the claimer's /proc
    only every kv_peer.CHECK_S; a claim file read before its claimer wrote its identity is read again then."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    monkeypatch.setattr(kv_peer, "CHECK_S", 3600.0)  # (no look falls due during the test but the ones it forces)
    path = ipc.offer_path("12" * 16, 4)
    offer = ipc.Offer(path, None, deadline=100.0, timeout_s=50.0)
    os.rename(path, f"{path}.ipc")
    open(f"{path}.ipc", "w").close()  # (claimed; its identity not written yet)
    assert offer.advance(None, 1.0) == "claimed" and not offer.changed(None, 1.0)  # (looked: no wake-up till next)
    with open(f"{path}.ipc", "w") as f:
        json.dump({**kv_peer.identity(), "pid": dead_pid()}, f)
    assert offer.advance(None, 1.0) == "claimed"  # (the next look is CHECK_S away)
    offer.claimer.next_check = 0.0  # (CHECK_S later)
    assert offer.changed(None, 1.0) and offer.advance(None, 1.0) == "released" and not os.listdir(tmp_path)


def test_an_offer_claimed_for_shm_waits_for_the_context_side(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    path = ipc.offer_path("cd" * 16, 3)
    offer = ipc.Offer(path, None, deadline=100.0, timeout_s=50.0)
    os.rename(path, f"{path}.shm")  # (what claim_for_shm does first)
    assert offer.advance(None, 1.0) == "shm"
    offer.shm_started()
    assert ipc.claim_for_shm(path, 0.05) is None  # (its marker is gone and no offer is left: gone)
    assert not os.listdir(tmp_path)


def test_a_claim_that_races_the_offer_becoming_claimable_claims_it(tmp_path, monkeypatch):
    """The context loop renames <offer>.pending to <offer> between a claimer's failed rename and its look for
    .pending: the claimer tries again (it took the KV for gone and failed the request)."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    rename = os.rename

    def racing(src, dst):  # (the context loop's rename lands just after this claimer's found nothing)
        if src.endswith(".offer") and os.path.exists(f"{src}.pending"):
            rename(f"{src}.pending", src)
            raise FileNotFoundError(src)
        rename(src, dst)

    monkeypatch.setattr(ipc.os, "rename", racing)
    path, started = ipc.offer_path("ef" * 16, 5), []
    ipc.Offer(path, _Ready(), deadline=100.0, timeout_s=50.0)
    pull = ipc.IpcPull(path, lambda: started.append(1) or _CopyDone(), deadline=1e12, cancelled=lambda: False)
    assert not pull.done() and pull.error is None
    assert pull.done() and pull.error is None and started == [1]
    path = ipc.offer_path("ef" * 16, 6)
    ipc.Offer(path, _Ready(), deadline=100.0, timeout_s=50.0)
    monkeypatch.setattr(ipc.time, "sleep", lambda s: ipc._take(f"{path}.shm"))  # (the context side's shm_started)
    assert ipc.claim_for_shm(path, 5.0) == ipc.shm_path(path)


@pytest.fixture(scope="module")
def cpu_pair(tiny_engine):
    """(context, generation) executors of this process on the CPU (also where CUDA is there)."""
    with Executor(tiny_engine, CONFIG, device="cpu") as context, Executor(tiny_engine, CONFIG, device="cpu") as generation:
        yield context, generation


def _free(ex) -> bool:
    return ex.disagg.num_pinned_blocks == 0 and ex.disagg.num_importing == 0 and \
        ex.blocks.num_free_blocks == ex.blocks.num_blocks


def test_the_choice_and_the_refusals_are_named(cpu_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    context, generation = cpu_pair
    error = _run(context, Request(PROMPTS[0], 4, request_type="context_only", kv_transfer="cuda_ipc")).error
    assert error == "kv_transfer 'cuda_ipc' needs the context executor's KV pool on a CUDA device"
    with pytest.raises(ValueError, match="TRITONLLM_KV_TRANSFER: kv_transfer 'cuda_ipc' needs"):
        type(context.disagg)(context, transport="cuda_ipc")
    params = _run(context, Request(PROMPTS[1], 4, request_type="context_only", kv_transfer="auto")).result \
        .context_phase_params
    fields = decode(params)
    assert fields["transport"] == "auto" and "ipc" not in fields and "agent" not in fields
    assert context.disagg.num_pinned_blocks > 0
    cases = {
        encode({**fields, "host": "another-boot"}): "the context side runs on another host",
        encode({**fields, "transport": "cuda_ipc"}):
            "kv_transfer 'cuda_ipc' cannot be served here: the context executor is in this process",
        encode({**fields, "offer": "/etc/passwd"}): "truncated or corrupted blob (offer, host, ipc, block_ids)",
        encode({**fields, "handle": fields["handle"] + 1}): "truncated or corrupted blob (offer, host, ipc, block_ids)",
        encode({**fields, "block_ids": fields["block_ids"][:-1]}): "block ids for a 13-token prompt",
    }
    for blob, message in cases.items():
        response = _run(generation, Request(PROMPTS[1], 4, request_type="generation_only", context_phase_params=blob))
        assert message in response.error, response.error
    shm = generation.disagg.ipc.chosen.get("shm", 0)
    good = _run(generation, Request(PROMPTS[1], 4, request_type="generation_only", context_phase_params=params))
    assert good.error is None and generation.disagg.ipc.chosen["shm"] == shm + 1
    assert wait_until(lambda: _free(context) and _free(generation) and not os.listdir(tmp_path))


@pytest.mark.skipif(not kv_transfer_nixl.available(), reason="NIXL is not installed (scripts/setup_env.sh)")
def test_an_auto_blob_from_another_host_goes_through_nixl_where_the_context_side_offers_it(cpu_pair, tmp_path,
                                                                                           monkeypatch):
    """TRITONLLM_KV_TRANSFER_AUTO_NIXL=1 on the context side: an auto blob also carries NIXL's fields, and a
    generation side on another host (faked: another boot id) READs it through NIXL; the NIXL claim takes the
    offer file, the pin is freed after the READ. Without it, another host's auto blob is refused by name."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    context, generation = cpu_pair
    prompt = PROMPTS[2]
    expected = final_tokens(_all(generation, _greedy(prompt)))
    bare = _run(context, _greedy(prompt, request_type="context_only", kv_transfer="auto")).result.context_phase_params
    monkeypatch.setenv(ipc.AUTO_NIXL_ENV, "1")
    params = _run(context, _greedy(prompt, request_type="context_only", kv_transfer="auto")).result.context_phase_params
    assert "agent" in decode(params) and "agent" not in decode(bare)
    host = ipc.host_id()
    monkeypatch.setattr(ipc, "host_id", lambda: "another-boot")  # (what the generation side compares the blob with)
    refused = _run(generation, _greedy(prompt, request_type="generation_only", context_phase_params=bare)).error
    assert "the context side runs on another host" in refused and ipc.AUTO_NIXL_ENV in refused
    got = _all(generation, _greedy(prompt, request_type="generation_only", context_phase_params=params))
    assert got[-1].error is None, got[-1].error
    assert final_tokens(got) == expected and generation.disagg.ipc.chosen["nixl"] == 1
    monkeypatch.setattr(ipc, "host_id", lambda: host)
    again = _run(generation, _greedy(prompt, request_type="generation_only", context_phase_params=params))
    assert "KV cache is gone" in again.error  # (the offer went with the NIXL claim: no second fetch through shm)
    assert final_tokens(_all(generation, _greedy(prompt, request_type="generation_only", context_phase_params=bare))) \
        == expected  # (the bare blob, on this host: shm)
    assert wait_until(lambda: _free(context) and _free(generation) and not os.listdir(tmp_path))


def test_an_offer_whose_files_fail_fails_no_other_request(cpu_pair, tmp_path, monkeypatch):
    """An I/O error reading an offer's files (a transfer directory gone read-only) is that pin's alone: the context
    loop keeps serving (it raised out of service() and failed every active request, every step)."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    context, generation = cpu_pair
    advance = ipc.Offer.advance

    def failing(self, ready, now):
        raise PermissionError(13, "Permission denied", self.path)

    monkeypatch.setattr(ipc.Offer, "advance", failing)
    params = _run(context, _greedy(PROMPTS[0], request_type="context_only", kv_transfer="auto")).result \
        .context_phase_params
    served = _all(context, _greedy(PROMPTS[1]))
    assert served[-1].error is None and final_tokens(served)
    monkeypatch.setattr(ipc.Offer, "advance", advance)
    fetched = _run(generation, _greedy(PROMPTS[0], request_type="generation_only", context_phase_params=params))
    assert fetched.error is None, fetched.error
    assert wait_until(lambda: _free(context) and _free(generation) and not os.listdir(tmp_path))


def _run(ex, request: Request):
    request_id = ex.enqueue_request(request)
    return collect(ex, [request_id])[request_id][-1]


# ----- GPU: two processes -----
def _devices() -> tuple[str, str]:
    if os.environ.get("TRITONLLM_DISAGG_DEVICES"):
        context, generation = os.environ["TRITONLLM_DISAGG_DEVICES"].split(",")
        return context, generation
    return "cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


@pytest.fixture(scope="module")
def gpu_sides(tiny_engine):
    context_device, generation_device = _devices()
    context = EngineProcess(tiny_engine, CONFIG, device=context_device)
    try:
        with Executor(tiny_engine, CONFIG, device=generation_device) as generation:
            yield context, generation
    finally:
        context.shutdown()


def _greedy(prompt, **kw) -> Request:
    return Request(list(prompt), 6, sampling=SamplingConfig(top_k=1), **kw)


def _all(ex, request: Request) -> list:
    request_id = ex.enqueue_request(request)
    return collect(ex, [request_id])[request_id]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC: GPU only")
@pytest.mark.parametrize("transfer", ["cuda_ipc", "auto"])
def test_a_context_process_gpu_to_gpu_equals_aggregated_and_frees_both_sides(gpu_sides, transfer):
    context, generation = gpu_sides
    before = generation.disagg.ipc.chosen.get("cuda_ipc", 0)
    for prompt in PROMPTS:
        aggregated = final_tokens(_all(generation, _greedy(prompt)))
        exported = _all(context, _greedy(prompt, request_type="context_only", kv_transfer=transfer))
        assert exported[-1].error is None, exported[-1].error
        params = exported[-1].result.context_phase_params
        fields = decode(params)
        assert fields["transport"] == transfer and "ipc" in fields and len(params) < 2048
        responses = _all(generation, _greedy(prompt, request_type="generation_only", context_phase_params=params))
        assert responses[-1].error is None, responses[-1].error
        assert final_tokens(responses) == aggregated
    assert generation.disagg.ipc.chosen.get("cuda_ipc", 0) == before + len(PROMPTS), generation.disagg.ipc.why
    assert wait_until(lambda: generation.disagg.num_importing == 0
                      and generation.blocks.num_free_blocks == generation.blocks.num_blocks)
    assert wait_until(lambda: context.get_latest_iteration_stats().kv_cache_stats.used_num_blocks == 0)
    again = _all(generation, _greedy(PROMPTS[-1], request_type="generation_only", context_phase_params=params))
    assert "KV cache is gone" in again[-1].error  # one fetch per blob
    assert generation.blocks.num_free_blocks == generation.blocks.num_blocks
