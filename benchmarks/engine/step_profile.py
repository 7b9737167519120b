#!/usr/bin/env python3
"""Kernel profile of one engine step: where a prefill step's or a long-context decode step's device
time goes, by kernel family (GEMMs, attention, norms and rotary, the rest).

    python benchmarks/engine/step_profile.py --model llama8b --quantization fp8 --kv_cache_dtype fp8 \\
        --prefill 4x2048 --decode 194x5250 [--out profile.json]

``--prefill NxL``: one step of N fresh prompts of L tokens (chunked-context shapes: N * L tokens).
``--decode BxC``: one decode step of B sequences with C tokens of context each, run eagerly (not
from a CUDA graph, so the profiler sees each kernel; a graph replays the same kernels).
``--graph``: decode shapes as the executor serves them (its load-time kernel choices first), the
step's CUDA graph replayed 10 times under the profiler (figures per replay; a graph's kernels are
what the served step runs, e.g. the Triton skinny GEMMs an eager step leaves to cuBLAS).
``--bucket 96 --page_order in_order,shuffled --kv_gib 123.5`` (with ``--graph``; issue 51): the graph captured for
the executor's bucket (padding rows and all), profiled once per page order over a pool as large as the engine's
(shuffled: the batch's pages drawn from all of it).
``--sweep_splits 1,2,4,8``: for each decode shape, the step's time (CUDA events, median of 5) with the
decode attention's key splits forced to each count, beside the count the kernel chooses itself.
Random weights of the named shape (benchmarks/common.py MODELS), made on the device. Each step runs
twice to warm up, then once under torch.profiler; kernels are grouped by name patterns
(``FAMILIES``), and the table gives each family's device time and share, with the step's wall time
from CUDA events for comparison. This is what issue 32's "where the time went" names per shape.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import dims, int_list, write_config_only_engine  # noqa: E402

# First match wins; names are lower-cased kernel names as the profiler reports them.
FAMILIES = [
    ("attention", ("attention", "attn", "flash", "fmha", "paged", "decode_kernel", "prefill_kernel")),
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "scaled_mm", "matmul", "nvjet", "skinny", "linear", "gemv")),
    ("quantize", ("quantize", "e4m3", "amax")),
    ("norm+rotary+activation", ("rms", "norm", "rotary", "rope", "silu", "gelu", "act_and_mul")),
    ("kv write", ("write_kv", "kv_cache", "reshape_and_cache")),
]


def family_of(name: str) -> str:
    lowered = name.lower()
    for family, patterns in FAMILIES:
        if any(p in lowered for p in patterns):
            return family
    return "other"


def step_batch(runner, batch_size: int, new_tokens: int, context: int):
    """One step of ``batch_size`` sequences, each with ``new_tokens`` new tokens ending at ``context``."""
    from engine.executor.runner import ForwardBatch

    per_seq = -(-context // runner.tokens_per_block)
    token_ids, positions, tables = [], [], []
    for i in range(batch_size):
        token_ids += [(7 * i + p) % 1000 for p in range(context - new_tokens, context)]
        positions += range(context - new_tokens, context)
        tables.append(list(range(i * per_seq, (i + 1) * per_seq)))
    ends = [(i + 1) * new_tokens - 1 for i in range(batch_size)]
    # A hybrid (Mamba layers) reads and writes one state slot per sequence: slot i for sequence i.
    slots = list(range(batch_size)) if getattr(runner.model, "uses_state_cache", False) else None
    return ForwardBatch(token_ids, positions, [new_tokens] * batch_size, [context] * batch_size, tables, ends,
                        state_slots=slots)


def profile_step(runner, batch) -> dict:
    for _ in range(2):
        runner.forward(batch)
    return profile_calls(lambda: runner.forward(batch), calls=1)


def graph_tables(batch_size: int, per_seq: int, num_blocks: int, order: str, seed: int = 0) -> list[list[int]]:
    """Block tables of ``batch_size`` sequences of ``per_seq`` pages each in a pool of ``num_blocks`` blocks:
    "in_order", each sequence's pages adjacent (block 0 on; a fresh pool's free list hands them out so);
    "shuffled", distinct blocks drawn at random from the whole pool (where a long-running engine's churned free
    list leaves a request's pages: a 123 GiB pool's pages then lie all over it, for the GPU's TLBs to cover)."""
    import random

    needed = batch_size * per_seq
    if needed > num_blocks:
        raise ValueError(f"{batch_size} sequences of {per_seq} pages need {needed} blocks; the pool has {num_blocks}")
    if order == "in_order":
        ids = list(range(needed))
    elif order == "shuffled":
        ids = random.Random(seed).sample(range(num_blocks), needed)
    else:
        raise ValueError(f"page order {order!r}: in_order or shuffled")
    return [ids[i * per_seq:(i + 1) * per_seq] for i in range(batch_size)]


def profile_decode_graph(runner, batch_size: int, context: int, replays: int = 10, bucket: int | None = None,
                         orders: tuple[str, ...] = ("in_order",)) -> dict:
    """The decode step as the executor serves it: one CUDA graph captured for ``bucket`` rows (default
    ``batch_size``; the executor's bucket holds a few padding rows, as there), ``batch_size`` sequences at
    ``context`` tokens replayed ``replays`` times under the profiler; figures are per replay. One result per
    page order of ``orders`` (graph_tables over the whole pool; the first's is the top level, the others' under
    "by_order")."""
    import torch

    from engine.executor.cuda_graphs import DecodeGraphs

    bucket = bucket or batch_size
    per_seq = -(-(context + 1) // runner.tokens_per_block)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, tokens_per_block=runner.tokens_per_block,
                          max_seq_len=runner.build_config.max_seq_len, max_batch_size=bucket, buckets=[bucket])
    graphs.capture()
    results = {}
    for order in orders:
        tables = graph_tables(batch_size, per_seq, runner.kv_cache.shape[2], order)
        graphs.run([1] * batch_size, [context] * batch_size, [context + 1] * batch_size, tables)
        graph = graphs.graphs[bucket]
        for _ in range(3):
            graph.replay()
        results[order] = profile_calls(graph.replay, calls=replays)
        # the key splits this replay's decode attention used (decode_active_splits; the grid's all where the bucket
        # keeps one count) and the plan they came from: (KV heads, programs the GPU holds at once, SMs)
        plan = graphs.metas[bucket].decode_split_plan
        results[order].update(page_order=order, bucket=bucket, split_plan=plan,
                              active_splits=int(graphs.host_splits[0]) if plan is not None else None)
    del graphs, graph
    torch.cuda.empty_cache()
    first = results.pop(orders[0])
    if results:
        first["by_order"] = results
    return first


def profile_without_pdl(profile) -> dict:
    """``profile()`` (a graph captured and profiled) with the Triton kernels launched without programmatic dependent
    launch (kernels/_triton.py set_pdl), then PDL as it was. Why: under PDL a kernel's programs start while the one
    before still runs and wait in griddepcontrol.wait, so the profiler's duration of, e.g., the split merge after a
    multi-wave decode attention holds the attention's last wave (issue 51: 382 us a launch, its kernels 12 ms over
    the step's time); launched plainly, each kernel's time is its own."""
    from kernels import _triton

    was = _triton._pdl_enabled
    _triton.set_pdl(False)
    try:
        return profile()
    finally:
        _triton.set_pdl(was)


def profile_calls(call, calls: int) -> dict:
    """Kernel families, the top kernels and launches of ``calls`` calls of ``call``, per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize()
    by_family: dict[str, float] = {}
    top: dict[str, float] = {}
    launches: dict[str, int] = {}  # kernel -> launches in the step (a batch-1 step is bound by these)
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = event.self_cuda_time_total
        if device_us <= 0:
            continue
        if event.key.startswith("cuda"):  # runtime API rows (cudaGraphLaunch ...), not kernels
            continue
        family = family_of(event.key)
        by_family[family] = by_family.get(family, 0.0) + device_us / 1000 / calls
        top[event.key] = top.get(event.key, 0.0) + device_us / 1000 / calls
        launches[event.key] = launches.get(event.key, 0) + event.count // calls
    kernels_ms = sum(by_family.values())
    ranked = sorted(top.items(), key=lambda kv: -kv[1])[:24]
    return {"step_ms": start.elapsed_time(end) / calls, "kernels_ms": kernels_ms, "launches": sum(launches.values()),
            "families_ms": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": dict(ranked), "top_kernels_launches": {name: launches[name] for name, _ in ranked}}


def time_step_ms(runner, batch, repeats: int = 5) -> float:
    import statistics

    import torch

    runner.forward(batch)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.forward(batch)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sweep_splits(runner, batch, counts: list[int]) -> dict:
    """Step time with the decode key splits forced to each count (None: the kernel's own choice)."""
    import kernels.triton_attention as attention

    chosen = attention._decode_num_splits
    picked = []
    results = {}
    try:
        def record_choice(*args):
            picked.append(chosen(*args))
            return picked[-1]
        attention._decode_num_splits = record_choice
        results["auto"] = time_step_ms(runner, batch)
        results["auto_splits"] = picked[-1] if picked else None
        for count in counts:
            attention._decode_num_splits = lambda *args, count=count: count
            results[count] = time_step_ms(runner, batch)
    finally:
        attention._decode_num_splits = chosen
    return results


def print_profile(title: str, result: dict) -> None:
    print(f"\n{title}: step {result['step_ms']:.2f} ms (CUDA events), kernels {result['kernels_ms']:.2f} ms "
          f"in {result['launches']} launches")
    if result["kernels_ms"] > 1.02 * result["step_ms"]:
        print(f"(the kernels' times overlap by {result['kernels_ms'] - result['step_ms']:.2f} ms: under PDL a kernel's "
              "programs start early and wait in griddepcontrol.wait for the one before; --pdl_ab shows each alone)")
    print("| family | ms | share |\n|---|---|---|")
    for family, ms in result["families_ms"].items():
        print(f"| {family} | {ms:.2f} | {ms / result['kernels_ms']:.0%} |")
    print("top kernels:")
    for name, ms in result["top_kernels_ms"].items():
        count = result["top_kernels_launches"][name]
        print(f"  {ms:8.2f} ms  {count:5d} x {1000 * ms / count:7.1f} us  {name[:100]}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="e.g. fp8")
    parser.add_argument("--kv_cache_dtype", default=None, help="fp8: an FP8 KV pool")
    parser.add_argument("--prefill", action="append", default=[], help="NxL, repeatable")
    parser.add_argument("--decode", action="append", default=[], help="BxC, repeatable")
    parser.add_argument("--sweep_splits", default=None, help="comma list of decode key-split counts")
    parser.add_argument("--graph", action="store_true",
                        help="decode shapes as served: the step's CUDA graph replayed under the profiler")
    parser.add_argument("--bucket", type=int, default=0,
                        help="--graph: capture the graph for this many rows (the executor's bucket of the batch, e.g. "
                             "96 for 91; its extra rows are padding); default the batch")
    parser.add_argument("--page_order", default="in_order",
                        help="--graph: comma list of in_order / shuffled (graph_tables), one profile each")
    parser.add_argument("--pdl_ab", action="store_true",
                        help="--graph: where the load chose PDL, the graph captured and profiled once more without it "
                             "(each kernel's own time; under PDL a kernel's time holds its wait on the one before)")
    parser.add_argument("--kv_gib", type=float, default=0.0,
                        help="a KV pool of this many GiB (all layers; the engine's: 123.5 for Llama-8B's FP8 pool at "
                             "0.95 of an H200), capped at 0.95 of the free memory; default: the shapes' pages")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from engine.executor.runner import ModelRunner

    shapes = [("prefill", *dims(s)) for s in args.prefill] + [("decode", *dims(s)) for s in args.decode]
    max_context = max(length for _, _, length in shapes)
    max_tokens = max(count * length if kind == "prefill" else count for kind, count, length in shapes)
    max_batch = max([count for _, count, _ in shapes] + [args.bucket])  # (the graph's bucket: rows its buffers hold)
    engine_dir = write_config_only_engine(args.model, args.dtype, max(max_batch, 8), max_context + 64,
                                          max(max_tokens, 8192), 32, quantization=args.quantization)
    runner = ModelRunner(engine_dir, device="cuda")
    if getattr(runner.model, "uses_state_cache", False):  # hybrids: state slots before the KV pool, as the executor
        runner.allocate_state_cache(max(max_batch, 8))
    blocks = max(count * -(-(length + 1) // runner.tokens_per_block) for _, count, length in shapes)
    if args.kv_gib:
        per_block = runner.kv_block_bytes_for(args.kv_cache_dtype or "auto")
        room = int(0.95 * torch.cuda.mem_get_info()[0]) // per_block
        blocks = max(blocks, min(int(args.kv_gib * 2**30) // per_block, room))
    runner.allocate_kv_cache(blocks, args.kv_cache_dtype)
    print(f"KV pool: {blocks:,} blocks of {runner.tokens_per_block} tokens, "
          f"{runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**30:.1f} GiB")
    print(f"{torch.cuda.get_device_name()}, {args.model} {args.dtype} quantization={args.quantization} "
          f"kv={args.kv_cache_dtype or args.dtype}, commit {os.environ.get('BENCH_COMMIT', '?')}")
    results = {}
    if args.graph:  # what the executor's load chooses before it captures (skinny GEMMs, PDL, FP8 scaling)
        runner.choose_kernels(sorted({count for kind, count, _ in shapes if kind == "decode"}))
        print(f"launch choice: {runner.launch_choice}")
        picked = {key: report.get("variant") if isinstance(report, dict) else report
                  for key, report in runner.gemm_choices.items()}
        print(f"skinny GEMM choices (shape: variant, False = cuBLAS): {picked}")
    for kind, count, length in shapes:
        new_tokens = length if kind == "prefill" else 1
        if kind == "decode" and args.graph:
            result = profile_decode_graph(runner, count, length, bucket=args.bucket or None,
                                          orders=tuple(args.page_order.split(",")))
            kind = "decode graph"
        else:
            result = profile_step(runner, step_batch(runner, count, new_tokens, length))
        title = f"{kind} {count}x{length}"
        if "page_order" in result:
            for one in (result, *result.get("by_order", {}).values()):
                print_profile(f"{title} ({one['page_order']} pages, bucket {one['bucket']}; decode splits "
                              f"{one['active_splits'] or 'as captured'}, plan {one['split_plan']})", one)
            import kernels.triton_attention as attention

            print(f"decode programs an SM holds, by tiling: {getattr(attention, '_DECODE_RESIDENT', '?')}")
            if args.pdl_ab and getattr(runner, "launch_choice", {}).get("pdl"):
                result["pdl_off"] = profile_without_pdl(
                    lambda: profile_decode_graph(runner, count, length, bucket=args.bucket or None,
                                                 orders=tuple(args.page_order.split(","))[:1]))
                print_profile(f"{title} (PDL off: each kernel's own time; {result['pdl_off']['page_order']} pages)",
                              result["pdl_off"])
        else:
            print_profile(title, result)
        if kind == "decode" and args.sweep_splits:
            result["splits_ms"] = sweep_splits(runner, step_batch(runner, count, 1, length),
                                               int_list(args.sweep_splits))
            print(f"{title} step ms by decode key splits: {result['splits_ms']}")
        results[title] = result
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
