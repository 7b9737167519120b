"""Model-free helpers for executor unit tests: sequences without an engine, a fake model step."""
from __future__ import annotations

from engine.executor.request import Request, RequestState, SamplingConfig, Sequence
from engine.executor.scheduler import Scheduler, SchedulerOutput

_next_id = iter(range(1, 10**9))


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
