"""OpenAI Triton, when installed: kernel files import ``triton``, ``tl`` and ``jit`` from here.

CPU-only installs (CI) have no ``triton``; there ``jit`` returns a stub that refuses to run,
so a kernel file still imports and its public entry uses the torch reference. Kernel
signatures annotate ``tl.constexpr`` under ``from __future__ import annotations``: Triton reads
the annotation as a string, and without Triton the annotation is never evaluated.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with ``launch_pdl``
may start while the kernel before it in the stream is still running, once every program of that
one has begun. Its programs must run ``pdl_prologue`` before they read anything an earlier kernel
wrote or write anything an earlier kernel reads: the prologue waits until the previous kernel
has finished and its writes are visible. Because every PDL kernel waits so in every program,
"finished" is transitive down the stream. What a kernel gains: its launch and its programs'
start-up overlap the previous kernel's tail. (PDL would also let it read data no kernel writes,
such as weights, before the wait; the kernels here wait first, since loading a GEMM's first
weight tiles early measured no faster on an H100.) A decode step of an 8B model is ~350 kernels, most of them a few microseconds
long, so the gaps between them are a large part of the step at small batches.
"""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    jit = triton.jit
except ImportError:  # CPU-only: references only
    triton = tl = None
    HAVE_TRITON = False

    def jit(fn=None, **_options):
        def stub(*_args, **_kwargs):
            raise RuntimeError("OpenAI Triton is not installed; use the torch reference on this machine")

        return stub if fn is not None else (lambda f: stub)

try:  # host-side TMA descriptors (kernels/triton_attention.py); None without Triton or in one without them
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except (ImportError, AttributeError):  # no Triton, or one without grid dependency control
    HAVE_GDC = False

    @jit
    def gdc_wait():
        pass

    @jit
    def gdc_launch_dependents():
        pass

PDL_ENV = "TRITONLLM_PDL"  # "0": never launch with PDL
# Read at every launch. The engine sets it at load (engine/executor/cuda_graphs.py
# choose_programmatic_launch): on H100s PDL made the batch-1 decode step 5-6% faster on two
# machines and 3-4% slower on two others (2026-11-25), so it is timed, not assumed.
PDL_ALLOWED = os.environ.get(PDL_ENV, "1") != "0"
_pdl_enabled = PDL_ALLOWED
_CAPABILITIES: dict[int, tuple[int, int]] = {}  # device index -> its compute capability (device_capability)


@jit
def pdl_prologue(PDL: tl.constexpr):
    """The wait (and then the go-ahead for the next kernel) every PDL-launched program runs first.
    (Giving the go-ahead before the wait measured 18% slower on an H100's batch-1 decode step.)"""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# Which PDL kernels read the weights they are about to use before their PDL wait: "router" (the default: the
# normed decode router's rows loaded into registers before its wait, kernels/moe_router.py) or "0" / "" (none,
# the launch before). Read at every launch (a CUDA graph keeps what its capture saw). H200, DeepSeek-V2-Lite
# batch 1 (call 34, benchmarks/results/engine.md): the router's register load 5.51 -> 5.21 us a launch. (The L2
# bulk prefetches of the skinny products', the shared experts' and MLA's W_UK / W_UV weights lost, every kind on
# 392.1 against 433.5 tok/s off, and were removed.)
WEIGHT_PREFETCH_ENV = "TRITONLLM_WEIGHT_PREFETCH"
WEIGHT_PREFETCH_KINDS = ("router",)
WEIGHT_PREFETCH_DEFAULT = "router"


def weight_prefetch(kind: str, pdl: bool) -> bool:
    """Whether a launch of ``kind`` (WEIGHT_PREFETCH_KINDS) with PDL on (``pdl``) reads its weights before its
    PDL wait."""
    assert kind in WEIGHT_PREFETCH_KINDS, kind
    if not pdl:
        return False
    return kind in os.environ.get(WEIGHT_PREFETCH_ENV, WEIGHT_PREFETCH_DEFAULT).strip().split(",")


