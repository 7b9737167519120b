"""Token-by-token streaming, and several tensorrt_llm instances relaying one engine process.

A Python-backend send is a synchronous round trip to the server and a stub must send from one
thread only (serving/shared_engine.py says why), so `tensorrt_llm` scales its relay with model
instances that share one engine. This server runs two (and, in an engine process of its own, a copy
with stream_interval=4 behind a copy of the ensemble, where that `extended` test runs). What must hold: a client that keeps up
gets one response per token (no coalescing), every stream arrives whole whichever instance holds
it, and a stop, or a hang-up reported by postprocessing, reaches the instance that holds the
request.
"""
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from test_grpc_stream import STOP, Stream, assert_idle, long_llm_request, text_inputs
from test_metrics import LLM, scrape, value
from triton_helpers import chat, running_server

pytestmark = pytest.mark.integration
ANSWER = "The capital of France is Paris."
# Long enough to be running when stopped, short enough that four fit the KV pool at once (a
# request waits for its whole KV reservation under guaranteed_no_evict).
RUNNING_TOKENS = 300


# stream_interval=4 is an engine (executor) setting: its own engine process, but not its own server.
# tensorrt_llm's copy with that setting and one instance, behind the ensemble's copy that names it.
INTERVAL_LLM, INTERVAL_ENSEMBLE = "tensorrt_llm_interval", "ensemble_interval"


def add_interval_models(repo) -> None:
    import re
    import shutil

    shutil.copytree(repo / "tensorrt_llm", repo / INTERVAL_LLM)
    config = repo / INTERVAL_LLM / "config.pbtxt"
    text = config.read_text().replace('name: "tensorrt_llm"', f'name: "{INTERVAL_LLM}"', 1)
    text, counts = re.subn(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+", r"\g<1>1", text)
    text, intervals = re.subn(r'(key: "stream_interval"\s*value: \{\s*string_value: )"[^"]*"', r'\g<1>"4"', text)
    assert counts == 1 and intervals == 1, (counts, intervals)
    config.write_text(text)
    shutil.copytree(repo / "ensemble", repo / INTERVAL_ENSEMBLE)
    config = repo / INTERVAL_ENSEMBLE / "config.pbtxt"
    text = config.read_text().replace('name: "ensemble"', f'name: "{INTERVAL_ENSEMBLE}"', 1)
    text, steps = re.subn(r'model_name: "tensorrt_llm"', f'model_name: "{INTERVAL_LLM}"', text)
    assert steps == 1, steps
    config.write_text(text)


# The stream-interval test (`extended`): its models are in the repository only where it runs.
INTERVAL_TEST = "test_stream_interval_groups_tokens_and_the_text_stays_whole"


@pytest.fixture(scope="module")
def two_instance_server(smollm2_engine_dir, tmp_path_factory, request):
    """tensorrt_llm with two instances sharing one engine process; beside them (a second engine
    process), where INTERVAL_TEST runs, the stream-interval models, so that test needs no server of its own."""
    interval = any(item.originalname == INTERVAL_TEST and getattr(item, "path", None) == request.node.path
                   for item in request.session.items)
    with running_server(smollm2_engine_dir, tmp_path_factory.mktemp("triton_2x"), tensorrt_llm_instances=2,
                        add_models=add_interval_models if interval else None) as server:
        yield server


def stream_counts(server) -> tuple[float, float, float]:
    """(streamed tokens, coalesced tokens, streamed responses) from the tensorrt_llm counters."""
    samples = scrape(server)
    return tuple(value(samples, name, **LLM) or 0.0 for name in (
        "tritonllm_streamed_tokens_total", "tritonllm_coalesced_tokens_total", "tritonllm_streamed_responses_total"))


def test_both_instances_serve_and_share_one_engine(two_instance_server):
    log = two_instance_server.log()
    assert "tensorrt_llm_0_0" in log and "tensorrt_llm_0_1" in log
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda _: ensemble_text(two_instance_server), range(6)))
    assert texts == [ANSWER] * 6


