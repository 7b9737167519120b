"""The W4A8 GEMM (kernels/w4a8_gemm.py: INT4 operand-order words, x per token in E4M3, FP8 dots) per tiling against
cuBLAS bf16, the fused W4A16 GEMM (kernels/wna16_mma_gemm.py, its best of the engine's MMA_GEMM_VARIANTS) and FP8
W8A8 (kernels/fp8.py: the weight per channel in E4M3, cuBLASLt's _scaled_mm), at serving-concurrency rows
(M = 64 ... 1024), Llama-3.1-8B's TP1 shapes, group 128 with zero points, bf16 activations, weights streamed
from HBM (copies together over twice the L2, as kernels.wna16's load-time timing; device time from CUDA graph
replays: wna16_gemm_sweep.py's method).

Per shape and M: cuBLAS bf16 (us, TFLOPS); the W4A16 GEMM's best tiling; W8A8: the row quantize kernel alone,
_scaled_mm on quantized rows, and fp8_linear (both); W4A8: every tiling on quantized rows (the FP8 engine's norms
and activation quantize their output in the kernel that makes it; the fragment-order tilings' rows permuted as such
a kernel would write them), its best, best + the quantize kernel (for a fragment-order tiling kernels/w4a8_gemm.py's
quantizer); errors: the W4A8 tilings' least share of outputs within one rounding (ulp) of ``w4a8_reference`` (not
all: the FP8 dots accumulate in reduced precision on sm_90, as cuBLASLt's fast accumulation) and their largest
relative error (norm) against the reference and against the bf16 product of the dequantized weight (what the INT4
engine computes), and the same for W4A16 and W8A8. A tiling that fails to compile or run is recorded with its error and
skipped; ``--budget-s`` stops the sweep (outputs written after every row count).

    BENCH_COMMIT=$(git rev-parse --short HEAD) python benchmarks/quantization/w4a8_gemm_sweep.py --out sweep.json \
        --md sweep.md [--rows 256,64,512,128,1024] [--shapes gate_up,o]
    TRITON_INTERPRET=1 python benchmarks/quantization/w4a8_gemm_sweep.py --tiny --rows 40   # CPU rehearsal
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.quantization.int4_sweep_shared import SHAPES, Sweep, sweep_arguments, warm_in_processes  # noqa: E402
from kernels import fp8, wna16, wna16_mma  # noqa: E402
from kernels.fp8 import QuantizedRows  # noqa: E402
from kernels.w4a8_gemm import quantize_rows_in_fragment_order, supports, w4a8_matmul, w4a8_reference  # noqa: E402
from kernels.wna16 import MMA_GEMM_VARIANTS, dequantize, quantize, unpack_codes  # noqa: E402

GROUP = 128
# (block_n, block_m, num_warps, num_stages, split_k, block_k, weight first (the dot's A operand, in registers),
# rescale (one tile of sums, the dots accumulating into it), fragment order (the weight's codes made where the FP8
# A fragment wants them, x's columns permuted alike: no exchange through shared memory), half2 (those codes by
# inline PTX on float16 pairs: 392 instructions a 128 x 128 step's loop on sm_90 against 496); kernels/w4a8_gemm.py).
# The first H200 sweep (2026-11-30, Triton 3.6, before half2; benchmarks/results/quantization.md) made 64 x 256 of
# 4 warps in the plain order the fastest at 256-1024 rows, fragment-order 128 x 64 / 64 x 64 (split-K 4 for the
# narrow layers) at 64-128; here those, each fragment-order one beside its half2 form, and a few neighbours.
TILINGS = (
    (64, 256, 4, 3, 1, 128, 1, 1, 0, 0), (64, 256, 4, 3, 1, 128, 1, 1, 1, 1), (64, 256, 4, 3, 1, 128, 1, 1, 1, 0),
    (64, 256, 4, 4, 1, 128, 1, 1, 0, 0), (128, 256, 8, 3, 1, 128, 1, 1, 0, 0), (128, 128, 8, 3, 1, 128, 1, 1, 1, 1),
    (128, 128, 8, 3, 1, 128, 1, 1, 0, 0), (128, 64, 4, 3, 1, 128, 1, 1, 1, 1), (128, 64, 4, 3, 1, 128, 1, 1, 1, 0),
    (64, 64, 4, 3, 1, 128, 1, 1, 1, 1), (64, 64, 4, 3, 1, 128, 1, 1, 1, 0), (128, 64, 4, 3, 4, 128, 1, 1, 1, 1),
    (128, 64, 4, 3, 4, 128, 1, 1, 1, 0), (64, 128, 4, 3, 2, 128, 1, 1, 1, 1), (64, 128, 4, 3, 1, 128, 1, 1, 1, 1),
    (64, 128, 4, 3, 1, 128, 1, 1, 0, 0),
)


def tiling_options(tiling: tuple) -> dict:
    """w4a8_matmul's keyword arguments for a TILINGS tuple."""
    names = ("block_n", "block_m", "num_warps", "num_stages", "split_k", "block_k", "w_first", "rescale",
             "in_fragment_order", "half2")
    return dict(zip(names, tiling))


