"""tree_bench's verify section: ModelRunner.forward of B sequences each verifying a random tree of n
nodes against a plain decode step of the same sequences (benchmarks/speculative/tree_bench.py).
"""
from __future__ import annotations

import random

from benchmarks.speculative.speculative_bench import step_path, time_step, verify_batch, with_blocks
from benchmarks.speculative.tree_kernels import verify_kernels


def tree_batch(tables, context: int, parents: list[int], rng: random.Random, vocab: int, page: int):
    """verify_batch's packing for a tree: per sequence the root (last known token) then the nodes."""
    from engine.executor.tree_batch import chunk_parents, tree_positions

    n = len(parents) + 1
    batch = verify_batch(tables, context, n - 1, rng, vocab, page)
    trees = [chunk_parents(n, parents) for _ in tables]
    batch.tree_parents = trees
    batch.positions = [p for tree in trees for p in tree_positions(context - 1, tree)]
    return batch


def tree_path(runner, batch) -> str:
    prefill = getattr(runner, "prefill_graphs", None)
    if prefill is not None and prefill.tree_buckets and len(batch.token_ids) <= prefill.tree_buckets[-1]:
        return f"tree graph, {prefill.bucket_for(len(batch.token_ids))}-token bucket"
    return "eager" if runner.device.type == "cuda" else "eager (CPU)"


def tree_depths(parents: list[int]) -> list[int]:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def bench_verify(executor, args) -> list[dict]:
    runner = executor.runner
    page, vocab = runner.tokens_per_block, runner.vocab_size
    blocks_per_seq = -(-(args.context + max(args.nodes)) // page)
    rows = []
    for batch_size in args.batches:
        rng = random.Random(batch_size)

        def measure(tables):
            plain = verify_batch(tables, args.context, 0, rng, vocab, page)
            base = time_step(runner, plain, 10, args.repeat)
            out = []
            for n in args.nodes:
                parents = [rng.randrange(-1, i) for i in range(n)]
                batch = tree_batch(tables, args.context, parents, rng, vocab, page)
                ms = time_step(runner, batch, args.warmup, args.repeat)
                depth = max(len(set(tree_depths(parents))), 1)
                out.append({"batch": batch_size, "nodes": n, "depth": depth, "tokens": len(batch.token_ids),
                            "path": tree_path(runner, batch), "tree_ms": ms, "plain_ms": base,
                            "plain_path": step_path(runner, plain), "ratio": ms / base})
                print(f"    batch {batch_size} nodes {n}: {ms:.3f} ms vs {base:.3f} ({out[-1]['path']})", flush=True)
                if args.kernels and batch_size == args.batches[0]:
                    out[-1]["kernels"] = verify_kernels(runner, plain, batch, args.kernels, f"nodes {n}")
            return out

        rows += with_blocks(executor, batch_size, blocks_per_seq, measure)
    return rows
