"""List the files of an unpacked flashinfer-python wheel that its paged decode attention needs
(benchmarks/kernels/fetch_flashinfer_anchor.sh; issue 51's anchor).

Why: the wheel is 101 MB (715 MB unpacked), more than a device call may carry (64 MiB), while
``import flashinfer`` and the JIT build of BatchDecodeWithPagedKVCacheWrapper (its CUDA-core decode
module, and with ``use_tensor_cores=True`` the fa2 batch-prefill module it plans decode rows on) read:
- its Python package, less ``experimental/`` and the ``cake_*_backend/`` packages that ``import
  flashinfer`` does not load (found by importing the unpacked wheel in a child process and listing
  the files it loaded: ``loaded_files``);
- ``data/include`` (the kernels' headers), ``data/cccl`` (put ahead of the CUDA toolkit's copy with
  -I by the JIT's build file) and ``data/spdlog``;
- the top level of ``data/csrc``: the decode and prefill sources and Jinja templates the JIT copies
  and renders, and the headers they include. ``data/cutlass`` and the other kernels' ``data/csrc``
  folders are left out: no file the decode or fa2 prefill sources include, transitively, lies there
  (fetch_flashinfer_anchor.sh checks that on the generated sources: ``missing_includes``).

    python benchmarks/kernels/flashinfer_anchor_trim.py UNPACKED_WHEEL_DIR > files.txt
    python benchmarks/kernels/flashinfer_anchor_trim.py --generate     (flashinfer importable; writes the JIT's
        sources and build files under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer for sm_90a, compiles nothing)
    python benchmarks/kernels/flashinfer_anchor_trim.py --check-includes UNPACKED_OR_TRIMMED_DIR GENERATED_DIR
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

# data/ folders kept whole: what the JIT's build file names as include directories, less CUTLASS
DATA_KEPT_WHOLE = ("data/include", "data/cccl", "data/spdlog")
# data/csrc top-level files kept: the decode / prefill sources the JIT copies, and every header and template
CSRC_SOURCES = re.compile(r"^(batch_decode|batch_prefill)[^/]*\.(cu|cuh)$|^[^/]*\.(h|cuh|jinja)$")
# Python packages dropped unless `import flashinfer` loads a file of them
OPTIONAL_PACKAGES = re.compile(r"^flashinfer/(experimental|cake_[a-z0-9_]*_backend)/")
# The include directories of the JIT's build file, relative to flashinfer/ (jit/env.py), in its search order
INCLUDE_DIRS = ("data/cccl/cub", "data/cccl/libcudacxx/include", "data/cccl/thrust", "data/include", "data/csrc",
                "data/cutlass/include", "data/cutlass/tools/util/include", "data/spdlog/include")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)


def is_kept(relative: str, loaded: set[str]) -> bool:
    """Whether a file of the unpacked wheel (a path relative to its root) goes into the anchor tarball."""
    if relative.startswith("flashinfer_python-") and ".dist-info/" in relative:
        return not relative.endswith("/RECORD")  # RECORD would list the files left out
    if not relative.startswith("flashinfer/"):
        return False
    inner = relative[len("flashinfer/"):]
    if inner.startswith("data/"):
        if inner.startswith(DATA_KEPT_WHOLE):
            return True
        csrc = inner[len("data/csrc/"):] if inner.startswith("data/csrc/") else None
        return csrc is not None and "/" not in csrc and bool(CSRC_SOURCES.match(csrc))
    if not relative.endswith(".py") and not relative.endswith("py.typed"):
        return False
    if OPTIONAL_PACKAGES.match(relative):
        package = "/".join(relative.split("/")[:2]) + "/"
        return relative in loaded or (package.startswith("flashinfer/cake_") and any(p.startswith(package) for p in loaded))
    return True


def loaded_files(root: Path) -> set[str]:
    """The files (relative to root) of the flashinfer package that ``import flashinfer`` loads, run in a child
    process with root first on sys.path."""
    probe = ("import json, sys; import flashinfer, flashinfer.decode, flashinfer.prefill; "
             "print(json.dumps(sorted({m.__file__ for n, m in list(sys.modules.items()) "
             "if n.startswith('flashinfer') and getattr(m, '__file__', None)})))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=root)
    if out.returncode != 0:
        raise SystemExit(f"import flashinfer from {root} failed:\n{out.stderr[-4000:]}")
    files = json.loads(out.stdout.strip().splitlines()[-1])
    return {str(Path(f).resolve().relative_to(root.resolve())) for f in files}


def kept_files(root: Path) -> list[str]:
    loaded = loaded_files(root)
    every = (str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return sorted(p for p in every if is_kept(p, loaded))


def decode_jit_specs(kv_dtypes, head_dim: int = 128) -> list:
    """FlashInfer's JitSpecs that BatchDecodeWithPagedKVCacheWrapper builds at plan() for a bf16 query and output,
    int32 page indices, no RoPE, window or soft cap, over each KV dtype: its CUDA-core decode module, and the fa2
    batch-prefill module (equal K / V strides) that ``use_tensor_cores=True`` runs decode rows on. Their module
    builders are flashinfer's own (private names of 0.7.4: the bench builds them ahead, all at once, and falls back
    to the wrapper's lazy build if these move)."""
    import torch
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_decode_module

    specs = []
    for kv_dtype in kv_dtypes:
        args = (torch.bfloat16, kv_dtype, torch.bfloat16, torch.int32, head_dim, head_dim, 0, False, False)
        specs.append(gen_batch_decode_module(*args))
        specs.append(_gen_batch_prefill_primary_module("fa2", *args, False))  # (no fp16 QK reduction)
    return specs


def missing_includes(package: Path, generated: Path) -> tuple[list[str], list[str]]:
    """Follow the #include lines of the JIT's generated sources (every file under ``generated``) through the
    package's include directories, as the build file orders them, ignoring preprocessor conditions (an
    over-approximation). Returns (headers found in the package, relative to it; names that resolved nowhere in
    it, and whether each exists in the unpacked wheel is for the caller to judge: the CUDA toolkit, the C++
    library and tvm_ffi provide the rest)."""
    dirs = [package / d for d in INCLUDE_DIRS]
    stack = [p for p in generated.rglob("*") if p.is_file()]
    found, unresolved = set(), set()
    while stack:
        path = stack.pop()
        for name in INCLUDE.findall(path.read_text(errors="replace")):
            hit = next((c for c in [path.parent / name] + [d / name for d in dirs] if c.is_file()), None)
            if hit is None:
                unresolved.add(name)
            elif hit.resolve() not in found:
                found.add(hit.resolve())
                stack.append(hit)
    inside = sorted(str(p.relative_to(package.resolve())) for p in found if package.resolve() in p.parents)
    return inside, sorted(unresolved)


if __name__ == "__main__":
    if sys.argv[1] == "--generate":
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # the H200's; no GPU needed to write sources
        import torch

        for spec in decode_jit_specs([torch.float8_e4m3fn, torch.bfloat16]):
            spec.write_ninja()  # renders the sources too (at spec creation) and the build file
            print(spec.name)
    elif sys.argv[1] == "--check-includes":
        inside, unresolved = missing_includes(Path(sys.argv[2]) / "flashinfer", Path(sys.argv[3]))
        print(json.dumps({"headers_in_package": inside, "unresolved": unresolved}))
    else:
        print("\n".join(kept_files(Path(sys.argv[1]))))