def main() -> None:
    parser = sweep_arguments(__doc__, "w4a8_gemm_sweep.json", "256,64,512,128,1024", 90.0, 8)
    parser.add_argument("--tilings", default=None, help="comma-separated indices into TILINGS (default: all)")
    args = parser.parse_args()
    start = time.time()
    tilings = TILINGS if not args.tilings else tuple(TILINGS[int(i)] for i in args.tilings.split(","))
    if args.warm_slice:
        _warm(*map(int, args.warm_slice.split("/")), tilings)
        return
    warm_in_processes(__file__, args, start, ["--tilings", args.tilings] if args.tilings else [])
    sweep = Sweep.from_args(args)
    device, dtype = sweep.device, sweep.dtype
    machine = "CPU (TRITON_INTERPRET=1)" if args.tiny else torch.cuda.get_device_name()
    commit = os.environ.get("BENCH_COMMIT", "unknown")
    header = [f"# W4A8 GEMM sweep, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine}, commit {commit}",
              f"Triton {_triton_version()}, torch {torch.__version__}; group {GROUP} with zero points; times in us "
              "(device time from CUDA graph replays, weights streamed from HBM); speed = cuBLAS bf16 us / us.", "",
              "| shape | M | cuBLAS bf16 us (TFLOPS) | W4A16 best us | W8A8 quant + mm us | quant us: plain / fragment "
              "order "
              "| W4A8 best: tiling, us | W4A8 / cuBLAS | W4A8+quant / cuBLAS | W4A8 / W4A16 | W4A8 share within 1 ulp "
              "| rel. err vs ref | rel. err vs bf16: W4A8, W4A16, W8A8 |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    lines = list(header)
    results: dict = {"machine": machine, "commit": commit, "tilings": [list(t) for t in tilings], "shapes": {}}
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, (n, k) in sweep.shapes_in_budget(start, args.budget_s):
            stored, scale, zero = quantize(torch.randn(n, k, device=device) * 0.02, 4, GROUP, symmetric=False)
            packed = wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero)
            exact = dequantize(stored, scale.half().float(), zero, 4)  # float32: (q - z) * s exactly
            dense = exact.to(dtype)
            exact64, dense32 = exact.double(), dense.float()
            w_q, w_scale = fp8.quantize_weight(dense)
            gemm_kernel = {"mma_words": packed["words"], "mma_meta": packed["meta"]}
            dense_copies, fp8_copies = sweep.copies(dense), sweep.copies(w_q)
            layouts = [{**packed, "words": w} for w in sweep.copies(packed["words"])]
            gemm_layouts = [{**gemm_kernel, "mma_words": w["words"]} for w in layouts]
            turn = iter(range(1 << 40))
            results["shapes"][name] = {}
            for m in sweep.rows_in_budget(name, start, args.budget_s):
                x = torch.randn(m, k, device=device, dtype=dtype)
                rows = QuantizedRows(*fp8.as_quantized_rows(x)[:2], dtype)
                permuted = quantize_rows_in_fragment_order(x)
                exact_out = (rows.values.double() @ exact64.t()) * rows.scale.double()[:, None]
                bf16_out = F.linear(x.float(), dense32)  # the INT4 engine's product, in float32

                timed = sweep.time_us

                def pick(copies):
                    return copies[next(turn) % len(copies)]

                cublas = timed(lambda: F.linear(x, pick(dense_copies)))
                quant = timed(lambda: fp8.as_quantized_rows(x))
                quant_frag = timed(lambda: quantize_rows_in_fragment_order(x))
                scaled_mm = timed(lambda: fp8.fp8_linear(rows, pick(fp8_copies), w_scale))
                w8a8 = timed(lambda: fp8.fp8_linear(x, pick(fp8_copies), w_scale))
                w8a8_err = _rel(fp8.fp8_linear(x, w_q, w_scale), bf16_out)
                w4a16, w4a16_err, failed = {}, float("nan"), {}
                for variant in MMA_GEMM_VARIANTS:
                    try:
                        options = wna16.tile_options(variant)
                        w4a16_err = _rel(wna16.wna16_matmul(x, gemm_kernel, n, 4, GROUP, **options), bf16_out)
                        w4a16[str(variant)] = timed(lambda: wna16.wna16_matmul(x, pick(gemm_layouts), n, 4, GROUP,
                                                                               **options))
                    except Exception as error:  # noqa: BLE001 - a sweep records what failed and goes on
                        failed[str(variant)] = f"{type(error).__name__}: {str(error)[:200]}"
                w4a8, ulps, ref_err, bf16_err = {}, {}, {}, {}
                for tiling in tilings:
                    options = tiling_options(tiling)
                    if not supports(k, GROUP, options["block_k"]):
                        continue
                    try:
                        given = permuted if options["in_fragment_order"] else rows  # as a quantizer would write it
                        options["x_permuted"] = True
                        out = w4a8_matmul(given, packed, n, GROUP, **options)
                        off = (out.double() - exact_out).abs() / _one_ulp(exact_out, dtype)
                        ulps[str(tiling)] = (off <= 1.0).double().mean().item()  # share within one rounding
                        ref_err[str(tiling)] = _rel(out, exact_out)
                        bf16_err[str(tiling)] = _rel(out, bf16_out)
                        w4a8[str(tiling)] = timed(lambda: w4a8_matmul(given, pick(layouts), n, GROUP, **options))
                    except Exception as error:  # noqa: BLE001
                        failed[str(tiling)] = f"{type(error).__name__}: {str(error)[:300]}"
                        print(f"{name} M={m} {tiling}: {failed[str(tiling)]}", flush=True)
                best = _best(w4a8)
                best_w4a16 = _best(w4a16)
                results["shapes"][name][m] = {
                    "cublas_us": cublas, "quant_us": quant, "quant_fragment_order_us": quant_frag,
                    "scaled_mm_us": scaled_mm, "w8a8_us": w8a8,
                    "w8a8_rel_err_vs_bf16": w8a8_err, "w4a16_us": w4a16, "w4a16_best": best_w4a16,
                    "w4a16_rel_err_vs_bf16": w4a16_err, "w4a8_us": w4a8, "w4a8_best": best,
                    "w4a8_share_within_one_rounding": ulps,
                    "w4a8_rel_err_vs_ref": ref_err, "w4a8_rel_err_vs_bf16": bf16_err, "failed": failed,
                    "reference_check": _rel(w4a8_reference(rows, packed, n, GROUP), exact_out)
                    if m == sweep.rows[0] else None}
                best_us = w4a8.get(best, float("nan"))
                best_quant = quant_frag if best and any(str(t) == best and t[8] for t in tilings) else quant
                w4a16_us = w4a16.get(best_w4a16, float("nan"))
                tflops = 2 * m * n * k / cublas / 1e6
                lines.append(
                    f"| {name} ({n}, {k}) | {m} | {cublas:.1f} ({tflops:.0f}) | {w4a16_us:.1f} | {w8a8:.1f} | "
                    f"{quant:.1f} / {quant_frag:.1f} | {best}, {best_us:.1f} "
                    f"({2 * m * n * k / best_us / 1e6:.0f}) | "
                    f"{cublas / best_us:.2f}x | {cublas / (best_us + best_quant):.2f}x | {w4a16_us / best_us:.2f}x | "
                    f"{min(ulps.values(), default=float('nan')):.3f} | "
                    f"{max(ref_err.values(), default=float('nan')):.1e} | "
                    f"{bf16_err.get(best, float('nan')):.1e}, {w4a16_err:.1e}, {w8a8_err:.1e} |")
                print(lines[-1], flush=True)
                print("   W4A8 " + "  ".join(f"{v}: {t:.1f}" for v, t in sorted(w4a8.items(), key=lambda i: i[1])),
                      flush=True)
                print(f"   W4A16 best {best_w4a16}: {w4a16_us:.1f}; _scaled_mm alone {scaled_mm:.1f}", flush=True)
                Path(args.out).write_text(json.dumps(results, indent=1))  # a timeout keeps what ran
                if args.md:
                    Path(args.md).write_text("\n".join(lines) + "\n")
            del dense_copies, fp8_copies, layouts, gemm_layouts, exact, dense, exact64, dense32
    print(f"done in {time.time() - start:.0f} s", flush=True)


