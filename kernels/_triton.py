"""OpenAI Triton, when installed: kernel files import ``triton``, ``tl`` and ``jit`` from here.

CPU-only installs (CI) have no ``triton``; there ``jit`` returns a stub that refuses to run,
so a kernel file still imports and its public entry uses the torch reference. Kernel
signatures annotate ``tl.constexpr`` under ``from __future__ import annotations``: Triton reads
the annotation as a string, and without Triton the annotation is never evaluated.
"""
from __future__ import annotations

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


def use_triton(t) -> bool:
    """The dispatch rule every public kernel entry follows: Triton on CUDA tensors, else the reference."""
    return HAVE_TRITON and t.is_cuda
