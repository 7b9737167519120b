"""Per-row E4M3 quantization inside Triton kernels: the one definition of the scale and of the
rounding that kernels/fp8.py's quantize kernel and the norm and activation kernels that quantize
their output all use. Their results must equal kernels.fp8.quantize_rows bit for bit:
scale = max(max|row| / 448, 1e-12) in float32, values = clamp(x / scale, -448, 448) rounded to
the nearest E4M3 (448 is E4M3's largest finite value; an all-zero row keeps the 1e-12 scale).
"""
from __future__ import annotations

from kernels._triton import jit, tl


@jit
def e4m3_row_scale(peak):
    """The row's scale from its absolute maximum ``peak`` (float32 scalar)."""
    return tl.maximum(peak / 448.0, 1e-12)


@jit
def to_e4m3(x, scale):
    """float32 values of a row -> E4M3 with that row's ``scale``."""
    return tl.minimum(tl.maximum(x / scale, -448.0), 448.0).to(tl.float8e4nv)


# Producers that quantize their output row when they finish last (``arrive_last`` below), e.g. the
# decode step's gated gate_up product and attention's split merge: at one row this replaces a
# quantize kernel of its own (~3.4 us on an H100, 64 per batch-1 step of Llama-8B) by a few
# microseconds of one program's tail.


@jit
def arrive_last(counter_ptr, expected):
    """Count this program as finished; True in the program that arrives last of ``expected``, which
    then sees every other program's stores (they are issued before a barrier and a release; the last
    arrival acquires) and must set the counter back to 0 (``reset_arrivals``) when done."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == expected - 1


@jit
def reset_arrivals(counter_ptr):
    tl.store(counter_ptr, 0)


@jit
def quantize_row_from_peaks(row_ptr, n_cols, peaks_ptr, n_peaks, q_ptr, scale_ptr,
                            ROW_BLOCK: tl.constexpr, PEAKS_BLOCK: tl.constexpr):
    """One row that other programs of this kernel wrote (model dtype, ``n_cols`` <= ROW_BLOCK), with
    the absolute maxima of its parts (``n_peaks`` float32): its scale and E4M3 values, exactly those
    of kernels.fp8.quantize_rows on the row (the maximum of the parts' maxima is the row's). Read
    through L2 (``.cg``): the values were written during this kernel by other SMs."""
    p = tl.arange(0, PEAKS_BLOCK)
    scale = e4m3_row_scale(tl.max(tl.load(peaks_ptr + p, mask=p < n_peaks, other=0.0, cache_modifier=".cg"), 0))
    c = tl.arange(0, ROW_BLOCK)
    x = tl.load(row_ptr + c, mask=c < n_cols, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(q_ptr + c, to_e4m3(x, scale), mask=c < n_cols)
    tl.store(scale_ptr, scale)


_COUNTERS: dict = {}


def arrival_counter(device):
    """The per-device int32 counter of ``arrive_last``, 0 between kernels (each kernel's last program
    resets it). One serves every such kernel on the device: kernels on one stream run one after
    another (a PDL kernel waits for its predecessor before it counts). Allocated on first use, an
    eager warm-up run, never inside a CUDA-graph capture; never reallocated (graphs hold its address)."""
    import torch

    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter
