"""MXFP4 fused MoE (kernels/fused_moe_mxfp4.py) against the bf16 fused MoE (kernels/fused_moe.py) on
gpt-oss-20b's experts (E=32, top-4, H=2880, I=2880, biases, clamped SwiGLU), microseconds per call
from CUDA graph replays, routing included. Each graph holds ``REPEAT`` calls on different tokens and
router logits (so different experts: the weights come from HBM, not L2). The bf16 experts are the
MXFP4 experts widened, so both compute the same MLP; the relative difference is printed.

    python benchmarks/quantization/moe_mxfp4_bench.py [--sweep] [--tokens 1 8 64 512 2048 8192] [--json out.json]

--sweep also times candidate tilings of each size (FMA tiles for few assignments, grouped-GEMM
tiles, the widen-then-bf16-GEMMs path), stopping after --sweep_seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402

from kernels.fused_moe import choose_block_m, moe_forward, route_tokens  # noqa: E402
from kernels.fused_moe_mxfp4 import (FMA_MAX_ASSIGNMENTS, dequantize_mxfp4_triton,  # noqa: E402
                                     fused_moe_mxfp4_triton, moe_forward_mxfp4, moe_single_token_mxfp4_triton,
                                     prepare_mxfp4_experts)
from benchmarks.common import graph_call_us  # noqa: E402
from kernels.moe_epilogue import ExpertEpilogue  # noqa: E402

E, TOP_K, H, I = 32, 4, 2880, 2880
SWIGLU_LIMIT = 7.0
REPEAT = 10


def random_experts(rows: int, cols: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (every byte alike) and exponents 120-122: weights of std ~ 2^-6, O(1) outputs."""
    codes = torch.randint(0, 256, (E, rows, cols // 2), device="cuda", dtype=torch.uint8, generator=generator)
    scales = torch.randint(120, 123, (E, rows, cols // 32), device="cuda", dtype=torch.uint8, generator=generator)
    return codes, scales


def candidates(tokens: int) -> dict[str, dict]:
    """Name -> config of fused_moe_mxfp4_triton / moe_single_token_mxfp4_triton."""
    out = {}
    if tokens * TOP_K <= FMA_MAX_ASSIGNMENTS:
        for gu, dn in (((16, 1, 4), (16, 1, 4)), ((16, 2, 4), (16, 2, 4)), ((32, 2, 4), (32, 2, 4)),
                       ((8, 4, 4), (16, 4, 4)), ((16, 4, 4), (32, 4, 4)), ((32, 1, 4), (32, 1, 4)),
                       ((16, 2, 2), (16, 2, 2)), ((64, 1, 8), (64, 1, 8))):
            out[f"fma gu{gu} dn{dn}"] = {"fma": {"gate_up": gu, "down": dn}}
    block_m = 16 if tokens == 1 else choose_block_m(tokens * TOP_K, E)
    for bn in (32, 64, 128):
        for bk in (32, 64):
            for swap in (False, True):
                if block_m == 16 and (swap or bn == 128):
                    continue
                if block_m > 16 and (not swap or bn == 32):
                    continue
                warps = 8 if bn == 128 and block_m == 64 else 4
                stages = 3 if bn == 128 else 4
                out[f"gemm bn{bn} bk{bk} swap{int(swap)} w{warps}"] = {
                    "fma": None, "gemm": {"BLOCK_N": bn, "BLOCK_K": bk, "SWAP_AB": swap, "num_warps": warps,
                                          "num_stages": stages}}
    if tokens >= 512:
        out["widen + bf16 GEMMs"] = {"dequantize_min_rows": 1}
    return out


def widen_sweep(experts, dense) -> None:
    """Microseconds to widen both projections' experts per _dequantize_kernel tiling (checked equal)."""
    print(f"device: {torch.cuda.get_device_name()}")
    for tiles in ((32, 64, 4), (32, 32, 4), (64, 32, 4), (64, 64, 4), (64, 64, 8), (128, 32, 4), (128, 64, 8),
                  (16, 64, 2), (32, 32, 2), (128, 32, 8)):
        try:
            same = all(torch.equal(dequantize_mxfp4_triton(e, torch.bfloat16, tiles), d) for e, d in zip(experts, dense))
            us = graph_call_us(lambda: [dequantize_mxfp4_triton(e, torch.bfloat16, tiles) for e in experts], [()])
            print(f"    widen tiles {tiles}: {us:.1f} us (equal: {same})", flush=True)
        except Exception as exc:  # a tiling that does not compile or fit
            print(f"    widen tiles {tiles}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048, 8192])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep_seconds", type=float, default=1e9)
    parser.add_argument("--json", default=None)
    parser.add_argument("--widen_sweep", action="store_true", help="time only the widening kernel's tiles")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    stored = [random_experts(2 * I, H, generator), random_experts(H, I, generator)]
    experts = [prepare_mxfp4_experts(*s, torch.bfloat16) for s in stored]
    dense = [dequantize_mxfp4_triton(e, torch.bfloat16) for e in experts]
    del stored
    bias = (torch.randn(E, 2 * I, device="cuda", dtype=torch.bfloat16) * 0.1,
            torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.1)
    kwargs = dict(gate_up_bias=bias[0], down_bias=bias[1], activation="swiglu_clamped", swiglu_limit=SWIGLU_LIMIT)
    epilogue = ExpertEpilogue(*bias, "swiglu_clamped", SWIGLU_LIMIT)
    device = torch.cuda.get_device_name()
    if args.widen_sweep:
        widen_sweep(experts, dense)
        return
    results = {"device": device, "rows": []}
    print(f"device: {device}")
    print("| T | bf16 us | mxfp4 us | mxfp4/bf16 | rel diff |")
    started = time.time()
    for tokens in args.tokens:
        inputs = [(torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16),
                   torch.randn(tokens, E, device="cuda", dtype=torch.bfloat16)) for _ in range(REPEAT)]
        bf16 = graph_call_us(lambda x, lg: moe_forward(x, lg, *dense, TOP_K, True, **kwargs), inputs)
        mxfp4 = graph_call_us(lambda x, lg: moe_forward_mxfp4(x, lg, *experts, TOP_K, True, **kwargs), inputs)
        x, lg = inputs[0]
        ref = moe_forward(x, lg, *dense, TOP_K, True, **kwargs).float()
        diff = ((moe_forward_mxfp4(x, lg, *experts, TOP_K, True, **kwargs).float() - ref).norm() / ref.norm()).item()
        row = {"T": tokens, "bf16_us": bf16, "mxfp4_us": mxfp4, "rel_diff": diff, "sweep": {}}
        print(f"| {tokens} | {bf16:.1f} | {mxfp4:.1f} | {mxfp4 / bf16:.2f} | {diff:.1e} |", flush=True)
        results["rows"].append(row)
        if args.sweep:
            for name, config in candidates(tokens).items():
                if time.time() - started > args.sweep_seconds:
                    print("    (sweep time is up)", flush=True)
                    break
                try:
                    if tokens == 1:
                        def fn(x, lg, c=config):
                            return moe_single_token_mxfp4_triton(x, lg, *experts, TOP_K, True, config=c,
                                                                 epilogue=epilogue)
                    else:
                        def fn(x, lg, c=config):
                            w, ids = route_tokens(lg, TOP_K, True)
                            return fused_moe_mxfp4_triton(x, *experts, w, ids, config=c, epilogue=epilogue)
                    err = ((fn(x, lg).float() - ref).norm() / ref.norm()).item()
                    us = graph_call_us(fn, inputs)
                    row["sweep"][name] = [us, err]
                    print(f"    {name}: {us:.1f} us (err {err:.1e})", flush=True)
                except Exception as exc:  # a tiling that does not compile or fit
                    print(f"    {name}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        del inputs
    if tokens >= 2048:
        widen = graph_call_us(lambda: [dequantize_mxfp4_triton(e, torch.bfloat16) for e in experts], [()])
        print(f"widening both projections' experts: {widen:.1f} us")


if __name__ == "__main__":
    main()
