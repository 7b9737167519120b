"""benchmarks/engine/engine_bench.py's batch-1 decode loops on the tiny CPU engine: the overlapped loop
(each step launched with its token a placeholder for the one the step before sampled on the device, as
the executor overlaps by default) decodes the same greedy tokens as the synchronous loop (each token read
on the host before the next step). Why it matters: the bench reports the overlapped step beside the
synchronous one to say what of a step the host adds (issue 55)."""
from __future__ import annotations

from engine.executor.runner import ModelRunner

from benchmarks.engine.engine_bench import decode_overlapped, decode_synchronous


def test_overlapped_decode_gives_the_synchronous_tokens(tiny_engine):
    runner = ModelRunner(tiny_engine)
    runner.allocate_kv_cache(16)
    page = runner.tokens_per_block
    table = list(range(1, 16))
    prompt = [5, 9, 2, 7, 11]
    runner.forward(decode_batch_of(prompt, page, table))
    first = 3
    tokens, times = decode_synchronous(runner, first, len(prompt), table, page, 6)
    again, overlapped_times = decode_overlapped(runner, first, len(prompt), table, page, 6)
    assert again == tokens and len(set(tokens)) > 1 and len(times) == 6 and len(overlapped_times) == 5


def decode_batch_of(prompt: list[int], page: int, table: list[int]):
    from engine.executor.runner import ForwardBatch

    n = len(prompt)
    return ForwardBatch(prompt, list(range(n)), [n], [n], [table[: -(-n // page)]], [n - 1])
