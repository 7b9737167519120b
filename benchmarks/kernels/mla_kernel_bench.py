#!/usr/bin/env python3
"""The MLA decode kernel alone (kernels/mla_attention.py, issue 55): achieved bandwidth over the latent
cache at contexts 1k-32k, against the GPU's copy bandwidth (goal >= 80%).

    PYTHONPATH=$PWD python benchmarks/kernels/mla_kernel_bench.py [--shape v3|v2_lite] [--contexts 1024,...,32768]
        [--batches 1,8,32] [--pool bf16,fp8] [--tree 0] [--out mla.json] [--markdown FILE]
    PYTHONPATH=$PWD python benchmarks/kernels/mla_kernel_bench.py --tiny   # CPU, seconds: the reference, tiny shape

One layer's decode step: ``batch`` sequences of ``context`` cached latent rows each (pages shuffled
through a pool far larger than L2), one new token each, all of the shape's heads (DeepSeek-V3: 128
heads, V2-Lite: 16; kv_lora_rank 512 + rope 64 per row). A decode row must read each of its
sequence's rows once: bytes = batch x context x (R + P) x pool itemsize, the kernel's whole traffic up
to the queries and the (T, splits, H, R) float32 partials. Timed with CUDA events (median of
``--repeat``), the kernel's own split choice (``mla_splits``). ``--tree N``: each sequence verifies an
N-node chain instead (the tree-mask path, tree verification's cost beside the plain one).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (command_line, cuda_time_ms, git_commit, int_list, machine_summary,  # noqa: E402
                               print_table, utc_now)
from kernels.attention import KV_FP8_DTYPE  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.mla_attention import mla_attention, mla_splits  # noqa: E402

SHAPES = {"v3": dict(heads=128, rank=512, rope=64), "v2_lite": dict(heads=16, rank=512, rope=64),
          "tiny": dict(heads=4, rank=32, rope=8)}
PAGE = 64
GOAL = 0.80


def copy_bandwidth(device: str) -> float | None:
    """Bytes/s of a 2 GiB device-to-device copy (read + write), the denominator of the goal."""
    if device == "cpu":
        return None
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), repeat=20)
    bandwidth = 2 * src.numel() * src.element_size() / (ms / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bandwidth


def decode_step(shape: dict, batch: int, context: int, pool: str, tree: int, device: str, dtype: torch.dtype):
    """(q_latent, q_rope, cache, meta) of one layer's step: ``batch`` sequences at ``context`` keys
    each, their last max(1, tree) tokens new (a chain's tree mask when tree > 0), pages shuffled."""
    heads, rank, rope = shape["heads"], shape["rank"], shape["rope"]
    q_len = max(1, tree)
    pages = -(-context // PAGE)
    num_blocks = batch * pages + 1
    order = list(range(1, num_blocks))
    random.Random(0).shuffle(order)
    cache = torch.randn(num_blocks, PAGE, rank + rope, device=device, dtype=dtype)
    if pool == "fp8":
        cache = cache.to(KV_FP8_DTYPE)
    tables = torch.tensor(order, dtype=torch.int32, device=device).view(batch, pages)
    cu = [i * q_len for i in range(batch + 1)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=device), block_tables=tables,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        max_seqlen_q=q_len, max_context_len=context, is_decode_only=q_len == 1,
        cu_seqlens_q_host=cu, context_lens_host=[context] * batch)
    if tree:  # a chain: node j sees nodes 0..j (the causal rows, through the tree-mask path)
        chain = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool, device=device))
        meta.tree_mask = chain.repeat(batch, 1)
    q_latent = torch.randn(cu[-1], heads, rank, device=device, dtype=dtype)
    q_rope = torch.randn(cu[-1], heads, rope, device=device, dtype=dtype)
    return q_latent, q_rope, cache, meta


def run(args: argparse.Namespace) -> dict:
    shape = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(args.device)
    rows = []
    for pool in args.pool:
        for batch in args.batches:
            for context in args.contexts:
                q_latent, q_rope, cache, meta = decode_step(shape, batch, context, pool, args.tree, args.device, dtype)
                scale = (shape["rank"] // 4 + shape["rope"]) ** -0.5
                call = lambda: mla_attention(q_latent, q_rope, cache, meta, scale)  # noqa: E731
                if args.device == "cpu":
                    call()
                    start = time.perf_counter()
                    for _ in range(args.repeat):
                        call()
                    ms = (time.perf_counter() - start) * 1e3 / args.repeat
                else:
                    ms = cuda_time_ms(call, repeat=args.repeat)
                read = batch * context * cache.shape[-1] * cache.element_size()
                achieved = read / (ms / 1e3)
                rows.append(dict(pool=pool, batch=batch, context=context, tree=args.tree, us=ms * 1e3,
                                 latent_bytes=read, GBps=achieved / 1e9,
                                 splits=mla_splits(q_latent.shape[0], shape["heads"], 16, q_latent.device)
                                 if args.device != "cpu" else None,
                                 fraction=None if bandwidth is None else achieved / bandwidth))
                print(rows[-1], flush=True)
                del q_latent, q_rope, cache, meta
    return dict(shape=args.shape, dtype=args.dtype, device=args.device, machine=machine_summary(args.device),
                copy_GBps=None if bandwidth is None else bandwidth / 1e9, goal=GOAL, rows=rows,
                command=command_line(__file__), commit=git_commit(), date=utc_now())


def markdown(results: dict) -> str:
    bw = results["copy_GBps"]
    lines = [f"MLA decode kernel, {results['shape']} shape ({SHAPES[results['shape']]['heads']} heads), "
             f"{results['dtype']} queries, {results['machine']}; copy bandwidth "
             f"{'n/a' if bw is None else f'{bw:,.0f} GB/s'}; goal >= {GOAL:.0%} of it over the latent rows "
             f"({results['commit']}, {results['date']})", "",
             "| pool | batch | context | tree nodes | us / layer | latent MB | GB/s | of copy bw | splits |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        frac = "-" if r["fraction"] is None else f"{r['fraction']:.0%}"
        lines.append(f"| {r['pool']} | {r['batch']} | {r['context']:,} | {r['tree'] or 1} | {r['us']:,.1f} | "
                     f"{r['latent_bytes'] / 1e6:,.1f} | {r['GBps']:,.0f} | {frac} | {r['splits'] or '-'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="v3")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--contexts", type=int_list, default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--batches", type=int_list, default=[1, 8, 32])
    p.add_argument("--pool", default="bf16,fp8", help="comma-separated: bf16 (the queries' dtype) and/or fp8")
    p.add_argument("--tree", type=int, default=0, help="verify an N-node chain per sequence (tree-mask path)")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="tiny shape, float32, on the CPU (the reference), seconds")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None, help="append the table to this file")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.dtype, args.device, args.repeat = "tiny", "float32", "cpu", 2
        args.contexts, args.batches = [128, 512], [1, 2]
    args.pool = [x for x in args.pool.split(",") if x]
    if args.device == "cpu":
        args.pool = ["bf16"]  # the CPU reference reads the pool in the queries' dtype
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(markdown(results), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
