#!/usr/bin/env python3
"""TensorRT-LLM 1.0's offline throughput table, shape by shape, through the in-process executor (issue 32).

    python benchmarks/engine/throughput_bench.py [--shapes 128/128,2048/128] [--dtype fp8|bf16|both]
        [--num-requests-scale F | --waves W | --max-requests N | --max-seconds-per-shape S]
        [--max-batch-size 1024] [--max-num-tokens 8192] [--kv-fraction 0.95] [--max-seq-len shape|max|N]
        [--out throughput.json] [--markdown PATH]
    python benchmarks/engine/throughput_bench.py --tiny --shapes 128/128,2048/128 --max-requests 8   # CPU, seconds
    python benchmarks/engine/throughput_bench.py --report throughput.json [--markdown PATH]        # tables again

What runs, per ``--dtype`` (fp8: FP8 E4M3 linear weights and an FP8 KV pool, as TensorRT-LLM's
ModelOpt checkpoint runs; bf16: bfloat16 weights and pool) and per shape: a random-weight engine of
``--model``'s shape (Llama-3.1-8B by default; benchmarks/common.py's MODELS and write_config_only_engine), an Executor with
chunked context on (as a served model runs), ``--kv-fraction`` of the free device memory for the
KV pool (0.95 as TensorRT-LLM's tables; on an out-of-memory error 0.90, as their docs fall back),
no prefix reuse, CUDA graphs up to ``--max-batch-size``; ``max_seq_len`` = ISL + OSL per shape
(``--max-seq-len max``: one engine per dtype sized for the longest selected shape, which saves the
engine loads of a short run). Every request is enqueued at once (in chunks, so the loop starts
while the rest arrive), random prompt ids, exactly OSL output tokens (no end id), greedy.

Request counts: TensorRT-LLM's (30,000 for 128/128 ... 1,000 for 20000/2000) times
``--num-requests-scale``; or ``--waves W``: W times the batch the shape can hold (the smallest of
max batch size, the KV pool's room at ISL + OSL a request, and the prefill bound
max_num_tokens x OSL / (ISL + OSL)); capped by ``--max-requests`` and by
``--max-seconds-per-shape`` (at the rate issue 32 measured on an H100, bf16 at 0.6 of it, both
corrected by how the shapes before ran against it); ``--time-budget`` gives each remaining shape
its share of what is left (after ``--engine-seconds`` per engine still to load) and skips a shape
whose share is under 10 s.

Printed per shape, with trtllm-bench's names and definitions (tensorrt_llm/bench: wall time = first
arrival to last token; per-request TTFT = first token - arrival, TPOT = (last - first token) /
(OSL - 1); percentiles over requests):
- request throughput (req/s), total output throughput (tok/s), total token throughput, per-user
  output throughput (OSL / request latency, averaged) and per-user output speed (1/TPOT, averaged);
- TTFT and TPOT average / p50 / p90 / p99 (ms), request latency average;
- steady state: the batch (sequences scheduled in a step) while requests were still queued (the
  plateau), the share of wall time the batch sat at that plateau with requests waiting to refill
  it, the ramp-up and drain shares, the waves (requests / plateau), what bounds the plateau (max
  batch, KV pool, prefill budget) and the verdict: steady if that share >= ``--steady-threshold``;
- where the time went: steps carrying context (prefill chunks, decodes mixed in) vs pure decode
  steps (count, seconds, share of wall time; prefill tokens/s over the former), and the mean
  decode step at the batch bucket holding most decode time against that bucket's CUDA graph
  replayed alone with the step's mean batch, every row at the plateau's mean context (ISL + OSL / 2),
  over placeholder blocks of the idle pool (GPU only): the device floor of such a step.

A markdown table (stdout, and appended to ``--markdown``) carries TensorRT-LLM 1.0's FP8 figure per
shape and our ratio to it (bf16: n/a, none is published), with commit, GPU and date. ``--out``
(JSON) is rewritten after every shape, so a run cut short keeps what it measured; ``--report``
renders the tables from it (several files, comma-separated: one table, e.g. one run per dtype).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (MODELS, command_line, cuda_time_ms, device_name, free_device_memory,  # noqa: E402
                               git_commit, percentile, print_table, utc_now, write_config_only_engine)

# TensorRT-LLM performance overview v1.0 (NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md,
# stored commit 00f37686aa85; ../shared/reference/peers.md §2a): Llama-3.1-8B FP8
# (nvidia/Llama-3.1-8B-Instruct-FP8, FP8 KV), one H100 SXM, TP1, `trtllm-bench throughput`, PyTorch
# backend, CUDA graphs with padding; "Total Output Throughput (tokens/sec)" and the request count
# each row used. In the table's order. No bf16 figure is published.
TRT_LLM_SHAPES = [  # (ISL, OSL, requests, output tok/s)
    (128, 128, 30000, 28312),
    (128, 2048, 3000, 22714),
    (128, 4096, 1500, 14325),
    (500, 2000, 3000, 17660),
    (1000, 1000, 3000, 15220),
    (1000, 2000, 1500, 13899),
    (2048, 128, 3000, 3450),
    (2048, 2048, 1500, 9305),
    (5000, 500, 1500, 3459),
    (20000, 2000, 1000, 1351),
]
TRT_LLM_REQUESTS = {(i, o): n for i, o, n, _ in TRT_LLM_SHAPES}
TRT_LLM_H100_FP8_TOK_S = {(i, o): t for i, o, _, t in TRT_LLM_SHAPES}
# The same table's H200 column (same document, same method; none published for 1000/2000).
TRT_LLM_H200_FP8_TOK_S = {(128, 128): 27911, (128, 2048): 26221, (128, 4096): 18027, (500, 2000): 20770,
                          (1000, 1000): 17744, (2048, 128): 3538, (2048, 2048): 12194, (5000, 500): 3902,
                          (20000, 2000): 1804}


def trt_llm_column(gpu: str) -> tuple[str, dict]:
    """The TensorRT-LLM 1.0 column a run on ``gpu`` (device_name) compares with: (its GPU's name, its figures by
    (ISL, OSL)). The H200's on an H200 (the pool's GPUs differ from an H100 by ~1.4x in HBM bandwidth, so an
    H100 figure flatters an H200 run at decode-bound shapes); the H100's anywhere else."""
    return ("H200", TRT_LLM_H200_FP8_TOK_S) if "H200" in gpu else ("H100", TRT_LLM_H100_FP8_TOK_S)

