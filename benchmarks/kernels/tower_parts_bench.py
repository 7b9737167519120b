"""The non-GEMM parts of a Qwen2.5-VL-7B tower block (engine/vision/qwen2_5_vl.py), each against what could
replace it, at one forward's patch count (32 images of 448 x 448: 32,768 patches, width 1280, 16 heads of 80,
windows of 64 patches, frames of 1,024), bf16, one GPU. Device milliseconds of one call (``graph_ms``: a CUDA graph
of it replayed 20 times between events; the old window path's qkv copy, which only this bench needs, subtracted):

- ``window``: a window block's rotary in place + SDPA per window (planless: flash), against
  kernels/window_attention.py (rotary and attention in one kernel from the qkv product) at WINDOW_TILINGS; the kernel's largest difference from the old path is printed (bf16: a few rounding steps);
- ``frame``: a full-frame block's rotary + SDPA (for scale: what the kernel does not take);
- ``residual``: the proj and down products with their bias then the RMSNorm adding the residual (reads 2, writes 2 rows), against
  the residual added by the product (``addmm_`` in place, beta = 1) then a norm of one input (the bias would ride
  in the norm as a column vector: not timed, a few bytes).

    python benchmarks/kernels/tower_parts_bench.py --out tower_parts.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import git_commit, utc_now  # noqa: E402
from engine.vision.qwen2_vl import segment_attention  # noqa: E402
from engine.vision.tower_layout import PatchRotary, Segments  # noqa: E402
from kernels.linear import replay_time_ms  # noqa: E402
from kernels.rmsnorm import rms_norm  # noqa: E402
from kernels.window_attention import TILING_ENV, window_attention  # noqa: E402


WINDOW_TILINGS = ((1, 4), (1, 8), (2, 4), (2, 8), (4, 8))  # (heads a program, warps)


def graph_ms(fn, replays: int = 20) -> float:
    """Device milliseconds of one fn() call: fn captured in a CUDA graph (after an eager call on a side stream that
    compiles whatever it compiles), the graph replayed ``replays`` times between CUDA events: the host's launch
    overheads do not count (an eager call of a few-microsecond kernel measured its Python launch too)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_time_ms(graph, replays)


def wall_ms(fn, repeat: int = 3) -> float:
    import time

    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat * 1000


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patches", type=int, default=32768)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--frame", type=int, default=1024)
    p.add_argument("--mlp", type=int, default=3456, help="the down product's input width (padded MLP)")
    p.add_argument("--parts", default="window,residual,frame", help="which (they run window, frame, residual)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the code (small --patches; wall times)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dev, dtype, dim, heads = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32, 1280, 16
    timed = graph_ms if dev == "cuda" else wall_ms
    n = args.patches
    parts = args.parts.split(",")
    results: dict = {"date": utc_now(), "commit": git_commit(), "patches": n, "device": torch.cuda.get_device_name() if dev == "cuda" else dev}
    qkv = torch.randn(n, 3 * dim, device=dev, dtype=dtype)
    angles = torch.rand(n, dim // heads // 2, device=dev) * 30
    rotary = PatchRotary(table=torch.cat([angles.cos(), angles.sin()], dim=-1))
    work = torch.empty_like(qkv)

    def old_path(lengths: Segments) -> torch.Tensor:
        work.copy_(qkv)  # (the rotary rotates in place: a fresh copy each call, timed apart below)
        q, k, v = work.view(n, 3, heads, -1).unbind(1)
        q, k = rotary(q, k)
        return segment_attention(q, k, v, lengths).reshape(n, -1)

    copy_ms = timed(lambda: work.copy_(qkv))
    results["qkv_copy_ms"] = copy_ms
    if "window" in parts:
        windows = Segments([args.window] * (n // args.window), dev, windows=True)
        starts, lengths, longest = windows.runs()
        old_ms = timed(lambda: old_path(windows)) - copy_ms
        want = old_path(windows).float()
        row = {"rotary_then_sdpa_ms": old_ms}
        print(f"window (per block): rotary + SDPA {old_ms:.3f} ms", flush=True)
        for per_program, warps in WINDOW_TILINGS:
            os.environ[TILING_ENV] = f"{per_program},{warps}"
            got = window_attention(qkv, heads, rotary.table, starts, lengths, longest)
            ms = row[f"kernel_h{per_program}w{warps}_ms"] = timed(
                lambda: window_attention(qkv, heads, rotary.table, starts, lengths, longest))
            diff = row[f"kernel_h{per_program}w{warps}_max_abs_diff"] = (got.float() - want).abs().max().item()
            print(f"window kernel {per_program} heads a program, {warps} warps: {ms:.3f} ms, max |diff| {diff:.3g}",
                  flush=True)
        os.environ.pop(TILING_ENV)
        results["window"] = row
    if "frame" in parts:
        frames = Segments([args.frame] * (n // args.frame), dev)
        results["frame"] = {"rotary_then_sdpa_ms": timed(lambda: old_path(frames)) - copy_ms}
        print("frame (per block):", json.dumps(results["frame"]), flush=True)
    for width in (dim, args.mlp) if "residual" in parts else ():  # proj, then down
        a = torch.randn(n, width, device=dev, dtype=dtype)
        residual = torch.randn(n, dim, device=dev, dtype=dtype)
        weight = torch.randn(dim, width, device=dev, dtype=dtype) / width ** 0.5
        bias = torch.randn(dim, device=dev, dtype=dtype)
        norm_weight = torch.ones(dim, device=dev, dtype=dtype)
        stream = residual.clone()
        x = F.linear(a, weight, bias)
        row = {
            "linear_ms": timed(lambda: F.linear(a, weight, bias)),
            "norm_adding_ms": timed(lambda: rms_norm(x, norm_weight, 1e-6, residual)),
            "linear_then_norm_adding_ms": timed(
                lambda: rms_norm(F.linear(a, weight, bias), norm_weight, 1e-6, residual)),
            "addmm_in_place_ms": timed(lambda: stream.addmm_(a, weight.t())),
            "norm_ms": timed(lambda: rms_norm(x, norm_weight, 1e-6)),
            "addmm_then_norm_ms": timed(lambda: rms_norm(stream.addmm_(a, weight.t()), norm_weight, 1e-6)),
        }
        results[f"residual_k{width}"] = row
        print(f"residual (K {width}):", json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
