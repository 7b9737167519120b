"""Rank 0 of the hybrid tensor-parallel executor test: an Executor (at world size 2 its runner is a
LeaderRunner, the other rank ``python -m engine.tensor_parallel.worker``) serves prompts of 5, 40
and 120 tokens together, with chunked context under a small token budget (prompt chunks and decodes
share steps), then cancels a long request mid-prompt.

    python tests/distributed/hybrid_executor_driver.py --engine_dir DIR --out result.json

Writes JSON: ``tokens`` (greedy ids per prompt length), ``slots_after`` (state slots in use once
every request has ended: 0).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "executor"))

from engine.executor.executor import Executor, ExecutorConfig  # noqa: E402
from engine.executor.request import Request  # noqa: E402
from executor_testing import collect, final_tokens  # noqa: E402

PROMPT_LENGTHS = (5, 40, 120)
NEW_TOKENS = 6


def prompt(n: int, vocab: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(1, vocab) for _ in range(n)]


def serve(engine_dir: str, vocab: int) -> dict:
    config = ExecutorConfig(enable_chunked_context=True, max_num_tokens=32, device="cpu")
    with Executor(engine_dir, config) as executor:
        ids = executor.enqueue_requests([Request(prompt(n, vocab), max_tokens=NEW_TOKENS) for n in PROMPT_LENGTHS])
        responses = collect(executor, ids)
        tokens = {n: final_tokens(responses[i])[-NEW_TOKENS:] for n, i in zip(PROMPT_LENGTHS, ids)}
        (cancelled,) = executor.enqueue_requests([Request(prompt(200, vocab), max_tokens=NEW_TOKENS)])
        while executor.state_slots.num_used == 0:
            time.sleep(0.01)
        executor.cancel_request(cancelled)
        collect(executor, [cancelled])
        deadline = time.monotonic() + 10
        while executor.state_slots.num_used and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"tokens": {str(n): t for n, t in tokens.items()}, "slots_after": executor.state_slots.num_used}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine_dir", required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = serve(args.engine_dir, args.vocab)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