# Ours, FP8, one H100, 2026-11-25 at commit 1be4ad6 (issue 32's table). Only to estimate how long a
# shape runs and to size --max-seconds-per-shape; bf16 is assumed at BF16_PRIOR_FACTOR of it.
PRIOR_H100_FP8_TOK_S = {(128, 128): 25320, (128, 2048): 17018, (128, 4096): 11096, (500, 2000): 16688,
                        (1000, 1000): 13349, (1000, 2000): 10770, (2048, 128): 2762, (2048, 2048): 7686,
                        (5000, 500): 2675, (20000, 2000): 755}
BF16_PRIOR_FACTOR = 0.6

DTYPES = {  # label -> (write_config_only_engine quantization, ExecutorConfig.kv_cache_dtype)
    "fp8": ("fp8", "fp8"),
    "bf16": (None, "auto"),
}
FULL = 0.95  # a step's batch at >= 95% of the plateau counts as full (a few finishing requests aside)
ENQUEUE_CHUNK = 512  # requests per enqueue call: the loop takes the lock between chunks and starts early


# ------------------------------------------------------------------------------------------------
# shapes and request counts
# ------------------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int, int | None]]:
    """"128/128,2048/128" -> [(128, 128, None), ...]; "ISL/OSL:N" fixes the request count; "all" (or
    empty): TensorRT-LLM's ten in their order."""
    if text.strip().lower() in ("", "all"):
        return [(i, o, None) for i, o, _, _ in TRT_LLM_SHAPES]
    shapes = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lengths, _, count = item.partition(":")
        isl, _, osl = lengths.partition("/")
        try:
            shape = (int(isl), int(osl), int(count) if count else None)
        except ValueError:
            raise SystemExit(f"--shapes: {item!r} is not ISL/OSL or ISL/OSL:N")
        if min(shape[0], shape[1]) < 1 or (shape[2] is not None and shape[2] < 1):
            raise SystemExit(f"--shapes: {item!r} needs positive lengths and count")
        shapes.append(shape)
    return shapes


PLANNED_SHARE = 0.85  # of each shape's share of --time-budget that its request count is sized to


def prior_tok_s(model: str, device: str, label: str, isl: int, osl: int) -> float | None:
    """The output tok/s we expect (issue 32's H100 run), for estimates only; None off that setting."""
    if model != "llama8b" or not device.startswith("cuda") or (isl, osl) not in PRIOR_H100_FP8_TOK_S:
        return None
    return PRIOR_H100_FP8_TOK_S[(isl, osl)] * (1.0 if label == "fp8" else BF16_PRIOR_FACTOR)