def test_triton_spreads_requests_over_both_instances(two_instance_server):
    """The request_key output names the instance that relays a request (its key range)."""
    from serving.shared_engine import KEY_STRIDE

    def instance_of_one_request(_):
        stream = Stream(two_instance_server)
        try:
            # 2 tokens (8 before): the first response names the instance, and execute() returns once the
            # request is enqueued, so how long it generates does not decide which instance gets the next.
            stream.send("tensorrt_llm", long_llm_request(max_tokens=2))
            items = stream.until_final()
        finally:
            stream.close()
        return int(items[0][0].as_numpy("request_key").reshape(-1)[0]) // KEY_STRIDE

    # Up to 3 rounds of 8 at once (one round may land on one instance), but no round after both showed.
    instances = []
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            instances += pool.map(instance_of_one_request, range(8))
            if set(instances) == {0, 1}:
                break
    assert set(instances) == {0, 1}, instances


def ensemble_text(server, model: str = "ensemble") -> str:
    stream = Stream(server)
    try:
        stream.send(model, text_inputs([chat("What is the capital of France?")], 24))
        items = stream.until_final()
    finally:
        stream.close()
    assert all(error is None for _, error, _ in items), [str(error) for _, error, _ in items if error]
    return "".join(r.as_numpy("text_output")[0].decode() for r, _, _ in items
                   if r.as_numpy("text_output") is not None)


def tokens_per_response(server, max_tokens: int, model: str = "tensorrt_llm") -> list[int]:
    """The tokens each response of one streamed tensorrt_llm request carried, in order."""
    stream = Stream(server)
    try:
        stream.send(model, long_llm_request(max_tokens=max_tokens))
        items = stream.until_final()
    finally:
        stream.close()
    assert all(error is None for _, error, _ in items), [str(error) for _, error, _ in items if error]
    return [int(r.as_numpy("sequence_length").reshape(-1)[0]) for r, _, _ in items]


# One instance (the session's server) is `extended` since 2026-12-01: the relay is the same code with one
# instance or two, and test_grpc_stream.py's incremental test holds one instance's streams to >= 5 pieces.
@pytest.mark.parametrize("server_name", [pytest.param("triton_server", marks=pytest.mark.extended),
                                         "two_instance_server"])
def test_one_response_per_token_when_the_client_keeps_up(server_name, request):
    server = request.getfixturevalue(server_name)  # one instance, or two sharing the engine
    # tensorrt_llm itself: every response but the (empty or last-token) final one carries one token.
    per_response = tokens_per_response(server, max_tokens=8)  # (was 16: 8 show the same, at half the steps)
    # One response per token. A stall of the stub on a loaded 2-core runner (seen once in a fresh-clone
    # CI run: the last two tokens in one response) may merge one pair; the relay batching tokens it
    # could send alone would merge many.
    assert sum(per_response) == 8 and sum(n == 1 for n in per_response) >= 6, per_response
    # Through the ensemble over gRPC: as many text responses as tokens, none coalesced (the
    # counters are published every stats_check_period_ms, 100 ms here: read them after 4).
    time.sleep(0.4)
    before = stream_counts(server)
    text = ensemble_text(server)
    time.sleep(0.4)
    tokens, coalesced, responses = (a - b for a, b in zip(stream_counts(server), before))
    assert text == ANSWER
    assert coalesced <= 2 and tokens > 5  # at most one merged pair, as above
    assert tokens - 1 <= responses <= tokens + 1  # one per token, and perhaps an empty final one


