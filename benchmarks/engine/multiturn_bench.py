#!/usr/bin/env python3
"""Multi-turn chat through the in-process executor: what the prefix cache buys.

    python benchmarks/engine/multiturn_bench.py --model llama8b [--conversations 64 --turns 6 --system_len 1500]
        [--user_len 60 --output_len 64] [--reuse on,off,host] [--working_set_over_gpu_pool 2]
        [--kv-cache-host-memory-bytes N] [--out multiturn.json]

``--conversations`` conversations share one ``--system_len``-token system prompt; each runs
``--turns`` turns in a closed loop: its next request is sent when the previous answer is complete,
and carries the whole history (system prompt, every earlier user message and answer) plus a new
``--user_len``-token user message; the answer is exactly ``--output_len`` tokens (end_id -1), or,
with ``--vary_output_len``, a length drawn per turn from [output_len / 2, 3 * output_len / 2] (the
same draws for every setting). Why the option: with equal answer lengths the conversations stay in
lockstep when the prefix cache makes their prompts cheap, so every turn's requests arrive together
and queue behind one another's prefills; varied answers spread the arrivals as real chats do.
Streaming, so the time to first token (enqueue to the first streamed token) is the client's. Token
ids are random (a random-weight engine of ``--model``'s shape, made on the device at load; see
benchmarks/common.py MODELS), the same for every setting.

For each ``--reuse`` setting one executor runs the whole load: ``off`` and ``on`` are the executor's
``enable_kv_cache_reuse``; ``host`` is reuse plus the KV host tier (``kv_cache_host_memory_bytes``:
``--kv-cache-host-memory-bytes``, by default room for the whole working set), which keeps reusable
blocks evicted from the device pool in pinned host memory and brings them back on a prefix hit.
Reported: TTFT p50/p90/p99 over all turns and per turn, the KV hit rate (prompt blocks taken from
the prefix cache over all prompt blocks, from each request's perf metrics:
``kv_cache_reused_blocks`` / ``kv_cache_alloc_total_blocks``; an onboarded block counts as reused),
the same rate from the executor's cumulative counters (what ``tritonllm_kv_cache_blocks_total``
publishes: (reused + host) / (reused + host + new)), the blocks onboarded from and offloaded to host
memory, output tokens/s and wall time.

The working set is the KV of every conversation's final history, the shared system prompt once:
``system_len + conversations * turns * (user_len + output_len)`` tokens. ``--working_set_over_gpu_pool
R`` sizes the device pool (``max_tokens_in_paged_kv_cache``) to 1/R of it (never below the longest
request), so that with R = 2 half of what the conversations could reuse fits on the device: the
setting in which the host tier matters. Unset, the pool takes 90% of the free device memory.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (MODELS, add_model_arguments, free_device_memory, percentile,  # noqa: E402
                               write_config_only_engine)


TOKENS_PER_BLOCK = 32


def working_set_tokens(args) -> int:
    """Tokens of KV the conversations could reuse: every final history, the system prompt once."""
    return args.system_len + args.conversations * args.turns * (args.user_len + args.output_len)


def longest_request_tokens(args) -> int:
    """Prompt + answer of a conversation's last turn: a device pool must hold at least this."""
    longest_answer = args.output_len * 3 // 2 if getattr(args, "vary_output_len", False) else args.output_len
    return args.system_len + args.turns * (args.user_len + longest_answer)


def kv_block_bytes(engine_dir: str) -> int:
    """Bytes of one KV block of the engine's pool (every layer's K and V, the engine's dtype)."""
    import torch

    from engine.config import EngineConfig

    config = EngineConfig.load(engine_dir)
    model, build = config.model, config.build
    element = torch.empty((), dtype=getattr(torch, build.dtype)).element_size()
    return model.num_layers * 2 * build.tokens_per_block * model.num_kv_heads * model.head_dim * element