def batch_bounds(isl: int, osl: int, max_batch_size: int, kv_tokens: int, tokens_per_block: int,
                 max_num_tokens: int) -> dict:
    """How many sequences the executor can run at once for this shape, and what bounds it.
    guaranteed_no_evict reserves ISL + OSL of KV blocks per request; with every step's budget of
    max_num_tokens shared between decodes (one token each) and prefill chunks, a steady batch B
    admits (T - B) / ISL requests a step that live OSL steps, so B <= T x OSL / (ISL + OSL)."""
    kv_room = kv_tokens // (-(-(isl + osl) // tokens_per_block) * tokens_per_block)
    prefill = max(1, max_num_tokens * osl // (isl + osl))
    bounds = {"max batch size": max_batch_size, "KV pool": kv_room, "prefill budget": prefill}
    name = min(bounds, key=bounds.get)
    return {"expected_batch": bounds[name], "bound": name, "kv_room_requests": kv_room,
            "prefill_bound_batch": prefill}


def request_count(isl: int, osl: int, fixed: int | None, args, expected_batch: int, prior: float | None,
                  seconds_cap: float | None) -> tuple[int, str]:
    """(requests, why that many) for one shape (module docstring)."""
    if fixed is not None:
        count, why = fixed, "given in --shapes"
    elif args.waves:
        count, why = math.ceil(args.waves * expected_batch), f"{args.waves:g} waves of the expected batch {expected_batch}"
    else:
        base = TRT_LLM_REQUESTS.get((isl, osl), 1000)
        count = max(1, round(base * args.num_requests_scale))
        why = ("TensorRT-LLM's count" if (isl, osl) in TRT_LLM_REQUESTS else "no TensorRT-LLM count: 1,000")
        if args.num_requests_scale != 1.0:
            why += f" x {args.num_requests_scale:g}"
    if args.max_requests and count > args.max_requests:
        count, why = args.max_requests, f"capped by --max-requests {args.max_requests}"
    if seconds_cap and prior:
        fits = max(1, int(seconds_cap * prior / osl))
        if fits < count:
            count, why = fits, f"capped to ~{seconds_cap:.0f} s at the prior {prior:,.0f} tok/s"
    return count, why


# ------------------------------------------------------------------------------------------------
# the engine under test
# ------------------------------------------------------------------------------------------------


def start_executor(args, label: str, max_seq_len: int, kv_fraction: float):
    """An executor over a random-weight engine of --model's shape (engine_bench's config-only engine
    directory), configured as the module docstring says; returns (executor, facts about it)."""
    import torch
    from engine.executor.executor import Executor, ExecutorConfig

    quantization, kv_dtype = DTYPES[label]
    # The previous engine's blocks go back to the driver first: the KV pool is sized from what
    # cudaMemGetInfo calls free, which does not count memory PyTorch's allocator still caches.
    free_device_memory(args.device)
    started = time.perf_counter()
    engine_dir = write_config_only_engine(args.model, args.model_dtype, args.max_batch_size, max_seq_len,
                                          args.max_num_tokens, args.tokens_per_block, quantization)
    free_before = torch.cuda.mem_get_info()[0] if args.device.startswith("cuda") else None
    config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=kv_fraction, enable_kv_cache_reuse=False,
                            enable_chunked_context=True, kv_cache_dtype=kv_dtype,
                            # every iteration of the longest shape (20000/2000: ~50k) kept for the analysis
                            iter_stats_max_iterations=1 << 20)
    executor = Executor(engine_dir, config, device=args.device)
    runner = executor.runner
    info = {"dtype": label, "max_seq_len": max_seq_len, "kv_fraction": kv_fraction,
            "load_seconds": time.perf_counter() - started, "kv_blocks": runner.num_kv_blocks,
            "tokens_per_block": runner.tokens_per_block, "kv_tokens": runner.num_kv_blocks * runner.tokens_per_block,
            "kv_dtype": str(runner.kv_cache.dtype).replace("torch.", ""),
            "kv_bytes": runner.kv_cache.numel() * runner.kv_cache.element_size(),
            "max_batch_size": executor.max_batch_size, "max_num_tokens": executor.max_num_tokens,
            "decode_graphs": getattr(runner, "decode_graphs", None) is not None,
            "prefill_graphs": getattr(runner, "prefill_graphs", None) is not None,
            "free_device_bytes_before": free_before}
    return executor, info


def is_oom(error: BaseException) -> bool:
    return "out of memory" in str(error).lower()


# ------------------------------------------------------------------------------------------------
# one shape
# ------------------------------------------------------------------------------------------------


def make_requests(vocab: int, isl: int, osl: int, count: int, seed: int) -> list:
    import numpy as np
    from engine.executor.request import OutputConfig, Request

    # numpy: 20M prompt ids (20000/2000) drawn in a second rather than a minute of random.randrange.
    ids = np.random.default_rng(seed).integers(0, vocab, size=(count, isl))
    output = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
    # end_id -1: no stop token, every request makes exactly OSL tokens (trtllm-bench ignores EOS too).
    return [Request(input_token_ids=row.tolist(), max_tokens=osl, end_id=-1, output=output) for row in ids]


def drain(executor, count: int, label: str, stall_seconds: float) -> list[tuple[int, int, int, int]]:
    """(arrival, first token, last token, output tokens) of every request, ns; an error response or
    no progress for stall_seconds fails the shape."""
    records, last_progress, last_print = [], time.monotonic(), time.monotonic()
    while len(records) < count:
        responses = executor.await_responses(timeout=1.0)
        now = time.monotonic()
        for response in responses:
            if response.error:
                raise RuntimeError(f"request {response.request_id} failed: {response.error}")
            if response.result.is_final:
                perf = response.result.perf
                records.append((perf.arrival_time_ns, perf.first_token_time_ns, perf.last_token_time_ns,
                                len(response.result.output_token_ids[0])))
                last_progress = now
        if now - last_progress > stall_seconds:
            raise RuntimeError(f"no request finished for {stall_seconds:.0f} s ({len(records)}/{count} done)")
        if now - last_print >= 15:  # a line now and then: logs of a long shape show it is alive
            print(f"  {label}: {len(records):,}/{count:,} done", flush=True)
            last_print = now
    return records


