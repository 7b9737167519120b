"""What the INT4 GEMM sweeps (wna16_gemm_sweep.py, w4a8_gemm_sweep.py) share: Llama-3.1-8B's TP1 shapes, their
command-line arguments, Triton compiles spread over processes first (Triton's disk cache serves the sweep), the
sweep's setting from its arguments, and device time from CUDA graph replays of weights streamed from HBM (copies
that together exceed twice the L2, as kernels.wna16's load-time timing).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}  # largest first
TINY_SHAPES = {"tiny": (256, 512)}


def sweep_arguments(doc: str, out: str, rows: str, budget_s: float, warm_procs: int) -> argparse.ArgumentParser:
    """The arguments every sweep takes (a script adds its own to the parser returned)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=out)
    parser.add_argument("--md", default=None)
    parser.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--budget-s", type=float, default=budget_s, help="stop starting new shapes/rows after this")
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal under TRITON_INTERPRET=1 (no timings)")
    parser.add_argument("--warm-procs", type=int, default=warm_procs,
                        help="compile the tilings first in this many processes at once (Triton's disk cache)")
    parser.add_argument("--warm-slice", default=None, help=argparse.SUPPRESS)  # "i/P": a warming process's share
    return parser


def warm_in_processes(script: str, args: argparse.Namespace, start: float, extra: list[str] = ()) -> None:
    """Run ``script --warm-slice i/P`` (+ ``extra``) in args.warm_procs processes at once and wait for them (on
    CUDA, with more than one process)."""
    if args.tiny or args.warm_procs <= 1:
        return
    procs = [subprocess.Popen([sys.executable, script, "--warm-slice", f"{i}/{args.warm_procs}", *extra])
             for i in range(args.warm_procs)]
    codes = [p.wait() for p in procs]
    print(f"compiled in {args.warm_procs} processes in {time.time() - start:.0f} s (exit {codes})", flush=True)


@dataclass
class Sweep:
    """Where and on what a sweep runs, from its arguments."""

    device: str
    shapes: dict[str, tuple[int, int]]
    names: list[str]
    rows: list[int]
    dtype: torch.dtype
    tiny: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Sweep:
        shapes = TINY_SHAPES if args.tiny else SHAPES
        return cls(device="cpu" if args.tiny else "cuda", shapes=shapes,
                   names=args.shapes.split(",") if args.shapes else list(shapes),
                   rows=[int(r) for r in args.rows.split(",") if r],
                   # the interpreter's bf16 dots are wrong and it truncates float32 -> bf16
                   dtype=torch.float16 if args.tiny else torch.bfloat16, tiny=args.tiny)

    def shapes_in_budget(self, start: float, budget_s: float):
        """(name, (N, K)) of each shape asked for, until ``budget_s`` seconds have passed since ``start``."""
        for name in self.names:
            if time.time() - start > budget_s:
                print(f"budget reached before {name}", flush=True)
                return
            yield name, self.shapes[name]

    def rows_in_budget(self, name: str, start: float, budget_s: float):
        """Each row count asked for, until ``budget_s`` seconds have passed since ``start``."""
        for m in self.rows:
            if time.time() - start > budget_s:
                print(f"budget reached at {name} M={m}", flush=True)
                return
            yield m

    def time_us(self, fn) -> float:
        """Device time of one fn() in microseconds from CUDA graph replays; under the interpreter fn() runs once and
        the time is NaN."""
        if self.tiny:
            fn()
            return float("nan")
        from kernels.linear import graph_time_ms
        return 1e3 * graph_time_ms(fn)

    def copies(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` and enough copies to stream it from HBM when used in turn (on CPU: ``t`` alone)."""
        if self.tiny:
            return [t]
        from kernels.fp8 import l2_defeating_copies
        return l2_defeating_copies(t)
