"""Decode-sized routed experts: kernels/moe_gemv.py's two GEMV launches against the grouped path the engine takes
without them (kernels/fused_moe.py moe_forward, fused_moe_fp8.py moe_forward_fp8, fused_moe_wna16.py
moe_forward_wna16), at 1, 2, 4 and 8 tokens, Qwen3-30B-A3B's expert shape (E 128, top 8, H 2048, I 768) in bf16,
FP8 per channel, FP8 128 x 128 blocks and 4 bits in groups of 128. Exactly what the engine's load-time choice
times (kernels/moe_gemv_choice.py time_gemv: router logits in, the (T, K, H) rows out, CUDA-graph replays
alternating up to four sets of distinct experts), printed as microseconds a call and the experts' bytes over
that time (TB/s), with every GEMV candidate's time; plus the best pair's relative difference to moe_gemv_ref.

    python benchmarks/kernels/moe_gemv_bench.py [--kinds fp8_block bf16 int4 fp8] [--out moe_gemv.json]
        [--gemv-tiles 16,128,1,4,db 16,512,1,3,db ...]  (these tiles instead of the load-time candidates)

--model gpt_oss_20b: gpt-oss-20b's experts instead (E 32, top 4, H 2880, I 2880, both biases, the clamped SwiGLU
7), kinds mxfp4 (kernels/fused_moe_mxfp4.py's kernel layout; the grouped path is its FMA kernel at 1 token) and
bf16: beside the grouped path and moe_gemv's pair, kernels/mxfp4_gemv.py's word path with each of its candidates
(the load-time choice's timing), in us and GB/s of the experts' bytes (MXFP4: codes and exponents; "codes GB/s"
the word path's, the codes alone). --gemv-candidates N times only moe_gemv's first N candidates, --word-tiles
N,G,W[,OPTIONS] ... only those of the word path (the device call's time: a compile each), --tokens only those
counts. --launches: each word-path launch's own device time besides (the best pair, eager, PDL off so that no
kernel's time includes its wait for the one before, under torch.profiler; the sum against the graph's time shows
the launches' gaps).
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
GPT_OSS_20B = dict(experts=32, top_k=4, hidden=2880, inter=2880, swiglu_limit=7.0)


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
    """One expert's bytes (weights, scales, zeros; not the epilogue's biases)."""
    tensors = (experts.gate_up, experts.down, *experts.quantization().values())
    return sum(t[0].numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def gpt_oss_experts(kind: str) -> tuple[GemvExperts, tuple, int]:
    """(gpt-oss-20b's experts of ``kind`` (mxfp4, bf16) with random codes / weights, random biases and the clamped
    SwiGLU, (moe_gemv_ref's gate_up, down in bf16, its epilogue in float32), the codes' bytes an expert (bf16:
    the weights')."""
    from kernels.fused_moe_mxfp4 import dequantize_mxfp4_experts, prepare_mxfp4_experts
    from kernels.moe_epilogue import ExpertEpilogue

    shape = GPT_OSS_20B
    experts, hidden, inter = shape["experts"], shape["hidden"], shape["inter"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    biases = [torch.randn(experts, n, device="cuda", generator=gen).mul(0.1).bfloat16() for n in (2 * inter, hidden)]
    epilogue = ExpertEpilogue(*biases, "swiglu_clamped", shape["swiglu_limit"])
    ref_epilogue = ExpertEpilogue(*[b.float() for b in biases], "swiglu_clamped", shape["swiglu_limit"])
    stored = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        codes = torch.randint(0, 256, (experts, rows, cols // 2), device="cuda", generator=gen, dtype=torch.uint8)
        scales = torch.randint(120, 123, (experts, rows, cols // 32), device="cuda", generator=gen,
                               dtype=torch.uint8)  # weights ~ 2^-6 times up to 6
        stored.append((codes, scales))
    dense = [dequantize_mxfp4_experts(*w, torch.bfloat16) for w in stored]
    if kind == "bf16":
        entry = GemvExperts(dense[0], dense[1], shape["top_k"], torch.bfloat16, epilogue=epilogue)
        return entry, (dense[0], dense[1], ref_epilogue), dense[0][0].numel() * 2 + dense[1][0].numel() * 2
    kernel = [prepare_mxfp4_experts(*w, torch.bfloat16, for_kernel=True) for w in stored]
    entry = GemvExperts(kernel[0].kernel["codes"], kernel[1].kernel["codes"], shape["top_k"], torch.bfloat16,
                        kernel[0].kernel["scales"], kernel[1].kernel["scales"], mxfp4=tuple(kernel), epilogue=epilogue)
    return entry, (dense[0], dense[1], ref_epilogue), stored[0][0][0].numel() + stored[1][0][0].numel()


def launch_times(run, calls: int = 40) -> dict[str, float]:
    """{kernel name: mean device us a call} of ``calls`` eager run() calls with PDL off (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from kernels import _triton

    before = _triton._pdl_enabled
    _triton.set_pdl(False)
    try:
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                run()
            torch.cuda.synchronize()
    finally:
        _triton._pdl_enabled = before
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            name = event.name if len(event.name) < 40 else event.name[:37] + "..."
            totals[name] = totals.get(name, 0.0) + event.time_range.elapsed_us()
    return {name: us / calls for name, us in totals.items()}


def gpt_oss_main(args) -> None:
    """The --model gpt_oss_20b sweep (module docstring)."""
    from kernels import moe_gemv_choice
    from kernels.mxfp4_gemv import mxfp4_words_triton

    if args.gemv_candidates:
        full = moe_gemv_choice.candidate_tiles
        moe_gemv_choice.candidate_tiles = lambda kind: full(kind)[:args.gemv_candidates]
    if args.word_tiles:
        moe_gemv_choice.WORD_TILES = tuple(tuple(int(v) if i < 3 else v for i, v in enumerate(t.split(",")))
                                           for t in args.word_tiles)  # N,G,W[,options]
    shape = GPT_OSS_20B
    experts_n, top_k, hidden = shape["experts"], shape["top_k"], shape["hidden"]
    results = {"gpu": torch.cuda.get_device_name(), "shape": shape, "kinds": {}}
    print(f"{results['gpu']}: gpt-oss-20b experts (E {experts_n}, top {top_k}, H {hidden}, I {shape['inter']}, "
          "biases, clamped SwiGLU), routing included")
    print("| weights | tokens | grouped us | GEMV pair us | words us | best GB/s | words: codes GB/s | words tiles "
          "| words rel. diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for kind in args.kinds:
        entry, (ref_gate_up, ref_down, ref_epilogue), codes_bytes = gpt_oss_experts(kind)
        per_expert = expert_bytes(entry)
        rows = {}
        for tokens in args.tokens or moe_gemv_choice.TIMED_TOKENS:  # one count at a time: each row printed when timed
            timed = moe_gemv_choice.TIMED_TOKENS
            moe_gemv_choice.TIMED_TOKENS = (tokens,)
            try:
                report = moe_gemv_choice.time_gemv(entry)
            finally:
                moe_gemv_choice.TIMED_TOKENS = timed
            grouped_us = report["grouped_us"][tokens]
            gemv_us = report["gemv_us"][tokens]
            words_us = report.get("words_us", {}).get(tokens)
            best_us = min(us for us in (grouped_us, gemv_us, words_us) if us is not None)
            moved = min(tokens * top_k, experts_n)
            row = {"grouped_us": grouped_us, "gemv_us": gemv_us, "words_us": words_us, "mark": report["tiles"][tokens],
                   "gate_up_us": {str(k): v for k, v in report["gate_up_us"][tokens].items()},
                   "down_us": {str(k): v for k, v in report["down_us"][tokens].items()}}
            tiles, rel = "-", float("nan")
            if words_us is not None:
                gu, dn = report["words_gate_up_us"][tokens], report["words_down_us"][tokens]
                best = (min(gu, key=gu.get), min(dn, key=dn.get))
                row.update(words_gate_up_us={str(k): v for k, v in gu.items()},
                           words_down_us={str(k): v for k, v in dn.items()}, words_tiles=best)
                x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
                logits = moe_gemv_choice.routing_sets(tokens, experts_n, top_k, "cuda")[0].bfloat16()
                weights, ids = route_tokens_ref(logits, top_k, True)
                out = mxfp4_words_triton(x, entry.gate_up, entry.down, entry.gate_up_scale, entry.down_scale,
                                         top_k=top_k, epilogue=entry.epilogue, router_logits=logits, renormalize=True,
                                         tiles=best)
                ref = moe_gemv_ref(x, ref_gate_up, ref_down, weights, ids, epilogue=ref_epilogue).float().sum(1)
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                tiles = f"{best[0]}; {best[1]}"
            row["rel_diff"] = rel
            if args.launches and words_us is not None:
                sets = [s.bfloat16() for s in moe_gemv_choice.routing_sets(tokens, experts_n, top_k, "cuda")]
                turn = [0]

                def words_call() -> None:
                    turn[0] += 1
                    mxfp4_words_triton(x, entry.gate_up, entry.down, entry.gate_up_scale, entry.down_scale,
                                       top_k=top_k, epilogue=entry.epilogue,
                                       router_logits=sets[turn[0] % len(sets)], renormalize=True,
                                       tiles=best)

                row["launch_us"] = launch_times(words_call)
            rows[tokens] = row
            results["kinds"][kind] = rows
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))  # (kept if the call runs out)
            print(f"| {kind} | {tokens} | {grouped_us:.1f} | {gemv_us or float('nan'):.1f} | "
                  f"{words_us or float('nan'):.1f} | {moved * per_expert / best_us / 1e3:.0f} | "
                  f"{moved * codes_bytes / (words_us or float('nan')) / 1e3:.0f} | {tiles} | {rel:.1e} |", flush=True)
            if "launch_us" in row:
                print(f"  {kind} {tokens} token(s) launches (eager, PDL off; sum "
                      f"{sum(row['launch_us'].values()):.1f} us): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in row["launch_us"].items()), flush=True)
            for name in ("gate_up_us", "down_us", "words_gate_up_us", "words_down_us"):
                if name in row:
                    print(f"  {kind} {tokens} token(s) {name}: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in row[name].items()), flush=True)
        results["kinds"][kind] = rows
        del entry, ref_gate_up, ref_down
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))


def parse_tiles(specs: list[str]) -> tuple:
    """--gemv-tiles' "N,K,W,S[,options]" strings as moe_gemv tile tuples: (16, 512, 1, 3, 'db')."""
    return tuple(tuple(int(v) if i < 4 else v for i, v in enumerate(spec.split(","))) for spec in specs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=None)
    parser.add_argument("--model", choices=["qwen3_30b_a3b", "gpt_oss_20b"], default="qwen3_30b_a3b")
    parser.add_argument("--gemv-candidates", type=int, default=0)
    parser.add_argument("--word-tiles", nargs="+", default=None)
    parser.add_argument("--gemv-tiles", nargs="+", default=None,
                        help="time these moe_gemv tiles, N,K,W,S[,options] each (e.g. 16,512,1,3,db: "
                             "kernels/moe_gemv.py WIDE_STEP_TILES), instead of the load-time candidates")
    parser.add_argument("--tokens", nargs="+", type=int, default=None, help="these token counts only")
    parser.add_argument("--launches", action="store_true", help="gpt_oss_20b: the word path's launches timed apart")
    parser.add_argument("--out", default="moe_gemv.json")
    args = parser.parse_args()
    if args.model == "gpt_oss_20b":
        args.kinds = args.kinds or ["mxfp4", "bf16"]
        gpt_oss_main(args)
        return
    args.kinds = args.kinds or ["fp8_block", "bf16", "int4", "fp8"]
    from kernels import moe_gemv_choice
    if args.tokens:  # (the load-time choice's counts: these only)
        moe_gemv_choice.TIMED_TOKENS = tuple(args.tokens)
    if args.gemv_tiles:
        chosen = parse_tiles(args.gemv_tiles)
        moe_gemv_choice.candidate_tiles = lambda kind: chosen
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