def _best(times: dict) -> str | None:
    return min(times, key=lambda v: times[v] if times[v] == times[v] else 0.0) if times else None


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _one_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(values.abs().clamp(min=info.tiny)))) * info.eps


def _warm(index: int, count: int, tilings: tuple) -> None:
    """Run this process's share of the W4A8 tilings and MMA_GEMM_VARIANTS (slice 0: the quantize kernel too) once on
    the o shape, so that Triton compiles them into its disk cache (every shape here specializes alike)."""
    n, k = SHAPES["o"]
    with torch.inference_mode():
        stored, scale, zero = quantize(torch.randn(n, k, device="cuda") * 0.02, 4, GROUP, symmetric=False)
        packed = wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero)
        gemm_kernel = {"mma_words": packed["words"], "mma_meta": packed["meta"]}
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        rows = fp8.as_quantized_rows(x)
        jobs = [("w4a8", t) for t in tilings] + [("w4a16", v) for v in MMA_GEMM_VARIANTS]
        for i, (kind, variant) in enumerate(jobs):
            if i % count != index:
                continue
            try:
                if kind == "w4a8":
                    w4a8_matmul(rows, packed, n, GROUP, **tiling_options(variant))
                else:
                    wna16.wna16_matmul(x, gemm_kernel, n, 4, GROUP, **wna16.tile_options(variant))
            except Exception as error:  # noqa: BLE001 - the sweep itself records the failure
                print(f"warm {kind} {variant}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        torch.cuda.synchronize()


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


if __name__ == "__main__":
    main()