def device_capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``, read once per device (launch paths ask it every call)."""
    if index not in _CAPABILITIES:
        import torch

        _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPABILITIES[index]


def hopper_or_later(t) -> bool:
    """``t`` is on a GPU of compute capability >= 9.0 (grid dependency control, the tensor-memory
    accelerator)."""
    if not t.is_cuda:
        return False
    return device_capability(t.device.index if t.device.index is not None else 0)[0] >= 9


def pdl_supported(t) -> bool:
    """This Triton has grid dependency control and ``t`` is on a GPU of compute capability >= 9.0."""
    return HAVE_GDC and hopper_or_later(t)


def set_pdl(enabled: bool) -> None:
    """Launch later kernels with PDL (where supported) or not. $TRITONLLM_PDL=0 keeps it off
    whatever is asked."""
    global _pdl_enabled
    _pdl_enabled = enabled and PDL_ALLOWED


def pdl_options(t) -> dict:
    """Launch keywords for a kernel that runs ``pdl_prologue(PDL)``."""
    on = _pdl_enabled and pdl_supported(t)
    return {"PDL": on, "launch_pdl": on}


_NUM_SMS: dict[int, int] = {}


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (read once per device): the grid sizes that
    cover the GPU. ``device``: a torch.device or its name ("cuda", "cuda:1"; benchmarks pass their
    --device string). Triton's CPU interpreter (debugging only) gets a plausible 132."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def resident_programs(compiled, device) -> int | None:
    """Programs of a launched Triton kernel that one SM of ``device`` holds at once, by its registers,
    shared memory and warps (registers are allocated 256 to a warp; the driver keeps 1 KB of shared
    memory per program); None when the compiled kernel does not say (Triton's interpreter)."""
    metadata = getattr(compiled, "metadata", None)
    n_regs = getattr(compiled, "n_regs", None)
    if metadata is None or not n_regs:
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    warps = metadata.num_warps
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_registers = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // (metadata.shared + 1024)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(1, min(by_registers, by_shared, by_threads, 32))


def power_of_2_floor(n: int) -> int:
    """The largest power of two <= ``n`` (1 for n < 2): a tile, split or head count rounded down where
    ``triton.next_power_of_2`` would round up."""
    return 1 << max(0, n.bit_length() - 1)


def use_triton(t) -> bool:
    """The dispatch rule every public kernel entry follows: Triton on CUDA tensors, else the reference."""
    return HAVE_TRITON and t.is_cuda


def dense(*tensors):
    """``tensors`` laid out as a kernel that reads element i at ``ptr + i`` (row-major, no gaps)
    needs them: each one itself when already so, else a contiguous copy; None stays None. For a
    kernel's INPUTS only (a copy of an output would take the kernel's writes: see require_dense).

    Why: a kernel given a pointer and no strides reads the view's storage as if it were packed. A
    broadcast view (``x.expand(n)``: stride 0, storage of one element) or a slice with a step
    then yields garbage past its first element, silently on CUDA (the torch references honour
    strides). Inside a CUDA-graph capture the copy is captured too and reads the static buffer at
    every replay. One tensor: ``x, = dense(x)``."""
    return tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in tensors)


def rows_packed(t) -> bool:
    """Each row t[r] of ``t`` is packed (its element [r, i, j, ...] at r * t.stride(0) + the flat index
    of (i, j, ...)): what a kernel that takes only the row stride reads. Column slices of a wider
    tensor are; a transposed or strided-column view is not."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def dense_rows(*tensors):
    """``tensors`` whose rows are packed (rows_packed), the kernel given their row stride: each one
    itself when so, else a contiguous copy; None stays None. Inputs only, as for ``dense``."""
    return tuple(t if t is None or rows_packed(t) else t.contiguous() for t in tensors)


def require_dense(**tensors) -> None:
    """Raise ValueError naming each of ``tensors`` (name=tensor; None skipped) that is not
    contiguous: for what a kernel writes through a bare pointer (an output the caller passes, a
    CUDA graph's static buffer) where a copy would not do."""
    bad = [f"{name} (shape {tuple(t.shape)}, strides {t.stride()})" for name, t in tensors.items()
           if t is not None and not t.is_contiguous()]
    if bad:
        raise ValueError("the kernel addresses these as contiguous tensors; these are views: " + ", ".join(bad))
