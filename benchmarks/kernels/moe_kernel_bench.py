"""Routed experts in the model dtype (bf16), each path of kernels/fused_moe.py at every batch size:
the block-tiled Triton kernel (``triton``), sorted rows + torch._grouped_mm
(kernels/moe_grouped_mm.py, ``grouped_mm``) and what moe_forward picks (``default``).
Microseconds a call from CUDA-graph replays (``REPEAT`` calls a graph on different tokens, so the
experts come from HBM), routing included; achieved TFLOPS (6 * H * I flops an assignment) and the
bytes of the experts hit over the time.

    python benchmarks/kernels/moe_kernel_bench.py [--shape qwen3_30b_a3b|gpt_oss_20b] [--tokens 1 8 64 ...]
        [--stages]   # also time the grouped path's stages one by one at the largest size
        [--sweep]    # also time the block-tiled kernel's block sizes and tilings at each size (one token: each projection's tiles)
        [--sweep-projections]  # ... and each projection's tilings alone (gate_up, down)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402

from benchmarks.common import graph_call_us  # noqa: E402
from kernels.fused_moe import (fused_moe_ref, fused_moe_triton, gemm_config, model_dtype_tiling,  # noqa: E402
                               moe_forward, route_tokens)
from kernels.moe_epilogue import PLAIN_SILU, expert_activation  # noqa: E402
from kernels.fused_moe import moe_single_token_triton  # noqa: E402
from kernels.moe_grouped_mm import combine, fused_moe_grouped_mm, sort_assignments  # noqa: E402

SHAPES = {  # experts, top-k, hidden, expert width
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "gpt_oss_20b": (32, 4, 2880, 2880),
}
REPEAT = 6
SINGLE = ("tensor-core single",)  # one-token paths


def sweep_configs():
    """(block_m, tile config) candidates of the block-tiled kernel, the current table's first."""
    for block_m in (16, 32, 64):
        yield block_m, gemm_config(block_m)
    for block_m in (32, 64):
        for block_n, block_k, warps, stages in ((64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 5),
                                                (128, 64, 8, 4), (32, 128, 4, 4), (64, 256, 4, 2),
                                                (128, 128, 4, 3), (256, 64, 8, 3), (64, 128, 4, 4)):
            yield block_m, {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}
    # 128-row blocks for prefill sizes (>= 64 rows an expert): SGLang's H200 table for these experts takes 128 x 256
    # x 64 tiles over 8 warps from 1,024 tokens (its 256 columns span gate and up; this kernel's BLOCK_N covers each).
    for block_n, block_k, warps, stages in ((128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 4), (64, 64, 4, 4),
                                            (128, 32, 8, 4), (64, 128, 8, 3), (256, 64, 8, 2)):
        yield 128, {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}


def print_tiling_time(label: str, fn, inputs) -> None:
    """One sweep line: fn's microseconds a call, or why it failed (a tiling too big for shared memory)."""
    try:
        us = graph_call_us(fn, inputs)
    except Exception as exc:
        print(f"    {label}: failed {type(exc).__name__}")
        return
    print(f"    {label}: {us:.1f} us", flush=True)


def single_token_configs():
    """Tile candidates of a single token's grouped GEMMs (kernels/fused_moe.py SINGLE_TOKEN_TILES)."""
    for block_n, block_k, warps, stages in ((32, 128, 4, 4), (16, 128, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3),
                                            (64, 128, 4, 4), (32, 64, 4, 6), (16, 128, 2, 5), (32, 128, 2, 4),
                                            (64, 64, 4, 5), (16, 512, 4, 2)):
        yield {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}


