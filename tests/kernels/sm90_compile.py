"""Ahead-of-time compiles of Triton kernels for sm_90 on a machine without a GPU (Triton's compiler and the
ptxas it ships), and the resources ptxas gave them: the kernel tests' check that a tiling chosen for the H200
has no spills (local memory) and fits its register budget, before any device call.

Opt-in (TRITONLLM_AOT_SM90=1): each compile takes ~5-10 s of CPU, too much for make test's budget."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

AOT_SM90 = pytest.mark.skipif(
    os.environ.get("TRITONLLM_AOT_SM90") != "1" or os.environ.get("TRITON_INTERPRET") == "1",
    reason="set TRITONLLM_AOT_SM90=1 (without TRITON_INTERPRET=1, whose kernels do not compile) to compile for "
           "sm_90 on this machine (~5-10 s a kernel)")


def strides_but_block_table(name: str) -> bool:
    """The integer arguments the paged kernels' launches pass as multiples of 16: the pool and row strides, not
    the block table's (a batch's widest table)."""
    return name.startswith("stride") and name != "stride_bt"


def compile_for_sm90(kernel, pointers: dict, const: dict, *, warps: int, stages: int | None = None,
                     floats: tuple = (), aligned_int: Callable[[str], bool] = lambda name: True,
                     max_registers: int | None = None):
    """``kernel`` (a @triton.jit function) compiled for sm_90 as its launch would specialize it.
    ``pointers``: argument -> pointer type ("*bf16", "*fp8e4nv", ...); ``const``: constexpr values (names the
    kernel lacks are dropped); ``floats``: fp32 scalar arguments; every other argument is an i32, divisible by
    16 where ``aligned_int(name)`` (Triton's launcher specializes such arguments; pointers always are); a constexpr
    with a default that ``const`` does not name takes its default."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    # A constexpr left out of ``const`` takes its default, as a launch that leaves it out does (not an i32 argument:
    # that compiles a kernel no launch runs, with the constexpr's branches as run-time ones).
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default and p.name not in const}
    const = {name: value for name, value in {**defaults, **const}.items() if name in names}
    signature = {name: pointers.get(name, "constexpr" if name in const else "fp32" if name in floats else "i32")
                 for name in names}
    aligned = [name for name in names
               if signature[name].startswith("*") or (signature[name] == "i32" and aligned_int(name))]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    options = {"num_warps": warps, **({"num_stages": stages} if stages is not None else {}),
               **({"maxnreg": max_registers} if max_registers else {})}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def resource_usage(compiled, tmp_path: Path) -> str | None:
    """cuobjdump's resource line of a compiled kernel ("REG:n STACK:n SHARED:n LOCAL:n ..."), or None where
    Triton ships no cuobjdump beside its ptxas."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return None
    cubin = Path(tmp_path) / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout


def resource_usage_or_skip(compiled, tmp_path: Path) -> str:
    usage = resource_usage(compiled, tmp_path)
    if usage is None:
        pytest.skip("no cuobjdump beside Triton's ptxas")
    return usage


def registers(usage: str) -> int:
    return int(usage.split("REG:")[1].split()[0])


def stack_bytes(usage: str) -> int:
    return int(usage.split("STACK:")[1].split()[0])