def warm_up(executor, vocab: int, isl: int, max_num_tokens: int) -> None:
    """A few requests of this prompt length first, so the prefill kernels it needs are compiled
    before anything is timed (the engine's own warm-up covers its graphs, not every chunk size)."""
    count = max(1, min(8, 2 * max_num_tokens // isl))
    executor.enqueue_requests(make_requests(vocab, isl, 4, count, seed=1))
    drain(executor, count, "warm-up", stall_seconds=600)


def run_shape(executor, vocab: int, isl: int, osl: int, count: int, stall_seconds: float, cap: int) -> dict:
    """Enqueue every request at once; the trtllm-bench fields, steady state and step breakdown
    (``cap``: the most sequences the engine could run at once for this shape)."""
    requests = make_requests(vocab, isl, osl, count, seed=isl * 7919 + osl)
    since_ns = time.time_ns()
    enqueue_started = time.perf_counter()
    for start in range(0, count, ENQUEUE_CHUNK):
        executor.enqueue_requests(requests[start:start + ENQUEUE_CHUNK])
    enqueue_seconds = time.perf_counter() - enqueue_started
    del requests
    records = drain(executor, count, f"{isl}/{osl}", stall_seconds)
    wait_idle(executor)
    history = [h for h in executor.get_iteration_stats_history() if h.timestamp_ns >= since_ns]
    row = request_metrics(records, isl)
    row.update(isl=isl, osl=osl, requests=count, enqueue_seconds=enqueue_seconds)
    row["steady"] = steady_state(history, row["seconds"], cap)
    row["time"] = where_time_went(history, row["seconds"], executor, context=isl + osl // 2)
    return row


def wait_idle(executor, seconds: float = 5.0) -> None:
    """Until the loop has no request left (with overlap, a step may still be in flight after the last
    response), so the graph replayed next has the device to itself."""
    deadline = time.monotonic() + seconds
    while executor.get_latest_iteration_stats().num_active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    if executor.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize(executor.runner.device)


# ------------------------------------------------------------------------------------------------
# analysis
# ------------------------------------------------------------------------------------------------


def stats_ms(values_ns: list[float]) -> dict:
    values = [v / 1e6 for v in values_ns]
    return {"avg": statistics.fmean(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def request_metrics(records: list[tuple[int, int, int, int]], isl: int) -> dict:
    """trtllm-bench's throughput and latency fields from per-request timestamps."""
    start = min(r[0] for r in records)
    end = max(r[2] for r in records)
    seconds = (end - start) / 1e9
    output_tokens = sum(r[3] for r in records)
    ttft = [first - arrival for arrival, first, _, _ in records]
    tpot = [(last - first) / (n - 1) for _, first, last, n in records if n > 1]
    latency = [last - arrival for arrival, _, last, _ in records]
    row = {"seconds": seconds, "output_tokens": output_tokens, "input_tokens": isl * len(records),
           "request_tok_s": len(records) / seconds, "output_tok_s": output_tokens / seconds,
           "total_tok_s": (output_tokens + isl * len(records)) / seconds,
           # OSL over the request's whole latency (trtllm-bench "Per User Output Throughput [w/ ctx]")
           "per_user_output_tok_s": statistics.fmean(n / ((last - arrival) / 1e9) for arrival, _, last, n in records),
           "ttft_ms": stats_ms(ttft), "latency_ms_avg": statistics.fmean(latency) / 1e6,
           "output_tokens_min": min(r[3] for r in records), "output_tokens_max": max(r[3] for r in records)}
    if tpot:
        row["tpot_ms"] = stats_ms(tpot)
        # 1 / TPOT averaged over requests (trtllm-bench "Per User Output Speed [1/TPOT]")
        row["per_user_speed_tok_s"] = statistics.fmean(1e9 / t for t in tpot if t > 0)
    return row


def steady_state(history: list, wall_seconds: float, cap: int) -> dict:
    """Did the run reach TensorRT-LLM's steady state (finished requests replaced at once, the batch
    held at its plateau)? From the executor's iteration stats: the batch of a step is the sequences
    it scheduled (context + generation); a step is "refilled" while requests still queue."""
    steps = [(h.num_context_requests + h.num_gen_requests, h.num_queued_requests, h.iter_latency_ms / 1e3)
             for h in history if h.num_context_requests + h.num_gen_requests > 0]
    if not steps:
        return {"steps": 0, "reached": False, "why": "no iterations recorded"}
    queued = [batch for batch, waiting, _ in steps if waiting > 0]
    # The plateau: the median batch while requests waited (all admitted at once: the largest batch).
    plateau = statistics.median(queued) if queued else max(batch for batch, _, _ in steps)
    full = [batch >= FULL * plateau for batch, _, _ in steps]
    first_full = full.index(True)
    last_queued = max((i for i, (_, waiting, _) in enumerate(steps) if waiting > 0), default=-1)
    step_seconds = sum(s for _, _, s in steps)
    wall = max(wall_seconds, step_seconds, 1e-9)
    steady = sum(s for (_, waiting, s), f in zip(steps, full) if f and waiting > 0)
    ramp = sum(s for _, _, s in steps[:first_full])
    drain_seconds = sum(s for _, _, s in steps[last_queued + 1:])
    out = {"steps": len(steps), "plateau_batch": plateau, "max_batch": max(b for b, _, _ in steps),
           "mean_batch": sum(b * s for b, _, s in steps) / max(step_seconds, 1e-9),
           "steady_share": steady / wall, "ramp_share": ramp / wall, "drain_share": drain_seconds / wall,
           "queued_share": sum(s for _, waiting, s in steps if waiting > 0) / wall,
           # at the hard limit (max batch size or KV room), the "fraction of steps at max batch"
           "cap": cap, "cap_share": sum(s for b, _, s in steps if b >= FULL * cap) / wall}
    return out


def where_time_went(history: list, wall_seconds: float, executor, context: int) -> dict:
    """Steps carrying context vs pure decode steps, and the decode step against its CUDA graph
    replayed at ``context`` tokens a row."""
    with_context = [h for h in history if h.num_context_requests > 0]
    decode = [h for h in history if h.num_context_requests == 0 and h.num_gen_requests > 0]
    context_seconds = sum(h.iter_latency_ms for h in with_context) / 1e3
    decode_seconds = sum(h.iter_latency_ms for h in decode) / 1e3
    wall = max(wall_seconds, 1e-9)
    out = {"context_steps": len(with_context), "context_seconds": context_seconds,
           "context_share": context_seconds / wall, "context_tokens": sum(h.num_ctx_tokens for h in with_context),
           "decode_steps": len(decode), "decode_seconds": decode_seconds, "decode_share": decode_seconds / wall}
    steps = with_context + decode
    if steps:  # from the first step's start to the last one's end (each step's stats are stamped as it ends)
        out["steps_span_seconds"] = (max(h.timestamp_ns for h in steps) - min(h.timestamp_ns - h.iter_latency_ms * 1e6
                                                                              for h in steps)) / 1e9
    if context_seconds > 0:
        out["prefill_tok_s"] = out["context_tokens"] / context_seconds
        out["context_step_ms_mean"] = context_seconds * 1e3 / len(with_context)
    if not decode:
        return out
    out["decode_step_ms_mean"] = statistics.fmean(h.iter_latency_ms for h in decode)
    out["decode_batch_mean"] = statistics.fmean(h.num_gen_requests for h in decode)
    # The batch bucket (the CUDA graph a step replays) holding the most decode time.
    graphs = getattr(executor.runner, "decode_graphs", None)
    by_bucket: dict[int, list] = {}
    for h in decode:
        bucket = graphs.bucket_for(h.num_gen_requests) if graphs is not None and h.num_gen_requests <= graphs.max_batch_size \
            else h.num_gen_requests
        by_bucket.setdefault(bucket, []).append(h)
    bucket, steps = max(by_bucket.items(), key=lambda item: sum(h.iter_latency_ms for h in item[1]))
    out.update(bucket=bucket, bucket_steps=len(steps), bucket_batch_mean=statistics.fmean(h.num_gen_requests for h in steps),
               bucket_step_ms_mean=statistics.fmean(h.iter_latency_ms for h in steps),
               bucket_share=sum(h.iter_latency_ms for h in steps) / 1e3 / wall)
    if graphs is not None and bucket in graphs.graphs:
        try:  # a diagnostic: a failure here must not cost the shape's figures
            out["bucket_graph_ms"] = decode_graph_ms(executor.runner, round(out["bucket_batch_mean"]), context)
            out["bucket_graph_context"] = context
            out["bucket_graph_splits"] = graph_splits_text(graphs, bucket)
        except Exception as error:  # noqa: BLE001
            print(f"  (decode graph alone not timed: {error!r})", flush=True)
    return out


def decode_graph_ms(runner, batch: int, context: int) -> float:
    """The decode graph of ``batch`` rows replayed alone, every row with ``context`` tokens over
    placeholder blocks of the pool: the device floor of such a step (the rest of a served step is host
    work the overlap did not hide). Not the graph's buffers as the run left them: the drain's last
    steps turned nearly every row into padding (context 1), whose replay reads no keys. The pool is
    idle (every request is done), so the placeholder blocks' K/V may be overwritten."""
    graphs = runner.decode_graphs
    page = graphs.tokens_per_block
    per_seq = -(-context // page)
    usable = runner.kv_cache.shape[2] - 1  # block 0 left alone
    tables = [[1 + (row * per_seq + j) % usable for j in range(per_seq)] for row in range(batch)]
    if graphs.run([0] * batch, [context - 1] * batch, [context] * batch, tables) is None:
        return float("nan")  # wider than the graphs' block tables
    # Timed without graphs.run's host work: its buffers now hold this batch.
    return cuda_time_ms(graphs.graphs[graphs.bucket_for(batch)].replay, warmup=1, repeat=5)


def graph_splits_text(graphs, bucket: int) -> str:
    """How the decode attention of ``bucket``'s graph split its keys in the replay just run: the count its host
    asked for and the plan it came from (kernels/triton_attention.py decode_active_splits), or that it has no plan
    and keeps the splits its capture chose. Why it is reported: issue 51's 91 x 21,000 graph took 50 ms where 41 was
    due, captured without the keys-major kernel's residency and so with one split and no plan (1,478 us a layer
    against 1,136 with 2)."""
    plan = graphs.metas[bucket].decode_split_plan
    if plan is None:
        return "no split plan: the splits its capture chose"
    _, capacity, sms = plan  # (KV heads, programs the GPU holds at once, SMs)
    return f"{int(graphs.host_splits[0])} splits a replay ({capacity} programs at once on {sms} SMs)"


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def fmt_ms(stats: dict | None) -> str:
    if not stats:
        return "n/a"
    return " / ".join(f"{stats[k]:,.1f}" for k in ("avg", "p50", "p90", "p99"))


def steady_text(steady: dict, threshold: float) -> str:
    if not steady.get("steps"):
        return "no: " + steady.get("why", "no steps")
    verdict = "yes" if steady["steady_share"] >= threshold else "no"
    return (f"{verdict}: batch {steady['plateau_batch']:,.0f} for {steady['steady_share']:.0%} of the time "
            f"(ramp {steady['ramp_share']:.0%}, drain {steady['drain_share']:.0%})")


def time_text(t: dict) -> str:
    text = (f"context steps {t['context_share']:.0%} ({t['context_steps']:,}, {t.get('context_step_ms_mean', 0):.1f} ms each, "
            f"{t.get('prefill_tok_s', 0):,.0f} prefill tok/s), decode steps {t['decode_share']:.0%} ({t['decode_steps']:,})")
    if "bucket" in t:
        text += f"; decode at batch {t['bucket_batch_mean']:,.0f}: {t['bucket_step_ms_mean']:.2f} ms/step"
        if "bucket_graph_ms" in t:
            text += f" vs graph {t['bucket_graph_ms']:.2f} ms (alone, context {t.get('bucket_graph_context', '?')}"
            text += f"; {t['bucket_graph_splits']})" if "bucket_graph_splits" in t else ")"
    return text


def batch_text(row: dict) -> str:
    """The plateau against what should bound it (issue 32: "batches stop at 512")."""
    s, b = row["steady"], row["bounds"]
    if not s.get("steps"):
        return "n/a"
    return (f"plateau {s['plateau_batch']:,.0f} of limit {s['cap']:,} ({s['cap_share']:.0%} of the time at it); "
            f"expected {b['expected_batch']:,} ({b['bound']})")


def describe_row(row: dict, threshold: float, gpu: str) -> str:
    """The console block of one shape, trtllm-bench's fields first; ``gpu`` picks TensorRT-LLM's column."""
    s, t = row["steady"], row["time"]
    column, published = trt_llm_column(gpu)
    trt = published.get((row["isl"], row["osl"])) if row["dtype"] == "fp8" else None
    lines = [
        f"=== {row['isl']}/{row['osl']} {row['dtype']}: {row['requests']:,} requests ({row['count_reason']}) ===",
        f"Request Throughput (req/sec):                {row['request_tok_s']:,.3f}",
        f"Total Output Throughput (tokens/sec):        {row['output_tok_s']:,.1f}"
        + (f"   TensorRT-LLM 1.0 ({column}) {trt:,} -> ratio {row['output_tok_s'] / trt:.2f}" if trt
           else f"   TensorRT-LLM 1.0 ({column}): n/a"),
        f"Total Token Throughput (tokens/sec):         {row['total_tok_s']:,.1f}",
        f"Total Latency (s):                           {row['seconds']:,.2f}  (enqueue {row['enqueue_seconds']:.2f} s)",
        f"Average request latency (ms):                {row['latency_ms_avg']:,.1f}",
        f"Per User Output Throughput (tok/s/user):     {row['per_user_output_tok_s']:,.2f}",
        f"Per User Output Speed [1/TPOT] (tok/s/user): {row.get('per_user_speed_tok_s', float('nan')):,.2f}",
        f"TTFT avg / p50 / p90 / p99 (ms):             {fmt_ms(row['ttft_ms'])}",
        f"TPOT avg / p50 / p90 / p99 (ms):             {fmt_ms(row.get('tpot_ms'))}",
        f"Output tokens: {row['output_tokens']:,} (= requests x OSL: {row['output_tokens'] == row['requests'] * row['osl']})",
        f"Steady state: {steady_text(s, threshold)}",
    ]
    if s.get("steps"):
        b = row["bounds"]
        trt_count = TRT_LLM_REQUESTS.get((row["isl"], row["osl"]))
        trt_waves = f" (TensorRT-LLM's {trt_count:,} requests: {trt_count / max(s['plateau_batch'], 1):.1f})" if trt_count else ""
        lines.append(f"  batch: plateau {s['plateau_batch']:,.0f}, max {s['max_batch']:,}, mean {s['mean_batch']:,.1f}; "
                     f"{row['requests'] / max(s['plateau_batch'], 1):.1f} waves{trt_waves}; requests queued {s['queued_share']:.0%} of "
                     f"the time; at the limit {s['cap']:,} (max batch / KV room) {s['cap_share']:.0%} of the time; "
                     f"expected {b['expected_batch']:,} (bound: {b['bound']}; KV room {b['kv_room_requests']:,} "
                     f"requests, prefill bound {b['prefill_bound_batch']:,})")
    lines.append(f"Where the time went: {time_text(t)}")
    if row.get("estimate_seconds"):
        lines.append(f"  (estimated {row['estimate_seconds']:.0f} s before the run, took {row['seconds']:.0f} s)")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    threshold = results["steady_threshold"]
    column, published = trt_llm_column(results["gpu"])
    lines = [f"### Offline throughput, TensorRT-LLM 1.0's shapes ({results['model']}, random weights)", "",
             f"Commit {results['commit']}, {results['gpu']}, {results['date']}. `{results['command']}`.",
             f"Executor: chunked context on, max batch {results['max_batch_size']}, max_num_tokens "
             f"{results['max_num_tokens']}, KV fraction {results['kv_fraction']}, no prefix reuse; "
             f"steady state: the batch at its plateau with requests queued for >= {threshold:.0%} of the time."]
    for e in results.get("engines", []):
        lines.append(f"- {e['dtype']} engine, max_seq_len {e['max_seq_len']:,}: KV pool {e['kv_dtype']}, {e['kv_tokens']:,} "
                     f"tokens ({e['kv_bytes'] / 2**30:.1f} GiB, fraction {e['kv_fraction']}), loaded in {e['load_seconds']:.0f} s.")
    lines += ["", f"| ISL/OSL | dtype | requests | output tok/s | TensorRT-LLM 1.0 ({column} FP8) | ratio | req/s | "
              "per-user tok/s (1/TPOT) | TTFT avg/p50/p90/p99 ms | TPOT avg/p50/p90/p99 ms | steady state |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['isl']}/{row['osl']} | {row['dtype']} | {row.get('requests', 0):,} | failed: "
                         f"{row['error'][:120]} | | | | | | | |")
            continue
        trt = published.get((row["isl"], row["osl"])) if row["dtype"] == "fp8" else None
        reference, ratio = (f"{trt:,}", f"{row['output_tok_s'] / trt:.2f}") if trt else ("n/a", "n/a")
        lines.append(
            f"| {row['isl']}/{row['osl']} | {row['dtype']} | {row['requests']:,} | {row['output_tok_s']:,.0f} | "
            f"{reference} | {ratio} | "
            f"{row['request_tok_s']:,.2f} | {row.get('per_user_speed_tok_s', float('nan')):,.1f} | "
            f"{fmt_ms(row['ttft_ms'])} | {fmt_ms(row.get('tpot_ms'))} | {steady_text(row['steady'], threshold)} |")
    lines += ["", "Where the time went (share of wall time in steps carrying context vs pure decode steps; the "
              "decode step at the bucket holding most decode time vs its CUDA graph replayed alone at the plateau's mean context):", "",
              "| ISL/OSL | dtype | batch | where the time went |", "|---|---|---|---|"]
    for row in results["rows"]:
        if "error" not in row:
            lines.append(f"| {row['isl']}/{row['osl']} | {row['dtype']} | {batch_text(row)} | {time_text(row['time'])} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="all", help="ISL/OSL[:N],... (default: TensorRT-LLM's ten)")
    parser.add_argument("--dtype", choices=["fp8", "bf16", "both"], default="both",
                        help="fp8: FP8 weights + FP8 KV pool; bf16: bfloat16 weights and pool")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    parser.add_argument("--tiny", action="store_true", help="--model tiny on the CPU: a smoke run in seconds")
    parser.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    parser.add_argument("--num-requests-scale", type=float, default=1.0, help="x TensorRT-LLM's request counts")
    parser.add_argument("--waves", type=float, default=0.0,
                        help="instead: this many times the batch the shape can hold (see the docstring)")
    parser.add_argument("--max-requests", type=int, default=0, help="cap on every shape's request count")
    parser.add_argument("--max-seconds-per-shape", type=float, default=0.0,
                        help="cap the count to what runs in about this long at issue 32's measured rate")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds for the whole run: later shapes get smaller counts (or are skipped) to fit")
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-seq-len", default="shape",
                        help="shape: ISL + OSL per shape (an engine each); max: one engine for the longest; or N")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--kv-fraction", type=float, default=0.95,
                        help="of free device memory for the KV pool (0.90 after an out-of-memory error)")
    parser.add_argument("--steady-threshold", type=float, default=0.75,
                        help="steady state: the batch at its plateau with requests queued this share of the time")
    parser.add_argument("--stall-seconds", type=float, default=300.0, help="fail a shape when no request ends this long")
    parser.add_argument("--out", default="throughput_bench.json")
    parser.add_argument("--markdown", default=None, help="append the markdown tables to this file")
    parser.add_argument("--report", default=None,
                        help="only render the tables of these JSON files (comma-separated: one table), e.g. a run cut short")
    parser.add_argument("--engine-seconds", type=float, default=120.0,
                        help="--time-budget: what an engine load is assumed to take (compiles included)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
        args.device = args.device or "cpu"
    args.device = args.device or "cuda"
    args.model_dtype = "bfloat16"
    return args


def seq_len_for(args, shapes: list[tuple[int, int, int | None]], isl: int, osl: int) -> int:
    if args.max_seq_len == "shape":
        needed = isl + osl
    elif args.max_seq_len == "max":
        needed = max(i + o for i, o, _ in shapes)
    else:
        needed = int(args.max_seq_len)
        if needed < isl + osl:
            raise SystemExit(f"--max-seq-len {needed} < {isl}+{osl}")
    return -(-needed // args.tokens_per_block) * args.tokens_per_block


def print_plan(args, labels: list[str], shapes) -> None:
    """Before any device time: per shape the request count and, where a prior exists, the estimate."""
    print(f"plan: {len(shapes)} shape(s) x {labels}; counts are final once the KV pool is known", flush=True)
    total = 0.0
    for label in labels:
        for isl, osl, fixed in shapes:
            prior = prior_tok_s(args.model, args.device, label, isl, osl)
            count, why = request_count(isl, osl, fixed, args, expected_batch=args.max_batch_size, prior=prior,
                                       seconds_cap=args.max_seconds_per_shape or None)
            estimate = count * osl / prior if prior else None
            total += estimate or 0.0
            print(f"  {label} {isl}/{osl}: {count:,} requests ({why})"
                  + (f", ~{estimate:,.0f} s at ~{prior:,.0f} tok/s" if estimate else ""), flush=True)
    if total:
        keys = [(label, seq_len_for(args, shapes, i, o)) for label in labels for i, o, _ in shapes]
        engines = sum(1 for index, key in enumerate(keys) if index == 0 or key != keys[index - 1])
        print(f"  estimated {total / 60:,.1f} min of runs + {engines} engine load(s) (each one's time is printed; "
              f"--time-budget assumes {args.engine_seconds:.0f} s)", flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.report:
        results = None
        for path in args.report.split(","):  # several runs (e.g. one per dtype): one table
            with open(path) as f:
                part = json.load(f)
            if results is None:
                results = part
            else:
                results["engines"] += part["engines"]
                results["rows"] += part["rows"]
                results["command"] += "; " + part["command"]
        print_table(markdown(results), args.markdown)
        return results
    t0 = time.monotonic()
    shapes = parse_shapes(args.shapes)
    labels = ["fp8", "bf16"] if args.dtype == "both" else [args.dtype]
    on_gpu = args.device.startswith("cuda")
    results = {"date": utc_now(), "commit": git_commit(), "gpu": device_name(args.device), "model": args.model,
               "command": command_line(__file__, argv),
               "max_batch_size": args.max_batch_size, "max_num_tokens": args.max_num_tokens,
               "kv_fraction": args.kv_fraction, "steady_threshold": args.steady_threshold, "engines": [], "rows": []}
    print(f"throughput_bench: {results['model']} on {results['gpu']}, commit {results['commit']}", flush=True)
    print_plan(args, labels, shapes)
    vocab = MODELS[args.model]["vocab_size"]

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    save()  # from the start: a run killed in its first engine load still leaves a (rowless) report
    jobs = [(label, shape) for label in labels for shape in shapes]
    fractions = dict.fromkeys(labels, args.kv_fraction)  # lowered for good after an out-of-memory error
    speed = dict.fromkeys(labels, 1.0)  # measured / prior output tok/s of the last shape, per dtype
    executor, engine_key, info = None, None, None
    for index, (label, (isl, osl, fixed)) in enumerate(jobs):
        seconds_cap = args.max_seconds_per_shape or None
        if args.time_budget:
            left = args.time_budget - (time.monotonic() - t0)
            engines_left = len({(j_label, seq_len_for(args, shapes, i, o)) for j_label, (i, o, _) in jobs[index:]} - {engine_key})
            share = (left - engines_left * args.engine_seconds) / (len(jobs) - index)
            if share < 10:
                print(f"--- {isl}/{osl} {label}: skipped, {left:.0f} s of the budget left", flush=True)
                results["rows"].append({"isl": isl, "osl": osl, "dtype": label, "error": "skipped: time budget spent"})
                save()
                continue
            # Plan 85% of the share: a shape's rate can miss its prior by ~15% (1000/1000 ran at 12,924 tok/s
            # against a corrected prior of 14,867 on 2026-11-26), and the last shape of a budget that overruns
            # is killed by the caller's timeout with nothing to show.
            seconds_cap = min(seconds_cap or share, share) * PLANNED_SHARE
        kv_fraction = fractions[label]
        for attempt in (0, 1):
            key = (label, seq_len_for(args, shapes, isl, osl))
            try:
                if key != engine_key:
                    if executor is not None:
                        executor.shutdown()
                        executor = None  # (the last reference: start_executor frees its memory)
                    print(f"--- engine: {label}, max_seq_len {key[1]:,}, KV fraction {kv_fraction}", flush=True)
                    executor, info = start_executor(args, label, key[1], kv_fraction)
                    engine_key = key
                    results["engines"].append(info)
                    save()
                    print(f"    ready in {info['load_seconds']:.0f} s: KV pool {info['kv_dtype']} {info['kv_tokens']:,} tokens "
                          f"({info['kv_bytes'] / 2**30:.1f} GiB), max batch {info['max_batch_size']}, "
                          f"max_num_tokens {info['max_num_tokens']}, prefill graphs {'on' if info['prefill_graphs'] else 'off'}"
                          + (f"; {info['free_device_bytes_before'] / 2**30:.1f} GiB were free before the load"
                             if info["free_device_bytes_before"] else ""), flush=True)
                bounds = batch_bounds(isl, osl, info["max_batch_size"], info["kv_tokens"], info["tokens_per_block"],
                                      info["max_num_tokens"])
                prior = prior_tok_s(args.model, args.device, label, isl, osl)
                if prior:  # as fast or slow as the shapes before it ran against their prior
                    prior *= speed[label]
                count, why = request_count(isl, osl, fixed, args, bounds["expected_batch"], prior, seconds_cap)
                estimate = count * osl / prior if prior else None
                print(f"--- {isl}/{osl} {label}: {count:,} requests ({why}); expected batch {bounds['expected_batch']:,} "
                      f"({bounds['bound']}), {count / bounds['expected_batch']:.1f} waves"
                      + (f"; estimate ~{estimate:,.0f} s" if estimate else ""), flush=True)
                if on_gpu:  # (the CPU compiles nothing)
                    warm_up(executor, vocab, isl, info["max_num_tokens"])
                cap = min(bounds["kv_room_requests"], info["max_batch_size"])
                row = run_shape(executor, vocab, isl, osl, count, args.stall_seconds, cap)
                break
            except Exception as error:  # noqa: BLE001  (one shape failing must not cost the others)
                # The engine may hold the failed shape's requests or be broken: the next shape gets a new one.
                if executor is not None:
                    executor.shutdown()
                executor, engine_key = None, None
                if not (is_oom(error) and kv_fraction > 0.9 and attempt == 0):
                    print(f"--- {isl}/{osl} {label} failed: {type(error).__name__}: {error}", flush=True)
                    row = {"isl": isl, "osl": osl, "error": f"{type(error).__name__}: {error}"}
                    break
                print(f"--- out of memory at KV fraction {kv_fraction}; again at 0.90: {error}", flush=True)
                kv_fraction = fractions[label] = 0.9
        row.update(dtype=label, max_seq_len=key[1], kv_fraction=kv_fraction)
        if "error" not in row:
            row.update(count_reason=why, bounds=bounds, estimate_seconds=estimate)
            row["steady"]["reached"] = row["steady"].get("steady_share", 0.0) >= args.steady_threshold
            if estimate:
                speed[label] = min(4.0, max(0.25, speed[label] * estimate / row["seconds"]))
            print(describe_row(row, args.steady_threshold, results["gpu"]), flush=True)
        results["rows"].append(row)
        save()
    if executor is not None:
        executor.shutdown()
    print_table(markdown(results), args.markdown)
    print(f"throughput_bench: done in {time.monotonic() - t0:,.0f} s; results in {args.out}", flush=True)
    return results


if __name__ == "__main__":
    main()
