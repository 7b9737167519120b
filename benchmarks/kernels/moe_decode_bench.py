"""Decode-sized routed experts: kernels/moe_decode.py's one launch against the path the engine takes
by default (kernels/fused_moe.py moe_forward, kernels/fused_moe_fp8.py moe_forward_fp8), at 1, 8 and
16 tokens, for Qwen3-30B-A3B's and gpt-oss-20b's expert shapes in bf16, FP8 per channel, FP8
128 x 128 blocks and 4 bits in groups of 128 (kernels/fused_moe_wna16.py moe_forward_wna16 by default). Routing included (router logits in, (T, H) out); microseconds a call from
CUDA-graph replays of 6 calls on different tokens (benchmarks.common.graph_call_us), the bytes of the
distinct experts hit over the time (TB/s), the relative difference to moe_decode_ref.

    python benchmarks/kernels/moe_decode_bench.py [--shapes qwen3_30b_a3b gpt_oss_20b] [--kinds bf16 fp8_block]
        [--tokens 1 8 16] [--sweep [--sweep-shapes qwen3_30b_a3b]]   # also the tile candidates (best printed)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402

from benchmarks.common import graph_call_us  # noqa: E402
from kernels.fp8 import quantize_rows  # noqa: E402
from kernels.fp8_block import quantize_blocks  # noqa: E402
from kernels.fused_moe import moe_forward, route_tokens_ref  # noqa: E402
from kernels.fused_moe_fp8 import moe_forward_fp8  # noqa: E402
from kernels.fused_moe_wna16 import moe_forward_wna16, prepare_wna16_experts  # noqa: E402
from kernels.wna16 import quantize  # noqa: E402
from kernels.moe_decode import DECODE_TILE_CANDIDATES as SWEEP  # noqa: E402
from kernels.moe_decode import (DECODE_TILES, MOE_DECODE_ENV, int4_tiles_fit, moe_decode_ref,  # noqa: E402
                                moe_decode_triton, weight_kind)

SHAPES = {"qwen3_30b_a3b": (128, 8, 2048, 768), "gpt_oss_20b": (32, 4, 2880, 2880)}  # E, top-k, H, I
REPEAT = 6


def make_experts(kind: str, experts: int, hidden: int, inter: int):
    """(gate_up, gate_up_scale, down, down_scale) on the GPU: bf16, or E4M3 with row / 128 x 128 block scales;
    int4: the two projections' WNA16Experts (kernel layout) and their dequantized bf16 copies."""
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5
    if kind == "bf16":
        return gate_up.bfloat16(), None, down.bfloat16(), None
    if kind == "int4":
        stored = [quantize(w, 4, 128, symmetric=False) for w in (gate_up, down)]
        del gate_up, down
        return tuple(x for w in stored for x in (prepare_wna16_experts(*w, 4, torch.bfloat16, for_kernel=True),
                                                  prepare_wna16_experts(*w, 4, torch.bfloat16, for_kernel=False).dense))
    out = []
    for w in (gate_up, down):
        if kind == "fp8_block":
            out += list(quantize_blocks(w))
        else:
            codes, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
            out += [codes.view(w.shape), scale.view(w.shape[:2])]
        del w
    return tuple(out)


