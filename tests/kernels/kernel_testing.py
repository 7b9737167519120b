"""Helpers shared by the kernel tests (pytest puts this folder on sys.path, so import it by name).

Where the Triton kernels run: on a CUDA machine, the GPU. Elsewhere the kernel tests are
skipped, unless the developer opts into Triton's CPU interpreter (``TRITON_INTERPRET=1`` with
``triton`` importable), which runs the same kernels on CPU tensors, slowly: handy for
debugging indexing without a GPU. CI has neither, so there only the reference tests run.
"""
from __future__ import annotations

import importlib.util
import os

import torch


def triton_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
        return "cpu"
    return None


def low_precision_dtypes(device: str) -> list[torch.dtype]:
    """The interpreter emulates bf16 dots slowly and loosely; on CPU test fp32 only."""
    return [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32]


def half_inputs(device: str, m: int, k: int, n: int, seed: int = 1):
    """Per 16-bit activation dtype a W4A16 kernel test covers on ``device`` (both on CUDA; float16 alone under
    Triton's interpreter, whose bfloat16 dots are wrong): (dtype, x (M, K) standard normal, bias (N,))."""
    for dtype in (torch.bfloat16, torch.float16) if device == "cuda" else (torch.float16,):
        torch.manual_seed(seed)
        yield dtype, torch.randn(m, k).to(device=device, dtype=dtype), torch.randn(n).to(device=device, dtype=dtype)


def replayed(fn, x: torch.Tensor) -> torch.Tensor:
    """fn() captured in a CUDA graph, then replayed after ``x`` (what fn reads) is refilled in place with new standard
    normal values: the graph's output, to compare with a reference computed from the new ``x``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    x.copy_(torch.randn_like(x))
    graph.replay()
    return captured


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN propagates, so a NaN output never passes)."""
    diff = (out.double().cpu() - ref.double().cpu()).norm()
    return (diff / ref.double().cpu().norm().clamp_min(1e-30)).item()


# ||out - ref|| / ||ref|| bounds per output dtype. bf16 keeps 8 mantissa bits (rounding 2^-9
# ~ 2e-3 relative per element) and the attention kernel rounds P to the operand dtype before
# the PV dot, so two roundings land near 3e-3; fp16 (11 bits) ~8x tighter; fp32 with IEEE
# dots far under 1e-5.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
