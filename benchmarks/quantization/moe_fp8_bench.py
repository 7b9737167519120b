"""FP8 fused MoE (kernels/fused_moe_fp8.py) against the bf16 fused MoE (kernels/fused_moe.py) on
Qwen3-30B-A3B's experts (E=128, top-8, H=2048, I=768), microseconds per call from CUDA graph
replays, routing included. Each graph holds ``REPEAT`` calls on different tokens and router logits
(so different experts: the weights come from HBM, not L2). The bf16 experts are the per-channel FP8
experts dequantized, so both compute the same MLP; the relative difference is printed.

Columns: bf16 (kernels.fused_moe.moe_forward); FP8 per channel on the Triton grouped GEMM; FP8 per
channel on torch._scaled_grouped_mm (sm90); FP8 per channel as the engine dispatches it (moe_forward_fp8:
the faster of the two by SCALED_GROUPED_MM_MIN_ASSIGNMENTS); FP8 with 128 x 128 block scales (Triton).

    python benchmarks/quantization/moe_fp8_bench.py [--tokens 1 8 64 512 2048 8192] [--json out.json] [--sweep 1 8]

--sweep T...: instead, time candidate tilings of the Triton grouped GEMM at those token counts (both
granularities). --sweep_prefill T...: the block-scaled kernel's prefill-size tilings (PREFILL_TILES),
block_m included.

H200, 2026-11-26, one lease. Full run (the decode tiles then 32 x 4 warps x 4 stages, and activations
of up to 16 tokens quantized inside the GEMM, since removed): bf16 29.6 / 132.1 / 308.7 / 433.7 /
735.1 / 1,619.1 us at 1 / 8 / 64 / 512 / 2,048 / 8,192 tokens; FP8 per channel on Triton 90.8 (8
tokens) / 191.3 / 302.9 / 530.9 / 1,528.3, on _scaled_grouped_mm 161.7 / 301.0 / 346.1 / 522.4 /
1,296.6; blocks 194.4 (64) / 370.4 / 728.5 / 2,373.8; relative difference to bf16 4.6-4.8e-2.
Sweep at 1 / 8 tokens, tiles (BLOCK_N, warps, stages): (32, 2, 5) 26.5 / 86.2 per channel, 25.7 /
87.3 blocks, the best or within 1 us of it (fp8_gemm_config's choice); (32, 4, 4) 27.1 / 90.2;
(16, 4, 3) 32.9 / 121.0; quantizing inside the GEMM at one token 30.1-53.8.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402

from kernels.fp8_block import quantize_blocks  # noqa: E402
from kernels.fused_moe import moe_forward, route_tokens  # noqa: E402
from kernels.fused_moe_fp8 import (dequantize_experts, fused_moe_fp8_grouped_mm, fused_moe_fp8_triton,  # noqa: E402
                                   moe_forward_fp8, moe_single_token_fp8_triton, scaled_grouped_mm_supported)
from kernels.fp8 import quantize_rows  # noqa: E402
from benchmarks.common import graph_call_us  # noqa: E402

E, TOP_K, H, I = 128, 8, 2048, 768
REPEAT = 10


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
    return codes.view(w.shape), scale.view(w.shape[:2])


def routed(kernel, **options):
    """fn(x, logits) that routes with route_tokens and then runs ``kernel`` (a fused_moe_fp8_* entry)."""
    def run(x, logits, experts):
        weights, ids = route_tokens(logits, TOP_K, True)
        return kernel(x, *experts, weights, ids, **options)
    return run


SWEEP_TILES = [{"BLOCK_N": bn, "num_warps": w, "num_stages": st}
               for bn, w, st in ((32, 4, 4), (16, 2, 4), (16, 4, 3), (32, 2, 5), (32, 4, 6), (64, 4, 4), (64, 8, 3))]


# Prefill-size tilings of the block-scaled kernel: (block_m, BLOCK_N, warps, stages).
PREFILL_TILES = [(64, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2),
                 (32, 64, 4, 4), (32, 64, 4, 3)]


def sweep_prefill(tokens_list, block_experts) -> dict:
    """Tilings of the block-scaled Triton path at prefill-size token counts (PREFILL_TILES): name -> us."""
    out = {}
    for tokens in tokens_list:
        inputs = [(torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16),
                   torch.randn(tokens, E, device="cuda", dtype=torch.bfloat16)) for _ in range(REPEAT)]
        for block_m, block_n, warps, stages in PREFILL_TILES:
            config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            run = routed(fused_moe_fp8_triton, block_m=block_m, config=config)
            name = f"T{tokens} block m{block_m} bn{block_n} w{warps} s{stages}"
            try:
                out[name] = graph_call_us(lambda x, lg: run(x, lg, block_experts), inputs)
                print(f"    {name}: {out[name]:.1f} us", flush=True)
            except Exception as exc:  # a tiling that does not compile or fit
                print(f"    {name}: failed {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return out


def sweep(tokens_list, experts: dict) -> dict:
    """Candidate tilings of the Triton path at small token counts: name -> us."""
    out = {}
    for tokens in tokens_list:
        inputs = [(torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16),
                   torch.randn(tokens, E, device="cuda", dtype=torch.bfloat16)) for _ in range(REPEAT)]
        for granularity, stored in experts.items():
            for config in SWEEP_TILES:
                if tokens == 1:
                    def fn(x, lg, c=config):
                        return moe_single_token_fp8_triton(x, lg, *stored, TOP_K, True, config=c)
                else:
                    fn = (lambda f: lambda x, lg: f(x, lg, stored))(routed(fused_moe_fp8_triton, config=config))
                name = f"T{tokens} {granularity} bn{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}"
                try:
                    out[name] = graph_call_us(fn, inputs)
                    print(f"    {name}: {out[name]:.1f} us", flush=True)
                except Exception as exc:  # a tiling that does not compile or fit
                    print(f"    {name}: failed {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048, 8192])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", type=int, nargs="*", default=None)
    parser.add_argument("--sweep_prefill", type=int, nargs="*", default=None,
                        help="token counts: time PREFILL_TILES of the block-scaled kernel")
    args = parser.parse_args()
    torch.manual_seed(0)
    channel, block = [], []
    for n, k in ((2 * I, H), (H, I)):
        w = torch.randn(E, n, k, device="cuda") * k**-0.5
        channel += per_channel(w)
        block += quantize_blocks(w)
        del w
    device = torch.cuda.get_device_name()
    if args.sweep or args.sweep_prefill:
        print(f"device: {device}; us per call (CUDA graphs of {REPEAT} calls)")
        times = sweep(args.sweep or [], {"channel": channel, "block": block})
        times.update(sweep_prefill(args.sweep_prefill or [], block))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "sweep": times}, f, indent=1)
        return
    dense = [dequantize_experts(*channel[:2]).bfloat16(), dequantize_experts(*channel[2:]).bfloat16()]
    results = {"device": device, "rows": []}
    print(f"device: {device}; us per call (CUDA graphs of {REPEAT} calls)")
    print("| T | bf16 | fp8 channel Triton | fp8 channel _scaled_grouped_mm | fp8 channel (engine) | fp8 block | "
          "engine channel / bf16 | engine block / bf16 | rel diff (channel) |")
    for tokens in args.tokens:
        inputs = [(torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16),
                   torch.randn(tokens, E, device="cuda", dtype=torch.bfloat16)) for _ in range(REPEAT)]
        row = {"T": tokens}
        row["bf16"] = graph_call_us(lambda x, lg: moe_forward(x, lg, *dense, TOP_K, True), inputs)
        if tokens > 1:  # one token: its own path (routing inside gate_up), which the engine column times
            fn = routed(fused_moe_fp8_triton)
            row["channel_triton"] = graph_call_us(lambda x, lg: fn(x, lg, channel), inputs)
            if scaled_grouped_mm_supported(inputs[0][0], *channel[:2]):
                fn = routed(fused_moe_fp8_grouped_mm)
                row["channel_scaled_grouped_mm"] = graph_call_us(lambda x, lg: fn(x, lg, channel), inputs)
        row["channel"] = graph_call_us(lambda x, lg: moe_forward_fp8(x, lg, *channel, TOP_K, True), inputs)
        row["block"] = graph_call_us(lambda x, lg: moe_forward_fp8(x, lg, *block, TOP_K, True), inputs)
        x, lg = inputs[0]
        ref = moe_forward(x, lg, *dense, TOP_K, True).float()
        got = moe_forward_fp8(x, lg, *channel, TOP_K, True).float()
        row["rel_diff"] = ((got - ref).norm() / ref.norm()).item()
        cells = [f"{row.get(key, float('nan')):.1f}" for key in
                 ("bf16", "channel_triton", "channel_scaled_grouped_mm", "channel", "block")]
        print(f"| {tokens} | " + " | ".join(cells) + f" | {row['channel'] / row['bf16']:.2f} | "
              f"{row['block'] / row['bf16']:.2f} | {row['rel_diff']:.1e} |", flush=True)
        results["rows"].append(row)
        del inputs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