@pytest.mark.extended
def test_stream_interval_groups_tokens_and_the_text_stays_whole(two_instance_server):
    """stream_interval=4 (INTERVAL_LLM): the first token alone (time to first token is kept), then
    responses of at least 4 tokens (more only if the relay fell behind), the rest in the last one;
    the ensemble's streamed text is the same answer. 10 tokens: 1, 4, 4 and a rest of 1 (was 18).
    `extended` since 2026-12-01 (an engine process of its own and a stub in the server's start): in `make
    test`, tests/executor/test_executor_api.py holds the executor's stream_interval (the first token at once,
    then every n, a stop between sends) and tests/serving/test_executor_settings_and_bls.py the model's
    parameter to the executor's setting; the relay sends what the executor gives, as the other tests check."""
    per_response = [n for n in tokens_per_response(two_instance_server, 10, INTERVAL_LLM) if n]  # (an empty final)
    assert sum(per_response) == 10 and per_response[0] == 1, per_response
    assert all(n >= 4 for n in per_response[1:-1]) and len(per_response) <= 4, per_response
    assert ensemble_text(two_instance_server, INTERVAL_ENSEMBLE) == ANSWER


def test_stops_reach_the_instance_that_holds_the_request(two_instance_server):
    """Each stop lands on either instance; those landing on the other one go through the engine."""
    streams = [Stream(two_instance_server) for _ in range(4)]
    try:
        for i, stream in enumerate(streams):
            stream.send("tensorrt_llm", long_llm_request(RUNNING_TOKENS), request_id=f"relay-stop-{i}")
            assert stream.next()[1] is None
        for i, stream in enumerate(streams):
            stream.send("tensorrt_llm", STOP, request_id=f"relay-stop-{i}")
        for stream in streams:
            finals = 0
            while finals < 2:  # the generation's FINAL and the stop's FINAL, within the waits
                _, error, final = stream.next(timeout=30)
                assert error is None, error
                finals += final
    finally:
        for stream in streams:
            stream.close()
    assert_idle(two_instance_server)


def test_gone_ensemble_clients_are_stopped_on_either_instance(two_instance_server):
    """A cancelled ensemble stream is reported by postprocessing as a stop by request key; keys
    of the two instances never collide, and the stop finds the right one."""
    streams = [Stream(two_instance_server) for _ in range(4)]
    for stream in streams:
        stream.send("ensemble", text_inputs([chat("Write a long story about a lighthouse keeper.")],
                                            RUNNING_TOKENS, end_id=np.int32(-1)))
    for stream in streams:
        assert stream.next()[1] is None
    for stream in streams:
        stream.close(cancel=True)
    assert_idle(two_instance_server)


def test_a_killed_shared_engine_fails_every_call_at_once_and_the_model_comes_back(two_instance_server):
    """Last in this file: it restarts the model. test_engine_recovery.py's killed-engine case as `make serve`
    runs tritonserver (no mpirun), here with the engine shared by two instances: calls held by either
    instance, through every entry, fail within 2 s naming the engine process (only the instance that started
    it sees the SIGKILL to name: test_engine_recovery.py's mpirun case, one instance, checks it does); the instance
    that started the engine restarts the model with one fresh engine process in the same tritonserver,
    and it answers again (kill_the_engine_under_load says what is checked)."""
    from benchmarks.common import process_tree

    from test_engine_recovery import engine_pids, kill_the_engine_under_load
    from triton_helpers import wait_for

    server = two_instance_server
    interval_engines = len(engine_pids(server.pid)) - 1  # the interval model's (where it is served)
    kill_the_engine_under_load(server, lambda: llm_engine_pids(server), ready_within_s=90, signal_named=False)
    assert len(engine_pids(server.pid)) == 1 + interval_engines, process_tree(server.pid)  # the other kept running
    # (With two instances the old version's last instance may finish unloading just after the new
    # one is ready, and Triton then reloads the ensemble: wait for the first answer.)
    assert wait_for(lambda: answers(server), timeout=30, interval=0.5) == ANSWER
    assert value(scrape(server), "tritonllm_engine_restarts_total", **LLM) == 1


def llm_engine_pids(server) -> list[int]:
    """The engine processes a tensorrt_llm stub started (not the interval model's)."""
    from benchmarks.common import process_name
    from test_engine_recovery import engine_pids

    def parent(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return 0

    return [pid for pid in engine_pids(server.pid) if process_name(parent(pid)) == "stub:tensorrt_llm"]


def answers(server) -> str | None:
    try:
        return ensemble_text(server)
    except AssertionError:
        return None
