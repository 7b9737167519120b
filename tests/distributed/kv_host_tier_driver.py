"""Rank 0 of tests/distributed/test_kv_host_tier_tp.py: an Executor whose device KV pool is too
small for every conversation, so their prefixes go to the KV host tier and come back.

    python tests/distributed/kv_host_tier_driver.py --engine_dir DIR --out result.json \
        [--pool_tokens 96] [--host_bytes N] [--reuse on|off]

World size 1 or rank 0 of many (leader mode: every rank copies its shard of each block, through
the step plan). Writes JSON: ``histories`` (every conversation's tokens after the last turn),
``onboarded``/``offloaded`` (blocks), ``runner`` (ModelRunner or LeaderRunner) and ``comm_threads``
(gloo/TCPStore threads still running after the executor's shutdown).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.request import Request

PROMPTS = [[(k * 13 + 5 * c) % 96 for k in range(30)] for c in range(3)]


def converse(executor, prompts: list[list[int]], turns: int = 3, user_len: int = 6, output_len: int = 6):
    """One conversation at a time, each turn: history + a user message -> greedy answer appended."""
    histories = [list(p) for p in prompts]
    for turn in range(turns):
        for index, history in enumerate(histories):
            history += [(31 * turn + 7 * index + k) % 96 for k in range(user_len)]
            (request_id,) = executor.enqueue_requests([Request(list(history), output_len, end_id=-1)])
            final = None
            while final is None:
                for response in executor.await_responses(timeout=30.0):
                    if response.error:
                        raise RuntimeError(response.error)
                    if response.request_id == request_id and response.result.is_final:
                        final = response
            history[:] = final.result.output_token_ids[0]  # prompt + answer (input not excluded)
    return histories


def comm_threads() -> list[str]:
    """This process's gloo and TCPStore threads by name (Linux). After a leader's shutdown there are
    none: left running into interpreter finalization, one could abort a clean exit
    (engine/tensor_parallel/distributed.py _join_group_threads)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # ended meanwhile
            pass
    return sorted(name for name in names if "gloo" in name or "tcpstore" in name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pool_tokens", type=int, default=96)
    parser.add_argument("--host_bytes", type=int, default=1 << 20)
    parser.add_argument("--reuse", default="on")
    args = parser.parse_args()
    config = ExecutorConfig(max_tokens_in_paged_kv_cache=args.pool_tokens, enable_kv_cache_reuse=args.reuse == "on",
                            kv_cache_host_memory_bytes=args.host_bytes)
    with Executor(args.engine_dir, config, device="cpu") as executor:
        histories = converse(executor, PROMPTS)
        blocks = executor.blocks
        blocks.check_invariants()
        result = {"histories": histories, "onboarded": blocks.total_onboarded_blocks,
                  "offloaded": blocks.total_offloaded_blocks, "runner": type(executor.runner).__name__,
                  "leaked": blocks.num_used_blocks}
    result["comm_threads"] = comm_threads()
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
