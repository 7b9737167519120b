"""A batch-1 tree verify step's attention against a decode step's, kernel alone, in the CUDA-graph form.

    python benchmarks/kernels/tree_attention_bench.py [--nodes 15,16,32,64] [--context 512]
        [--max-seq-len 736] [--tilings short,prefill] [--out tree_attention.json] [--markdown FILE]

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads of 128, bf16, 32-token pages in the
runner's head-major pool): one sequence of ``--context`` cached tokens verifies a tree of N drafted
nodes, N + 1 tokens with the root (the first node under the root, every other one a child of a random
earlier one) through kernels/triton_attention.py's short-step launch as a tree CUDA graph replays it
(tile map, the graph's ``--max-seq-len`` as max_context_len, keys split). 15 nodes (16 tokens: one
query tile a KV head) pass q and k unrotated (the launch rotates and writes the new K/V,
short_step_appends), as tree_bench's 16-token bucket does; more nodes write their K/V before the
launch. The decode step is the
one-token launch with its rotary and KV write, split as a decode graph captures it. Each form is
recorded in a CUDA graph of 20 launches (the kernels are a few microseconds: launched from Python,
the launch would be what is timed), replayed 20 times between two events: us per launch.

The tree mask goes in as the tree graphs pass it, bytes and bits (AttentionMetadata.tree_bits); the kernel
reads the bits unless $TRITONLLM_TREE_BITS=0.

``--tilings``: ``short`` is the short step's own tiling ($TRITONLLM_SHORT_STEP_TILING=short,
_short_step_config), ``prefill`` the prompt chunk's (the default), the A/B of the two. The issue-56 goal: tree rows'
attention <= ~1.3x the decode launch's at 15-64 nodes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 32


def make_step(tokens: int, context: int, max_seq_len: int, device: torch.device):
    """-> (q, new_kv, k_cache, v_cache, meta) of one sequence verifying ``tokens`` tokens (the root and
    tokens - 1 drafted nodes; 1: a decode step) after ``context``."""
    from engine.executor.prefill_graphs import tile_map
    from engine.executor.tree_batch import tree_mask
    from kernels.attention_metadata import AttentionMetadata, pack_tree_mask
    from kernels.rotary import build_cos_sin_cache
    from kernels.triton_attention import prefill_tokens_per_tile

    total = context + tokens
    blocks = -(-max_seq_len // PAGE) + 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    k_cache = torch.randn(blocks, KV_HEADS, PAGE, HEAD_DIM, generator=gen).to(torch.bfloat16).to(device).transpose(1, 2)
    v_cache = torch.randn(blocks, KV_HEADS, PAGE, HEAD_DIM, generator=gen).to(torch.bfloat16).to(device).transpose(1, 2)
    table = torch.arange(1, blocks, dtype=torch.int32, device=device)[None]  # block 0 left unused
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).to(device)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).to(device)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).to(device)
    rng = random.Random(tokens)
    parents = [-1, 0] + [rng.randrange(0, j) for j in range(2, tokens)]
    depth = [0] * tokens
    for i in range(1, tokens):
        depth[i] = depth[parents[i]] + 1
    positions = torch.tensor([context + d for d in depth], device=device)
    slots = torch.tensor([(1 + p // PAGE) * PAGE + p % PAGE for p in range(context, total)], device=device)
    per_tile = prefill_tokens_per_tile(HEADS // KV_HEADS, HEAD_DIM, 2, torch.device(device))  # the launches' rows
    tile_seq, tile_m = tile_map([tokens], per_tile, -(-tokens // per_tile) + 1)
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=table,
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([total], dtype=torch.int32, device=device), max_seqlen_q=tokens,
        max_context_len=max_seq_len, is_decode_only=tokens == 1,
        tree_mask=tree_mask([tokens], [parents]).to(device) if tokens > 1 else None,
        tree_bits=pack_tree_mask(tree_mask([tokens], [parents])).to(device) if tokens > 1 else None,
        tile_seq=torch.from_numpy(tile_seq).to(device) if tokens > 1 else None,
        tile_m=torch.from_numpy(tile_m).to(device) if tokens > 1 else None, tile_tokens=per_tile)
    cos_sin = build_cos_sin_cache(max_seq_len + 64, HEAD_DIM, 500000.0, device=device)
    return q, (k, v, positions, cos_sin), k_cache, v_cache, meta


def time_us(step, launches: int = 20, replays: int = 20) -> float:
    """us per call of ``step``, from a CUDA graph of ``launches`` calls replayed ``replays`` times (on the
    CPU, a smoke run under TRITON_INTERPRET=1: one eager call, its wall time)."""
    if not torch.cuda.is_available():
        started = time.perf_counter()
        step()
        return (time.perf_counter() - started) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (launches * replays)


def measure(tokens: int, tiling: str, args, device: torch.device) -> float:
    from kernels.triton_attention import SHORT_STEP_TILING_ENV, paged_attention_triton, short_step_appends
    from kernels.triton_attention import write_kv_cache_triton

    q, new_kv, k_cache, v_cache, meta = make_step(tokens, args.context, args.max_seq_len, device)
    scale = HEAD_DIM ** -0.5
    os.environ[SHORT_STEP_TILING_ENV] = tiling  # "short" or "prefill" (the default)
    try:
        if meta.is_decode_only or short_step_appends(q, k_cache, meta):
            return time_us(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale, new_kv=new_kv))
        k, v = new_kv[:2]

        def step():  # the 32-token bucket's form: K/V written before the launch (rotary's kernel: not timed here)
            write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
            return paged_attention_triton(q, k_cache, v_cache, meta, scale)
        return time_us(step)
    finally:
        os.environ.pop(SHORT_STEP_TILING_ENV, None)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="15,16,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-seq-len", type=int, default=736,
                        help="the graphs' max_context_len (tree_bench's engine)")
    parser.add_argument("--tilings", default="short,prefill")
    parser.add_argument("--out", default="tree_attention.json")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TRITON_INTERPRET=1, a smoke run
    decode = measure(1, "short", args, device)
    rows = [{"nodes": 0, "tiling": "decode", "us": round(decode, 2), "ratio": 1.0}]
    print(f"decode launch: {decode:.2f} us", flush=True)
    for nodes in [int(n) for n in args.nodes.split(",")]:
        for tiling in args.tilings.split(","):
            us = measure(nodes + 1, tiling, args, device)  # the root's token and the drafted nodes'
            rows.append({"nodes": nodes, "tiling": tiling, "us": round(us, 2), "ratio": round(us / decode, 2)})
            print(f"{nodes} nodes, {tiling} tiling: {us:.2f} us ({us / decode:.2f}x decode)", flush=True)
    lines = [f"`python benchmarks/kernels/tree_attention_bench.py --nodes {args.nodes} --context {args.context} "
             f"--max-seq-len {args.max_seq_len} --tilings {args.tilings}` on "
             f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (interpreter)'}", "",
             "| nodes | tiling | us a launch | vs decode |", "|---:|---|---:|---:|"]
    lines += [f"| {r['nodes']} | {r['tiling']} | {r['us']:.2f} | {r['ratio']:.2f}x |" for r in rows]
    print("\n".join(lines))
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "context": args.context, "max_seq_len": args.max_seq_len}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