def run_conversations(executor, vocab: int, args) -> dict:
    """The closed loop of the module docstring on one executor -> its measurements."""
    from engine.executor.request import OutputConfig, Request

    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(args.system_len)]
    histories = {c: list(system) for c in range(args.conversations)}
    # One generator a conversation: its user messages do not depend on the order answers finish in.
    user_rngs = {c: random.Random(c + 1) for c in histories}
    length_rngs = {c: random.Random(10_000 + c) for c in histories}

    def answer_length(conversation: int) -> int:
        if not getattr(args, "vary_output_len", False):
            return args.output_len
        return length_rngs[conversation].randint(max(1, args.output_len // 2), args.output_len * 3 // 2)
    turn_of = dict.fromkeys(histories, 0)
    in_flight: dict[int, dict] = {}  # request id -> {conversation, sent_ns, first_ns, tokens, perf}
    ttft_ms: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    reused = total_blocks = output_tokens = 0

    def send(conversation: int) -> None:
        history = histories[conversation]
        history += [user_rngs[conversation].randrange(vocab) for _ in range(args.user_len)]
        request = Request(input_token_ids=list(history), max_tokens=answer_length(conversation), end_id=-1,
                          streaming=True,
                          output=OutputConfig(exclude_input_from_output=True, return_perf_metrics=True))
        (request_id,) = executor.enqueue_requests([request])
        in_flight[request_id] = {"conversation": conversation, "sent_ns": time.perf_counter_ns(), "first_ns": None,
                                 "tokens": []}

    started = time.perf_counter()
    for conversation in histories:
        send(conversation)
    while in_flight:
        for response in executor.await_responses(timeout=1.0):
            if response.error:
                raise RuntimeError(f"request {response.request_id} failed: {response.error}")
            state = in_flight[response.request_id]
            tokens = response.result.output_token_ids[0]
            if tokens and state["first_ns"] is None:
                state["first_ns"] = time.perf_counter_ns()
            state["tokens"] += tokens
            if not response.result.is_final:
                continue
            del in_flight[response.request_id]
            conversation = state["conversation"]
            ttft_ms[turn_of[conversation]].append((state["first_ns"] - state["sent_ns"]) / 1e6)
            perf = response.result.perf
            if perf is not None:
                reused += perf.kv_cache_reused_blocks
                total_blocks += perf.kv_cache_alloc_total_blocks
            output_tokens += len(state["tokens"])
            histories[conversation] += state["tokens"]
            turn_of[conversation] += 1
            if turn_of[conversation] < args.turns:
                send(conversation)
    elapsed = time.perf_counter() - started
    every = [t for turn in ttft_ms.values() for t in turn]
    kv = executor.get_latest_iteration_stats().kv_cache_stats  # cumulative counters of the pool
    counted = kv.reused_blocks + kv.alloc_new_blocks
    return {"seconds": elapsed, "output_tok_s": output_tokens / elapsed,
            "ttft_ms": {"p50": percentile(every, 50), "p90": percentile(every, 90), "p99": percentile(every, 99)},
            "ttft_ms_median_by_turn": [statistics.median(ttft_ms[t]) for t in range(args.turns)],
            "kv_hit_rate": reused / total_blocks if total_blocks else 0.0,
            "reused_blocks": reused, "prompt_blocks": total_blocks,
            "counter_hit_rate": kv.reused_blocks / counted if counted else 0.0,
            "onboarded_blocks": kv.onboarded_blocks, "offloaded_blocks": kv.offloaded_blocks,
            "gpu_pool_blocks": kv.max_num_blocks, "host_tier_blocks": kv.max_num_host_blocks,
            "conversations": [histories[c] for c in sorted(histories)]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system_len", type=int, default=1500)
    parser.add_argument("--user_len", type=int, default=60)
    parser.add_argument("--output_len", type=int, default=64)
    parser.add_argument("--vary_output_len", action="store_true",
                        help="answer lengths drawn per turn from [output_len/2, 3*output_len/2] (module docstring)")
    parser.add_argument("--reuse", default="on,off",
                        help="comma list of off, on (the executor's enable_kv_cache_reuse) and host (reuse plus the "
                             "KV host tier)")
    parser.add_argument("--kv_cache_host_memory_bytes", "--kv-cache-host-memory-bytes", type=int, default=None,
                        help="the host tier's bytes in the 'host' setting (default: room for the whole working set)")
    parser.add_argument("--working_set_over_gpu_pool", "--working-set-over-gpu-pool", type=float, default=None,
                        help="size the device KV pool to the working set / this (2: the working set is twice the "
                             "pool); default: 90%% of the free device memory")
    parser.add_argument("--max_batch_size", type=int, default=64)
    parser.add_argument("--max_seq_len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from engine.executor.executor import Executor, ExecutorConfig

    engine_dir = write_config_only_engine(args.model, args.dtype, args.max_batch_size, args.max_seq_len, 8192,
                                          TOKENS_PER_BLOCK)
    vocab = MODELS[args.model]["vocab_size"]
    settings = args.reuse.split(",")
    unknown = set(settings) - {"on", "off", "host"}
    if unknown:
        parser.error(f"--reuse: unknown settings {sorted(unknown)}; allowed: on, off, host")
    pool_tokens = None
    if args.working_set_over_gpu_pool:
        pool_tokens = max(-(-working_set_tokens(args) // args.working_set_over_gpu_pool), longest_request_tokens(args))
        pool_tokens = int(pool_tokens)
    block_bytes = kv_block_bytes(engine_dir)
    host_bytes = args.kv_cache_host_memory_bytes
    if host_bytes is None:  # the whole working set (+ a block per conversation for partial tails)
        host_bytes = (-(-working_set_tokens(args) // TOKENS_PER_BLOCK) + args.conversations) * block_bytes
    results = {"args": vars(args), "working_set_tokens": working_set_tokens(args), "gpu_pool_tokens": pool_tokens,
               "kv_block_bytes": block_bytes, "runs": {}}
    for setting in settings:
        config = ExecutorConfig(enable_kv_cache_reuse=setting != "off", kv_cache_free_gpu_mem_fraction=0.9,
                                max_tokens_in_paged_kv_cache=pool_tokens,
                                kv_cache_host_memory_bytes=host_bytes if setting == "host" else 0)
        executor = Executor(engine_dir, config, device=args.device)
        try:
            run = run_conversations(executor, vocab, args)
        finally:
            executor.shutdown()
            # The next setting's executor sizes its KV pool from the free memory: this one's pool
            # and weights must be gone first (shutdown stops the loop, the references keep them).
            del executor
            free_device_memory(args.device)
        results["runs"][setting] = run
        print(f"reuse {setting}: TTFT p50 {run['ttft_ms']['p50']:.1f} ms, p99 {run['ttft_ms']['p99']:.1f} ms, "
              f"by turn {[round(t, 1) for t in run['ttft_ms_median_by_turn']]}, KV hit rate "
              f"{run['kv_hit_rate']:.1%} (counters {run['counter_hit_rate']:.1%}; {run['onboarded_blocks']} blocks "
              f"onboarded from host, {run['offloaded_blocks']} offloaded), {run['output_tok_s']:.0f} output tok/s, "
              f"{run['seconds']:.1f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**results, "runs": {k: {n: v for n, v in run.items() if n != "conversations"}
                                           for k, run in results["runs"].items()}}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
