"""W4A16 fused MoE (kernels/fused_moe_wna16.py) against the bf16 fused MoE (kernels/fused_moe.py) on
Qwen3-30B-A3B's experts (E=128, top-8, H=2048, I=768, int4 group 128), microseconds per call from
CUDA graph replays, routing included. Each graph holds ``REPEAT`` calls on different tokens and
router logits (so different experts: the weights come from HBM, not L2). The bf16 experts are the
int4 experts dequantized, so both compute the same MLP; the relative difference is printed.

    python benchmarks/quantization/moe_wna16_bench.py [--sweep] [--tokens 1 8 64 512 4096]

--sweep also times the candidate tilings of each size (the table in wna16_gemm_config and
SINGLE_TOKEN_TILES comes from such a run) and the unfactored kernels (dequantize each weight).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402

from kernels.fused_moe import choose_block_m, moe_forward, route_tokens  # noqa: E402
from kernels.fused_moe_wna16 import (SINGLE_TOKEN_TILES, fused_moe_wna16_triton, moe_forward_wna16,  # noqa: E402
                                     moe_single_token_wna16_triton, prepare_wna16_experts, wna16_gemm_config)
from benchmarks.common import graph_call_us  # noqa: E402
from kernels.wna16 import dequantize, quantize  # noqa: E402

E, TOP_K, H, I, GROUP = 128, 8, 2048, 768, 128
REPEAT = 10


def candidates(tokens: int) -> dict[str, dict]:
    """Name -> config for fused_moe_wna16_triton / moe_single_token_wna16_triton."""
    if tokens == 1:
        out = {"grouped": {**wna16_gemm_config(16, 4), "single_token": {}},
               "unfactored": {**wna16_gemm_config(16, 4), "FACTORED": False, "single_token": {}}}
        for gu, dn in (((16, 32, 4), (32, 32, 4)), ((32, 32, 4), (64, 32, 4)), ((8, 32, 2), (16, 32, 2)),
                       ((16, 16, 2), (32, 16, 2)), ((16, 32, 2), (32, 32, 2)), ((8, 64, 4), (16, 64, 4))):
            out[f"fma gu{gu} dn{dn}"] = {**wna16_gemm_config(16, 4), "single_token": {"gate_up": gu, "down": dn}}
        return out
    block_m = choose_block_m(tokens * TOP_K, E)
    base = wna16_gemm_config(block_m, 4)
    out = {"unfactored": {**base, "FACTORED": False}}
    for bn in (32, 64, 128):
        for bk in (32, 64, 128):
            for swap in (False, True):
                if block_m == 16 and (swap or bn == 128 or bk == 32):
                    continue
                if block_m > 16 and (not swap or bn == 32):
                    continue
                warps = 8 if bn == 128 and block_m == 64 else 4
                out[f"bn{bn} bk{bk} swap{int(swap)} w{warps}"] = {
                    "BLOCK_N": bn, "BLOCK_K": bk, "SWAP_AB": swap, "num_warps": warps,
                    "num_stages": 3 if bn == 128 else 4}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    stored = []
    for n, k in ((2 * I, H), (H, I)):
        w = torch.randn(E, n, k, device="cuda") * k**-0.5
        stored.append(quantize(w, 4, GROUP, symmetric=False))
        del w
    experts = [prepare_wna16_experts(*s, 4, torch.bfloat16) for s in stored]
    dense = [dequantize(*s, 4, torch.bfloat16) for s in stored]
    del stored
    device = torch.cuda.get_device_name()
    results = {"device": device, "rows": []}
    print(f"device: {device}")
    print("| T | bf16 us | int4 us | int4/bf16 | rel diff |")
    for tokens in args.tokens:
        inputs = [(torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16),
                   torch.randn(tokens, E, device="cuda", dtype=torch.bfloat16)) for _ in range(REPEAT)]
        bf16 = graph_call_us(lambda x, lg: moe_forward(x, lg, *dense, TOP_K, True), inputs)
        int4 = graph_call_us(lambda x, lg: moe_forward_wna16(x, lg, *experts, TOP_K, True), inputs)
        x, lg = inputs[0]
        ref = moe_forward(x, lg, *dense, TOP_K, True).float()
        diff = ((moe_forward_wna16(x, lg, *experts, TOP_K, True).float() - ref).norm() / ref.norm()).item()
        row = {"T": tokens, "bf16_us": bf16, "int4_us": int4, "rel_diff": diff, "sweep": {}}
        print(f"| {tokens} | {bf16:.1f} | {int4:.1f} | {int4 / bf16:.2f} | {diff:.1e} |", flush=True)
        if args.sweep:
            for name, config in candidates(tokens).items():
                try:
                    if tokens == 1:
                        fn = lambda x, lg, c=config: moe_single_token_wna16_triton(x, lg, *experts, TOP_K, True, config=c)
                    else:
                        def fn(x, lg, c=config):
                            w, ids = route_tokens(lg, TOP_K, True)
                            return fused_moe_wna16_triton(x, *experts, w, ids, config=c)
                    got = fn(x, lg).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    us = graph_call_us(fn, inputs)
                    row["sweep"][name] = [us, err]
                    print(f"    {name}: {us:.1f} us (err {err:.1e})", flush=True)
                except Exception as exc:  # a tiling that does not compile or fit
                    print(f"    {name}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        results["rows"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
