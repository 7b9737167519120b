"""Model-free helpers for executor unit tests: sequences without an engine, a fake model step."""
from __future__ import annotations

import subprocess
import time

from engine.executor.request import Request, RequestState, SamplingConfig, Sequence
from engine.executor.scheduler import Scheduler, SchedulerOutput

_next_id = iter(range(1, 10**9))


def wait_until(predicate, timeout: float = 5.0) -> bool:
    """Poll ``predicate`` (another thread or process frees something) until true or ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def dead_pid() -> int:
    """The pid of a process of this host that has exited (what kv_peer.gone detects)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def make_seq(token_ids: list[int], max_tokens: int = 4, **sampling) -> Sequence:
    request_id = next(_next_id)
    state = RequestState(request_id, Request(list(token_ids), max_tokens, sampling=SamplingConfig(**sampling)), False)
    seq = Sequence(request_id, state, sequence_index=0)
    state.sequences.append(seq)
    return seq


def fake_update(scheduler: Scheduler, out: SchedulerOutput, next_token: int = 7) -> list[Sequence]:
    """What the executor does after a forward, with a constant 'model': returns finished sequences."""
    finished = []
    for item in out.scheduled:
        seq = item.seq
        samples = item.samples
        seq.num_computed_tokens += item.num_new_tokens
        scheduler.blocks.register_computed_blocks(seq)
        if samples:
            seq.token_ids.append(next_token)
            if seq.num_generated_tokens >= seq.state.request.max_tokens:
                scheduler.finish(seq)
                finished.append(seq)
    return finished


def collect(executor, request_ids: list[int], timeout: float = 60.0, streams: dict[int, int] | None = None) -> dict[int, list]:
    """Every response of ``request_ids`` until each has its final one (final = error or last stream ended)."""
    import time

    responses: dict[int, list] = {i: [] for i in request_ids}
    open_streams: dict[int, set] = {}
    deadline = time.monotonic() + timeout
    pending = set(request_ids)
    while pending:
        assert time.monotonic() < deadline, f"requests {sorted(pending)} got no final response in {timeout}s"
        for response in executor.await_responses(timeout=0.5):
            if response.request_id not in responses:
                continue
            responses[response.request_id].append(response)
            if response.error is not None:
                pending.discard(response.request_id)
            elif response.result.is_final:
                open_streams.setdefault(response.request_id, set()).add(response.result.sequence_index)
                if len(open_streams[response.request_id]) >= (streams or {}).get(response.request_id, 1):
                    pending.discard(response.request_id)
    return responses


def final_tokens(responses: list) -> list[int]:
    """Generated tokens of a single-stream request: concatenated streaming deltas or the final result."""
    assert responses and responses[-1].error is None, responses[-1].error if responses else "no response"
    return [t for r in responses for t in r.result.output_token_ids[0]]



def generated_ids(engine: str, requests: list, config, device: str | None = None) -> list[list[int]]:
    """Each request's generated tokens, all enqueued together on one Executor(engine, config, device)."""
    from engine.executor import Executor

    with Executor(engine, config, device=device) as executor:
        request_ids = executor.enqueue_requests(requests)
        responses = collect(executor, request_ids)
    return [final_tokens(responses[i]) for i in request_ids]


def served_table_ids(engine: str, prepared: dict, table, max_tokens: int) -> list[int]:
    """Greedy ids of one request as tensorrt_llm serves it: preprocessing's INPUT_ID / REQUEST_INPUT_LEN
    (``prepared``) and multimodal_encoders' table (rows, hidden) -> convert_request -> the executor."""
    import numpy as np

    from engine.executor import Executor, ExecutorConfig
    from serving.requests import convert_request, to_executor_request

    tensors = {"input_ids": prepared["INPUT_ID"], "input_lengths": prepared["REQUEST_INPUT_LEN"],
               "request_output_len": np.array([[max_tokens]], np.int32), "prompt_embedding_table": table[None]}
    [spec] = convert_request(tensors, decoupled=False, exclude_input_default=True)
    with Executor(engine, ExecutorConfig()) as executor:
        [request_id] = executor.enqueue_requests([to_executor_request(spec)])
        return final_tokens(collect(executor, [request_id])[request_id])


def assert_cancels_free_cross_pool(executor, encoder_ids: list[int]) -> None:
    """Encoder-decoder executors: two long streamed requests over ``encoder_ids``, cancelled once one
    holds cross blocks (mid-decode); then every cross block is back in the pool and none is held."""
    import time

    stage = executor.encoder_stage
    long = [executor.enqueue_request(Request([], 40, encoder_input_ids=encoder_ids, streaming=True)) for _ in range(2)]
    deadline = time.monotonic() + 30
    while not stage.held and time.monotonic() < deadline:
        time.sleep(0.01)
    for request_id in long:
        executor.cancel_request(request_id)
    collect(executor, long)
    deadline = time.monotonic() + 10
    while (len(stage.free_blocks) < stage.num_blocks or stage.pending) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(stage.free_blocks) == list(range(stage.num_blocks)) and not stage.held
