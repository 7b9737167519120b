#!/usr/bin/env python3
"""A decode step's CUDA graph, replayed alone, with two of its kernel choices switched on and off:
the TMA reads of decode attention (kernels/triton_attention.py, $TRITONLLM_DECODE_TMA) and the FP8
products' deferred scales (kernels/fp8.py ``choose_fp8_scaling``). Issue 32's decode-bound shapes.

    python benchmarks/kernels/decode_graph_ab.py --cases 544x1500,512x1100,208x5250 \\
        [--model llama8b] [--quantization fp8] [--kv_cache_dtype fp8]

Each case BxC is B sequences with C tokens of context each (pages in order, random weights of the
named shape made on the device) replayed from the graph the executor would serve them with: the
smallest of its batch buckets (cuda_graphs.default_buckets) that holds B, padding rows included
(``--exact``: a graph of exactly B rows). It is captured once per combination (the choices are
read at capture) and replayed 10 times back to back, the least of 3 such means. For each case the
products that the load-time timing would defer at B rows are printed first (the executor captures
its graphs after that timing). Device time only: the lm_head, sampling and the host's share of a
served step are not in it (benchmarks/engine/throughput_bench.py's "vs graph" figure is that difference).
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import dims_list, write_config_only_engine  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="544x1500,512x1100,384x1700,288x2600,208x5250,1024x192",
                        help="BxC,...: B sequences with C tokens of context")
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--kv_cache_dtype", default="fp8")
    parser.add_argument("--exact", action="store_true", help="graphs of exactly B rows, not the served bucket")
    parser.add_argument("--shuffled", action="store_true",
                        help="each sequence's pages drawn at random from the pool (a served pool's), not in order")
    parser.add_argument("--as_served", action="store_true",
                        help="only the engine's own choices (TMA on, deferred scales as timed): one graph a case")
    args = parser.parse_args(argv)

    import torch

    import kernels.fp8 as fp8
    from engine.executor.cuda_graphs import DecodeGraphs, default_buckets
    from engine.executor.runner import ModelRunner
    from engine.models.layers import Linear
    from kernels.linear import replay_time_ms
    from kernels.triton_attention import DECODE_TMA_ENV

    cases = dims_list(args.cases)
    max_batch, max_context = max(b for b, _ in cases), max(c for _, c in cases)
    engine_dir = write_config_only_engine(args.model, "bfloat16", max_batch, max_context + 64, 8192, 32,
                                          quantization=args.quantization)
    runner = ModelRunner(engine_dir, device="cuda")
    per_seq = {c: -(-(c + 1) // runner.tokens_per_block) for _, c in cases}
    runner.allocate_kv_cache(max(b * per_seq[c] for b, c in cases) + 1, args.kv_cache_dtype)
    fp8_weights = [m.weight for m in runner.model.modules() if isinstance(m, Linear) and m.is_fp8]
    print(f"{torch.cuda.get_device_name()}, {args.model} quantization={args.quantization} kv={args.kv_cache_dtype}")
    results = {}
    for batch, context in cases:
        pages = list(range(1, 1 + batch * per_seq[context]))
        if args.shuffled:
            random.Random(0).shuffle(pages)
        tables = [pages[i * per_seq[context]:(i + 1) * per_seq[context]] for i in range(batch)]
        bucket = batch if args.exact else next(b for b in default_buckets(4096) if b >= batch)
        chosen = fp8.choose_fp8_scaling(fp8_weights, [bucket])
        deferred = {key for key in fp8._DEFERRED_SCALING if key[1] == bucket}
        print(f"{batch} rows in the graph of {bucket}: deferred products (rows, N, K) "
              f"{sorted(k for k, v in chosen.items() if v)}")
        times = {}
        combinations = [(True, True)] if args.as_served else itertools.product((True, False), (True, False))
        for tma, defer in combinations:
            os.environ[DECODE_TMA_ENV] = "1" if tma else "0"
            fp8._DEFERRED_SCALING.difference_update(deferred)
            if defer:
                fp8._DEFERRED_SCALING.update(deferred)
            graphs = DecodeGraphs(runner.model, runner.kv_cache, tokens_per_block=runner.tokens_per_block,
                                  max_seq_len=max_context + 64, max_batch_size=bucket, buckets=[bucket])
            graphs.capture()
            graphs.run([1] * batch, [context] * batch, [context + 1] * batch, tables)
            # the attention splits this replay asked for (trees before per-replay splits have none)
            active = int(graphs.host_splits[0]) if hasattr(graphs, "host_splits") else None
            times[(tma, defer)] = min(replay_time_ms(graphs.graphs[bucket], replays=10) for _ in range(3))
            del graphs
            torch.cuda.empty_cache()
        os.environ.pop(DECODE_TMA_ENV, None)
        fp8._DEFERRED_SCALING.update(deferred)
        print(f"decode graph {batch}x{context} (bucket {bucket}, attention splits {active}): " + ", ".join(
            f"tma={'on' if tma else 'off'} deferred={'on' if defer else 'off'}: {ms:.2f} ms"
            for (tma, defer), ms in times.items()), flush=True)
        results[f"{batch}x{context}"] = {f"tma={tma},deferred={defer}": ms for (tma, defer), ms in times.items()}
    return results


if __name__ == "__main__":
    main()