def bench(shape: str, kind: str, token_counts, sweep: bool) -> None:
    experts, top_k, hidden, inter = SHAPES[shape]
    torch.manual_seed(0)
    gate_up, gu_s, down, d_s = make_experts(kind, experts, hidden, inter)
    int4 = kind == "int4"
    if int4:  # (WNA16Experts, dense copy) a projection: the kernels take the first, the reference the second
        (gu_q, gu_dense), (d_q, d_dense) = (gate_up, gu_s), (down, d_s)
        gate_up, down = gu_q.kernel["weight"], d_q.kernel["weight"]
        gu_s, d_s = gu_q.kernel["scale"], d_q.kernel["scale"]
        gu_z, d_z = gu_q.kernel["zero"], d_q.kernel["zero"]
    else:
        gu_z = d_z = None
    expert_bytes = (gate_up[0].numel() * gate_up.element_size() + down[0].numel() * down.element_size())
    if int4:  # + the scales and zeros (float32 and a byte a group)
        expert_bytes += (gu_s[0].numel() + d_s[0].numel()) * 5
    print(f"\n{shape} ({kind}): E={experts} top-{top_k} H={hidden} I={inter}; {expert_bytes / 1e6:.2f} MB an expert")
    print("| tokens | path | us | experts hit | TB/s | rel. diff vs moe_decode_ref |")
    print("|---:|---|---:|---:|---:|---:|")

    def default(x, logits):
        if int4:
            return moe_forward_wna16(x, logits, gu_q, d_q, top_k, True)
        if gu_s is None:
            return moe_forward(x, logits, gate_up, down, top_k, True)
        return moe_forward_fp8(x, logits, gate_up, gu_s, down, d_s, top_k, True)

    def fused(tiles=None):
        return lambda x, logits: moe_decode_triton(x, gate_up, down, top_k=top_k, router_logits=logits, renormalize=True,
                                                   gate_up_scale=gu_s, down_scale=d_s, gate_up_zero=gu_z,
                                                   down_zero=d_z, tiles=tiles)

    for tokens in token_counts:
        inputs = [(torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
                   torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)) for _ in range(REPEAT)]
        hits = [int(torch.unique(route_tokens_ref(logits, top_k, True)[1]).numel()) for _, logits in inputs]
        hit = sum(hits) / len(hits)
        x, logits = inputs[0]
        weights, ids = route_tokens_ref(logits, top_k, True)
        if int4:
            ref = moe_decode_ref(x, gu_dense, d_dense, weights, ids).float()
        else:
            ref = moe_decode_ref(x, gate_up, down, weights, ids, gate_up_scale=gu_s, down_scale=d_s).float()
        rows = [("default (grouped)", default), (f"fused one launch {DECODE_TILES[weight_kind(gate_up, gu_s)]}", fused())]
        if sweep:
            rows += [(f"fused {tiles}", fused(tiles)) for tiles in SWEEP
                     if not (kind == "fp8_block" and (tiles[1] != 128 or 128 % tiles[0]))
                     and not (int4 and not int4_tiles_fit(hidden, inter, 128, 128, tiles))]
        best = None
        for name, fn in rows:
            try:
                diff = ((fn(x, logits).float() - ref).norm() / ref.norm()).item()
                us = graph_call_us(fn, inputs)
            except Exception as exc:  # a tiling too big for shared memory or registers
                print(f"| {tokens} | {name} | failed {type(exc).__name__}: {str(exc)[:80]} | | | |")
                continue
            print(f"| {tokens} | {name} | {us:.1f} | {hit:.1f} | {hit * expert_bytes / us / 1e6:.2f} | {diff:.1e} |",
                  flush=True)
            if name.startswith("fused") and (best is None or us < best[1]):
                best = (name, us)
        if best:
            print(f"| {tokens} | best fused: {best[0]} | {best[1]:.1f} | | | |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES, reverse=True))
    parser.add_argument("--kinds", nargs="+", choices=["bf16", "fp8_channel", "fp8_block", "int4"],
                        default=["bf16", "fp8_block", "int4"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-shapes", nargs="+", choices=sorted(SHAPES), default=["qwen3_30b_a3b"],
                        help="the shapes --sweep sweeps (each tiling compiles once per shape and kind: ~2 s)")
    args = parser.parse_args()
    import os
    os.environ.pop(MOE_DECODE_ENV, None)  # "default" is what the engine takes without the switch
    print(f"device: {torch.cuda.get_device_name()}")
    for shape in args.shapes:
        for kind in args.kinds:
            bench(shape, kind, args.tokens, args.sweep and shape in args.sweep_shapes)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