def sweep_projections(token_counts, gate_up, down, top_k) -> None:
    """Each projection's grouped GEMM alone per tiling: the best tiles of gate_up (K = H, gated)
    and of down (K = I) need not be the same."""
    from kernels.fused_moe import _grouped_gemm, moe_align

    experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    for tokens in token_counts:
        if tokens == 1:
            continue
        for block_m, config in sweep_configs():
            results = []
            for name, weight, n, k in (("gate_up", gate_up, inter, hidden), ("down", down, hidden, inter)):
                calls = []
                for _ in range(REPEAT):
                    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
                    weights, ids = route_tokens(logits, top_k, True)
                    blocks = moe_align(ids, experts, block_m)
                    rows = tokens if name == "gate_up" else tokens * top_k
                    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                    out = torch.empty(tokens * top_k, n, device="cuda", dtype=torch.bfloat16)
                    calls.append((a, out, blocks, ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous()))

                def fn(a, out, blocks, ids, weights, name=name, weight=weight, n=n, block_m=block_m, config=config):
                    _grouped_gemm(a, weight, out, blocks, ids, weights, n=n, top_k=top_k,
                                  rows_per_token=name == "gate_up", gated=name == "gate_up",
                                  mul_weight=name == "down", block_m=block_m, config=config)
                try:
                    results.append(f"{name} {graph_call_us(fn, calls):.1f}")
                except Exception as exc:
                    results.append(f"{name} failed {type(exc).__name__}")
            print(f"  {tokens} tokens, block_m {block_m} {config}: {', '.join(results)} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_30b_a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 512, 1024, 2048, 8192])
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-projections", action="store_true")
    args = parser.parse_args()
    experts, top_k, hidden, inter = SHAPES[args.shape]
    torch.manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5).bfloat16()
    print(f"device: {torch.cuda.get_device_name()}  shape {args.shape}: E={experts} top-{top_k} H={hidden} I={inter}")

    def routed(path):
        def fn(x, logits):
            weights, ids = route_tokens(logits, top_k, True)
            return path(x, gate_up, down, weights, ids)
        return fn

    paths = {"triton": routed(fused_moe_triton), "grouped_mm": routed(fused_moe_grouped_mm),
             "tensor-core single": lambda x, logits: moe_single_token_triton(x, logits, gate_up, down, top_k, True),
             "default": lambda x, logits: moe_forward(x, logits, gate_up, down, top_k, True)}
    print("| tokens | path | us | TFLOPS | experts' bytes GB/s | rel. diff vs reference |")
    print("|---:|---|---:|---:|---:|---:|")
    for tokens in args.tokens:
        inputs = [(torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
                   torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)) for _ in range(REPEAT)]
        x, logits = inputs[0]
        weights, ids = route_tokens(logits, top_k, True)
        reference = fused_moe_ref(x, gate_up, down, weights, ids).float()
        hit = int(torch.unique(ids).numel())
        flops = tokens * top_k * 6 * hidden * inter
        for name, fn in paths.items():
            if (tokens == 1 and name == "grouped_mm") or (tokens > 1 and name in SINGLE):
                continue
            diff = ((fn(x, logits).float() - reference).norm() / reference.norm()).item()
            us = graph_call_us(fn, inputs)
            print(f"| {tokens} | {name} | {us:.1f} | {flops / us / 1e6:.0f} | "
                  f"{hit * 6 * hidden * inter / us / 1e3:.0f} | {diff:.1e} |", flush=True)
        if args.sweep and tokens == 1:
            print("    single token, each projection's tiles (the other's default):")
            for config in single_token_configs():
                for projection in ("gate_up", "down"):
                    key = "config" if projection == "gate_up" else "down_config"
                    def fn(x, logits, key=key, config=config):
                        return moe_single_token_triton(x, logits, gate_up, down, top_k, True, **{key: config})
                    print_tiling_time(f"{projection} {config}", fn, inputs)
        if args.sweep and tokens > 1:
            print(f"    block-tiled kernel at {tokens} tokens (default "
                  f"{model_dtype_tiling(tokens * top_k, experts)}):")
            for block_m, config in sweep_configs():
                def fn(x, logits, block_m=block_m, config=config):
                    weights, ids = route_tokens(logits, top_k, True)
                    return fused_moe_triton(x, gate_up, down, weights, ids, block_m=block_m, config=config)
                print_tiling_time(f"block_m {block_m} {config}", fn, inputs)
    if args.sweep_projections:
        sweep_projections(args.tokens, gate_up, down, top_k)
    if args.stages:
        from kernels.moe_align import moe_align_parallel, moe_align_torch, moe_align_triton

        print("\nalignment (block_m 64), us:")
        for tokens in args.tokens:
            _, ids = route_tokens(torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16), top_k, True)
            times = {name: graph_call_us(lambda fn=fn: fn(ids, experts, 64), [()] * 3)
                     for name, fn in (("torch ops", moe_align_torch), ("one program", moe_align_triton),
                                      ("parallel", moe_align_parallel))}
            print(f"  {tokens} tokens: " + ", ".join(f"{name} {us:.1f}" for name, us in times.items()), flush=True)
        tokens = max(args.tokens)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = route_tokens(torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16), top_k, True)
        dest, order, offs = sort_assignments(ids, experts)
        rows = x.index_select(0, order // top_k)
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
        row_expert = ids.reshape(-1)[order]
        act = expert_activation(h, row_expert, PLAIN_SILU)
        y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
        assignments = tokens * top_k
        stages = {
            "sort_assignments": (lambda: sort_assignments(ids, experts), 0),
            "sort_assignments (torch.sort)": (lambda: sort_assignments(ids, experts, by_sort=True), 0),
            "gather rows": (lambda: x.index_select(0, order // top_k), 0),
            "grouped_mm gate_up": (lambda: torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs),
                                   assignments * 4 * hidden * inter),
            "activation": (lambda: expert_activation(h, row_expert, PLAIN_SILU), 0),
            "grouped_mm down": (lambda: torch._grouped_mm(act, down.transpose(1, 2), offs=offs),
                                assignments * 2 * hidden * inter),
            "combine": (lambda: combine(y, dest, ids, weights, None), 0),
        }
        print(f"\nstages of the grouped path at {tokens} tokens:")
        for name, (fn, stage_flops) in stages.items():
            us = graph_call_us(lambda: fn(), [()] * 3)
            extra = f", {stage_flops / us / 1e6:.0f} TFLOPS" if stage_flops else ""
            print(f"  {name}: {us:.1f} us{extra}", flush=True)


if __name__ == "__main__":
    main()
