"""Decode-sized routed experts: kernels/moe_gemv.py's two GEMV launches against the grouped path the engine takes
without them (kernels/fused_moe.py moe_forward, fused_moe_fp8.py moe_forward_fp8, fused_moe_wna16.py
moe_forward_wna16), at 1, 2, 4 and 8 tokens, Qwen3-30B-A3B's expert shape (E 128, top 8, H 2048, I 768) in bf16,
FP8 per channel, FP8 128 x 128 blocks and 4 bits in groups of 128. Exactly what the engine's load-time choice
times (kernels/moe_gemv_choice.py time_gemv: router logits in, the (T, K, H) rows out, CUDA-graph replays
alternating up to four sets of distinct experts), printed as microseconds a call and the experts' bytes over
that time (TB/s), with every GEMV candidate's time; plus the best pair's relative difference to moe_gemv_ref.

    python benchmarks/kernels/moe_gemv_bench.py [--kinds fp8_block bf16 int4 fp8] [--out moe_gemv.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402

from benchmarks.kernels import moe_decode_bench  # noqa: E402
from kernels.fused_moe import route_tokens_ref  # noqa: E402
from kernels.fused_moe_wna16 import gemv_quantization  # noqa: E402
from kernels.moe_gemv import GemvExperts, moe_gemv_ref, moe_gemv_triton  # noqa: E402
from kernels.moe_gemv_choice import routing_sets, time_gemv  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def make_experts(kind: str) -> tuple[GemvExperts, tuple]:
    """(the experts of one kind on the GPU, moe_gemv_ref's (gate_up, down, gate_up_scale, down_scale)):
    moe_decode_bench's ("fp8" there is per channel; "int4": groups of 128 in kernels/fused_moe_wna16.py's kernel
    layout, the reference on their dequantized bf16 copies)."""
    made = moe_decode_bench.make_experts(kind, EXPERTS, HIDDEN, INTER)
    if kind == "int4":
        gate_up, gate_up_dense, down, down_dense = made
        return (GemvExperts(gate_up.kernel["weight"], down.kernel["weight"], TOP_K, torch.bfloat16,
                            **gemv_quantization(gate_up, down), wna16=(gate_up, down)),
                (gate_up_dense, down_dense, None, None))
    gate_up, gu_s, down, d_s = made
    return GemvExperts(gate_up, down, TOP_K, torch.bfloat16, gu_s, d_s), (gate_up, down, gu_s, d_s)


def expert_bytes(experts: GemvExperts) -> int:
    """One expert's bytes (weights, scales, zeros)."""
    tensors = (experts.gate_up, experts.down, *experts.quantization().values())
    return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["fp8_block", "bf16", "int4", "fp8"])
    parser.add_argument("--out", default="moe_gemv.json")
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "shape": [EXPERTS, TOP_K, HIDDEN, INTER], "kinds": {}}
    print(f"{results['gpu']}: Qwen3-30B-A3B experts (E {EXPERTS}, top {TOP_K}, H {HIDDEN}, I {INTER}), "
          "routing included")
    print("| weights | tokens | grouped us | TB/s | GEMV us | TB/s | GEMV / grouped | tiles (gate_up; down) "
          "| rel. diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for kind in args.kinds:
        experts, (ref_gate_up, ref_down, ref_gu_s, ref_d_s) = make_experts(kind)
        per_expert = expert_bytes(experts)
        report = time_gemv(experts)
        rows = {}
        for tokens, grouped_us in report["grouped_us"].items():
            gemv_us = report["gemv_us"][tokens]
            best = (min(report["gate_up_us"][tokens], key=report["gate_up_us"][tokens].get),
                    min(report["down_us"][tokens], key=report["down_us"][tokens].get))
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            logits = routing_sets(tokens, EXPERTS, TOP_K, "cuda")[0].bfloat16()
            weights, ids = route_tokens_ref(logits, TOP_K, True)
            out = moe_gemv_triton(x, experts.gate_up, experts.down, top_k=TOP_K, router_logits=logits,
                                  renormalize=True, tiles=best, sum_experts=False, **experts.quantization())
            ref = moe_gemv_ref(x, ref_gate_up, ref_down, weights, ids, ref_gu_s, ref_d_s)
            # Summed over the top k: the kernel ranks a token's experts itself, so its k-th slice need not be the
            # reference's k-th (the H200 run at 22:35 compared the slices and read a difference of 1.0 everywhere).
            out, ref = out.float().sum(1), ref.float().sum(1)
            rel = ((out - ref).norm() / ref.norm()).item()
            moved = min(tokens * TOP_K, EXPERTS) * per_expert
            rows[tokens] = {"grouped_us": grouped_us, "gemv_us": gemv_us, "tiles": best, "rel_diff": rel,
                            "bytes": moved, "gate_up_us": {str(k): v for k, v in report["gate_up_us"][tokens].items()},
                            "down_us": {str(k): v for k, v in report["down_us"][tokens].items()}}
            print(f"| {kind} | {tokens} | {grouped_us:.1f} | {moved / grouped_us / 1e6:.2f} | {gemv_us:.1f} | "
                  f"{moved / gemv_us / 1e6:.2f} | {gemv_us / grouped_us:.2f} | {best[0]}; {best[1]} | {rel:.1e} |")
        for tokens, row in rows.items():
            print(f"  {kind} {tokens} token(s): gate_up candidates (down {row['tiles'][1]}) "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row["gate_up_us"].items())
                  + "; down candidates " + ", ".join(f"{k} {v:.1f}" for k, v in row["down_us"].items()))
        results["kinds"][kind] = rows
        del experts, ref_gate_up, ref_down, ref_gu_s, ref_d_s
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
