#!/usr/bin/env python3
"""Issue 51's anchor: FlashInfer's paged decode attention beside ours, on one pool, in one process.

    bash benchmarks/kernels/fetch_flashinfer_anchor.sh          # once, on a machine with the network
    PYTHONPATH=$PWD python benchmarks/kernels/decode_attention_anchor_bench.py [--pools fp8,bf16]
        [--contexts 2000,8000,20000] [--batches 8,64,256] [--out DIR]     (on the GPU machine: carry .anchors)

Shapes: one layer of Llama-3.1-8B's attention (32 query heads, 8 KV heads of 128: GQA group 4), pages of 32
tokens, every sequence of a batch at the same context, one new token each (a decode-only step), a bf16 query and
output, an FP8 E4M3 pool (unscaled: FlashInfer's k_scale / v_scale 1) or a bf16 one.

The pool is the engine's (engine/executor/runner.py allocate_kv_cache): in memory (2, blocks, KV heads, PAGE,
HEAD_DIM), each head's page one contiguous run; our kernel reads K and V as (blocks, PAGE, KV heads, HEAD_DIM)
views of it through their strides, and FlashInfer reads the same two tensors, unpermuted, as its "HND" layout
(pages, KV heads, page size, head dim): the same memory, no copy (checked: equal data pointers; the output says
so). ``--pool_layout token_major`` stores (blocks, PAGE, KV heads, HEAD_DIM) contiguous instead, read by
FlashInfer as "NHD". Pages are handed out shuffled over the pool.

Timed, each as a CUDA graph of 10 calls (kernels/linear.py graph_time_ms: mean of 3 replays after a warm-up one):
- ours: kernels/triton_attention.py paged_attention_triton with decode-only metadata (as attention_kernel_bench.py
  builds it), the kernel the engine runs; ``--ours_fp8_widenings v,vcvt`` times it again on the FP8 pool with
  $TRITONLLM_ATTN_FP8_BITS set to each (its A/B switch, read at every call), rows "ours v", "ours vcvt";
  ``--ours_tilings 128:4:3,32splits`` again with its decode tile or key splits forced (on ``--ours_tiling_pools``,
  default bf16: where FlashInfer's tensor-core decode was the faster in session 29's first run);
- FlashInfer's BatchDecodeWithPagedKVCacheWrapper (backend "fa2"), planned once outside the graph:
  "fi" its CUDA-core decode kernel, "fi tc" ``use_tensor_cores=True`` (the fa2 prefill kernel run on decode rows,
  its choice for GQA), and each again planned in its CUDA-graph mode ("graph": fixed buffers, the form a served
  decode graph would replay; ``--no-graph_mode`` leaves those out). Its plan() is host work per step: its time is
  printed (plan us).
When a case's K/V is under 256 MiB (it would stay in the H200's 50 MB L2 over a graph's calls) the graph's calls
cycle over several disjoint copies of the batch (its own pages of one pool, and FlashInfer a plan each), so K/V
come from HBM as in a served step.

Printed per case: microseconds a call (one layer), TB/s of the batch's K/V bytes read once, that as a % of the
device-to-device copy bandwidth measured in the same process (benchmarks/common.py copy_bandwidth: bytes read +
written), and the largest absolute difference of each side's output from ours and from the plain-torch reference
(kernels/attention.py decode_attention_ref, on the first 4 sequences); then a summary, one line a case: each
kernel's TB/s side by side and FlashInfer's best over ours. ``--out DIR``: results.json and table.md (both
tables); ``--table_from results.json`` prints a finished run's tables again.

FlashInfer comes from .anchors/flashinfer (fetch_flashinfer_anchor.sh: a trimmed flashinfer-python tarball and
the apache-tvm-ffi / ninja wheels), unpacked under --install_dir and put first on sys.path; its decode and
prefill modules are JIT-compiled by nvcc (MAX_JOBS: half the cores each, the four modules at once) in a
background thread while ours is timed. If the anchor is missing or the JIT fails, the error is printed and
recorded and our side is still timed.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import stat
import sys
import tarfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout: kernels, benchmarks

import torch  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 32  # Llama-3.1-8B, the engine's page
CONTEXTS = (2000, 8000, 20000)
BATCHES = (8, 64, 256)
CALLS = 10  # a timed graph's calls
L2_SAFE_BYTES = 256 << 20  # K/V a graph's calls read in all, at least: 5x the H200's L2
REF_SEQS = 4  # sequences checked against the plain-torch reference
ANCHOR_DIR = ROOT / ".anchors" / "flashinfer"
POOL_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


# ---- pure helpers (tests/kernels/test_decode_attention_anchor_bench.py) ---------------------------

def copies_for_l2(kv_bytes: int, calls: int = CALLS, at_least: int = L2_SAFE_BYTES) -> int:
    """How many disjoint copies of a batch a graph of ``calls`` calls cycles over, so that what it reads between
    two reads of one copy (copies - 1 other copies) is at least ``at_least`` bytes... capped at ``calls``."""
    return max(1, min(calls, math.ceil(at_least / kv_bytes)))


def kv_bytes_read(contexts: list[int], kv_itemsize: int, num_kv_heads: int = NUM_KV_HEADS,
                  head_dim: int = HEAD_DIM) -> int:
    """K and V bytes of the batch's contexts, each read once: what bounds a decode step's attention."""
    return 2 * sum(contexts) * num_kv_heads * head_dim * kv_itemsize


@dataclass
class PageTables:
    """One batch's pages, as both sides take them: ours a padded (num_seqs, width) int32 block table (padding 0,
    a valid block); FlashInfer's CSR form, indptr (num_seqs + 1,), indices (total pages,) and last_page_len
    (num_seqs,) (tokens in each sequence's last page, 1..page)."""

    block_tables: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def page_tables(contexts: list[int], block_ids: torch.Tensor, page: int = PAGE) -> PageTables:
    """Hand ``block_ids`` (1-D, at least the batch's page count) out to the sequences in order: sequence i takes
    the next ceil(contexts[i] / page) of them."""
    pages = [-(-c // page) for c in contexts]
    assert block_ids.numel() >= sum(pages), f"{block_ids.numel()} blocks for {sum(pages)} pages"
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    indices = block_ids[:sum(pages)].to(torch.int32).cpu()
    tables = torch.zeros(len(contexts), max(pages), dtype=torch.int32)
    for i, count in enumerate(pages):
        tables[i, :count] = indices[indptr[i]:indptr[i] + count]
    last = torch.tensor([c - (p - 1) * page for c, p in zip(contexts, pages)], dtype=torch.int32)
    device = block_ids.device
    return PageTables(tables.to(device), indptr.to(device), indices.to(device), last.to(device))


def make_pool(num_blocks: int, pool_dtype: torch.dtype, layout: str, device, generator=None):
    """(k, v, k_anchor, v_anchor, anchor_layout). k, v: (blocks, PAGE, KV heads, HEAD_DIM), what our kernels take;
    k_anchor / v_anchor: the same memory as FlashInfer takes it (no copy). layout "engine": stored (2, blocks,
    KV heads, PAGE, HEAD_DIM) (runner.allocate_kv_cache's order), ours a transposed view, FlashInfer's "HND";
    "token_major": stored (2, blocks, PAGE, KV heads, HEAD_DIM), both the same tensors, FlashInfer's "NHD".
    Values: standard normal, rounded to the pool's dtype."""
    if layout == "engine":
        shape = (2, num_blocks, NUM_KV_HEADS, PAGE, HEAD_DIM)
    elif layout == "token_major":
        shape = (2, num_blocks, PAGE, NUM_KV_HEADS, HEAD_DIM)
    else:
        raise ValueError(f"pool layout must be engine or token_major, got {layout!r}")
    pool = torch.empty(shape, dtype=pool_dtype, device=device)
    for half in range(2):  # bf16 values a half at a time: the FP8 pool's staging stays a quarter of it
        pool[half] = torch.randn(shape[1:], dtype=torch.bfloat16, device=device, generator=generator).to(pool_dtype)
    if layout == "engine":
        return pool[0].transpose(1, 2), pool[1].transpose(1, 2), pool[0], pool[1], "HND"
    return pool[0], pool[1], pool[0], pool[1], "NHD"


def decode_metadata(contexts: list[int], tables: PageTables):
    """Our decode-only AttentionMetadata over ``tables`` (one new token a sequence, already in the pool)."""
    from kernels.attention_metadata import AttentionMetadata

    device = tables.block_tables.device
    cu = list(range(len(contexts) + 1))
    return AttentionMetadata(
        slot_mapping=torch.full((len(contexts),), -1, dtype=torch.int64, device=device),
        block_tables=tables.block_tables,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        max_seqlen_q=1, max_context_len=max(contexts), is_decode_only=True,
        cu_seqlens_q_host=cu, context_lens_host=list(contexts),
    )


# ---- the anchor: unpacking and JIT ----------------------------------------------------------------

def install_anchor(anchor_dir: Path, into: Path) -> str:
    """Unpack the trimmed flashinfer tarball and the wheels of ``anchor_dir`` into ``into`` (once: a warm machine
    keeps it), put it first on sys.path and its ninja on PATH. Returns the tarball's name."""
    tarballs = sorted(glob.glob(str(anchor_dir / "flashinfer_python-*-decode.tar.xz")))
    if not tarballs:
        raise FileNotFoundError(f"no flashinfer tarball in {anchor_dir}: run benchmarks/kernels/"
                                "fetch_flashinfer_anchor.sh here and carry .anchors")
    done = into / ".unpacked"
    if not done.exists() or done.read_text() != Path(tarballs[-1]).name:
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir(parents=True)
        with tarfile.open(tarballs[-1]) as tar:
            tar.extractall(into, filter="data")
        for wheel in sorted(glob.glob(str(anchor_dir / "*.whl"))):
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(into)
        for script in glob.glob(str(into / "*.data" / "scripts" / "*")):  # ninja's binary
            os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        done.write_text(Path(tarballs[-1]).name)
    sys.path.insert(0, str(into))
    scripts = [str(Path(s)) for s in glob.glob(str(into / "*.data" / "scripts"))]
    os.environ["PATH"] = os.pathsep.join(scripts + [os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return Path(tarballs[-1]).name


def cuda_toolchain_env(scratch: Path) -> dict:
    """CUDA_HOME for the JIT (a toolkit with bin/nvcc and lib64/libcudart.so, found from nvcc on PATH or
    /usr/local/cuda), and LIBRARY_PATH with a libcuda.so link where the toolkit has no stub of it (the JIT's
    link line says -lcuda; the driver may ship only libcuda.so.1). Sets and returns what it set."""
    chosen = {}
    if not os.environ.get("CUDA_HOME"):
        nvcc = shutil.which("nvcc")
        candidates = ([Path(os.path.realpath(nvcc)).parent.parent] if nvcc else []) + [
            Path("/usr/local/cuda"), *map(Path, sorted(glob.glob("/usr/local/cuda-*"), reverse=True))]
        for home in candidates:
            if (home / "bin" / "nvcc").exists() and glob.glob(str(home / "lib64" / "libcudart.so*")):
                chosen["CUDA_HOME"] = str(home)
                break
    home = Path(chosen.get("CUDA_HOME") or os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (home / "lib64" / "stubs" / "libcuda.so").exists() and not (home / "lib64" / "libcuda.so").exists():
        found = [p for pattern in ("/usr/lib/x86_64-linux-gnu/libcuda.so*", "/usr/lib64/libcuda.so*",
                                   "/usr/local/nvidia/lib64/libcuda.so*") for p in sorted(glob.glob(pattern))]
        if found:
            link_dir = scratch / "libcuda_link"
            link_dir.mkdir(parents=True, exist_ok=True)
            link = link_dir / "libcuda.so"
            if not link.exists():
                link.symlink_to(found[0])
            chosen["LIBRARY_PATH"] = os.pathsep.join([str(link_dir), os.environ.get("LIBRARY_PATH", "")])
    os.environ.update(chosen)
    return chosen


class JitBuild:
    """FlashInfer's decode modules built in a background thread (all at once, nvcc in parallel), so our side is
    timed meanwhile. ``wait()`` -> {module: seconds or the error}."""

    def __init__(self, kv_dtypes: list[torch.dtype], jobs_each: int):
        from benchmarks.kernels.flashinfer_anchor_trim import decode_jit_specs

        os.environ.setdefault("MAX_JOBS", str(jobs_each))
        self.specs = decode_jit_specs(kv_dtypes)
        self.results: dict[str, object] = {}
        self.threads = [threading.Thread(target=self._build, args=(spec,), daemon=True) for spec in self.specs]
        for thread in self.threads:
            thread.start()

    def _build(self, spec) -> None:
        start = time.perf_counter()
        try:
            spec.build()
            self.results[spec.name] = round(time.perf_counter() - start, 1)
        except Exception as error:  # the whole ninja / nvcc output: the run must say why
            self.results[spec.name] = f"{type(error).__name__}: {str(error)[-3000:]}"

    def wait(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for spec in self.specs:
            self.results.setdefault(spec.name, f"still building after {timeout_s:.0f} s")
        return self.results


# ---- timing ---------------------------------------------------------------------------------------

def cycle_time_us(fns: list) -> float:
    """Device microseconds of one call: a CUDA graph of CALLS calls, call i running fns[i % len(fns)]
    (kernels/linear.py graph_time_ms: a warm-up call outside, 3 replays after a warm-up one)."""
    from kernels.linear import graph_time_ms

    calls = iter(range(10**9))
    return graph_time_ms(lambda: fns[next(calls) % len(fns)](), repeat=CALLS) * 1000.0


def copy_bandwidth_tb_s() -> float:
    """The device-to-device copy rate in TB/s, bytes read + written: benchmarks/common.py copy_bandwidth, the
    denominator of every bench's "% of copy" (a 2 GiB bf16 copy timed eagerly with CUDA events; the same copy
    as a CUDA graph's memcpy node ran at 2.72 TB/s on an H200 that copies at 4.2-4.3)."""
    from benchmarks.common import copy_bandwidth

    return copy_bandwidth("cuda") / 1e12


@dataclass
class Case:
    pool: str
    batch: int
    context: int

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.context}"


class CaseData:
    """One case's pool, query and page tables (``copies`` disjoint copies of the batch), rebuilt identically from
    its seed for each side."""

    def __init__(self, case: Case, layout: str, seed: int = 0, device: str = "cuda",
                 half_dtype: torch.dtype = torch.bfloat16):
        """half_dtype: the query's, and the pool's for case.pool "bf16" (float16 under the interpreter, whose
        bfloat16 dots are wrong: tests/kernels/kernel_testing.py)."""
        self.case = case
        self.contexts = [case.context] * case.batch
        pool_dtype = half_dtype if case.pool == "bf16" else POOL_DTYPES[case.pool]
        itemsize = torch.empty(0, dtype=pool_dtype).element_size()
        self.kv_bytes = kv_bytes_read(self.contexts, itemsize)
        self.copies = copies_for_l2(self.kv_bytes)
        pages = sum(-(-c // PAGE) for c in self.contexts)
        gen = torch.Generator(device=device).manual_seed(seed)
        num_blocks = pages * self.copies + 1  # block 0: our tables' padding
        self.k, self.v, self.k_anchor, self.v_anchor, self.anchor_layout = make_pool(
            num_blocks, pool_dtype, layout, device, gen)
        order = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
        self.tables = [page_tables(self.contexts, order[i * pages:(i + 1) * pages]) for i in range(self.copies)]
        self.q = torch.randn(case.batch, NUM_HEADS, HEAD_DIM, dtype=half_dtype, device=device, generator=gen)
        self.same_memory = (self.k.data_ptr() == self.k_anchor.data_ptr()
                            and self.v.data_ptr() == self.v_anchor.data_ptr())

    def reference(self) -> torch.Tensor:
        """decode_attention_ref on the first REF_SEQS sequences of copy 0."""
        from kernels.attention import decode_attention_ref

        n = min(REF_SEQS, self.case.batch)
        first = PageTables(self.tables[0].block_tables[:n], *(None,) * 3)
        meta = decode_metadata(self.contexts[:n], first)
        return decode_attention_ref(self.q[:n], self.k, self.v, meta, HEAD_DIM**-0.5)


def run_ours(data: CaseData, timed: bool = True) -> tuple[float | None, torch.Tensor]:
    """(us a call, or None untimed; the output of copy 0)."""
    from kernels.triton_attention import paged_attention_triton

    metas = [decode_metadata(data.contexts, t) for t in data.tables]
    scale = HEAD_DIM**-0.5
    fns = [lambda m=m: paged_attention_triton(data.q, data.k, data.v, m, scale) for m in metas]
    out = fns[0]()
    return (cycle_time_us(fns) if timed else None), out


def run_flashinfer(data: CaseData, tensor_cores: bool, graph_mode: bool, workspace: torch.Tensor):
    """(us a call, plan us (host, the second plan of copy 0), output of copy 0)."""
    import flashinfer

    pool_dtype = POOL_DTYPES[data.case.pool]
    wrappers, outs = [], []
    plan_us = None
    for tables in data.tables:
        extra = {}
        if graph_mode:
            extra = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty_like(tables.indptr),
                         paged_kv_indices_buffer=torch.empty_like(tables.indices),
                         paged_kv_last_page_len_buffer=torch.empty_like(tables.last_page_len))
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout=data.anchor_layout, use_tensor_cores=tensor_cores, backend="fa2", **extra)

        indptr, last_page_len = tables.indptr.cpu(), tables.last_page_len.cpu()  # host, as a served step has them

        def plan(w=wrapper, t=tables, indptr=indptr, last_page_len=last_page_len):
            w.plan(indptr, t.indices, last_page_len, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE,
                   q_data_type=torch.bfloat16, kv_data_type=pool_dtype, o_data_type=torch.bfloat16,
                   sm_scale=HEAD_DIM**-0.5)

        plan()
        if plan_us is None:
            torch.cuda.synchronize()
            start = time.perf_counter()
            plan()
            torch.cuda.synchronize()
            plan_us = (time.perf_counter() - start) * 1e6
        wrappers.append(wrapper)
        outs.append(torch.empty_like(data.q))
    fns = [lambda w=w, o=o: w.run(data.q, (data.k_anchor, data.v_anchor), out=o) for w, o in zip(wrappers, outs)]
    fns[0]()
    torch.cuda.synchronize()
    first = outs[0].clone()
    return cycle_time_us(fns), plan_us, first


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---- the run --------------------------------------------------------------------------------------

def smoke(layouts=("engine", "token_major"), widenings=(), tilings=()) -> list[dict]:
    """The harness once through on the CPU (TRITON_INTERPRET=1: our Triton kernel interpreted), untimed, at tiny
    shapes, against the plain-torch reference; no FlashInfer. float16 stands in for bfloat16 (CaseData says why).
    ``widenings``: the FP8 pool's first case again under each; ``tilings`` (forced_decode's entries): the first case
    of each pool again under each. Returns each case's largest difference."""
    results = []
    for layout in layouts:
        for pool in POOL_DTYPES:
            for batch, context in ((2, 40), (3, 70)):
                data = CaseData(Case(pool, batch, context), layout, device="cpu", half_dtype=torch.float16)
                ref = data.reference()
                _, out = run_ours(data, timed=False)
                results.append({"layout": layout, "pool": pool, "case": data.case.name, "copies": data.copies,
                                "diff_ref": max_diff(out, ref)})
                print(results[-1], flush=True)
                for widening in widenings if pool == "fp8" and batch == 2 else []:
                    with fp8_widening_set(widening):
                        _, out = run_ours(data, timed=False)
                    results.append({**results[-1], "widening": widening, "diff_ref": max_diff(out, ref)})
                    print(results[-1], flush=True)
                for entry in tilings if batch == 2 else []:
                    with forced_decode(entry):
                        _, out = run_ours(data, timed=False)
                    results.append({**results[-1], "tiling": entry, "diff_ref": max_diff(out, ref)})
                    print(results[-1], flush=True)
    return results


def forced_decode(entry: str):
    """A context manager forcing our decode tiling for its block (attention_kernel_bench.py's ``forced`` on
    kernels/triton_attention.py _decode_config): "BN:WARPS:STAGES" the keys a tile, warps and stages (the splits
    as chosen), "Nsplits" the key splits (the tiling as chosen)."""
    from benchmarks.kernels.attention_kernel_bench import forced

    if entry.endswith("splits") and entry[:-len("splits")].isdigit():
        count = int(entry[:-len("splits")])
        return forced("_decode_config", lambda default: default[:4] + (count,) + default[5:])
    parts = entry.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise SystemExit(f"--ours_tilings: {entry!r} is neither BN:WARPS:STAGES nor Nsplits")
    bn, warps, stages = map(int, parts)
    return forced("_decode_config", lambda default: (default[0], bn, warps, stages) + default[4:])


def fp8_widening_set(widening: str):
    """Context manager: kernels/triton_attention.py's FP8 widening switch (an environment variable it reads at every
    call) set to ``widening`` for the block, restored after (benchmarks/common.py environment_set). An unknown
    widening is refused here, before any block is entered."""
    from benchmarks.common import environment_set
    from kernels import triton_attention

    name = getattr(triton_attention, "FP8_WIDEN_ENV", None)
    known = getattr(triton_attention, "FP8_WIDENINGS", {})
    if name is None or widening not in known:
        raise SystemExit(f"--ours_fp8_widenings: {widening!r} is not one of this kernel's widenings {sorted(known)}")
    return environment_set({name: widening})


ANCHOR_VARIANTS = {"fi": (False, False), "fi tc": (True, False), "fi graph": (False, True),
                   "fi tc graph": (True, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", default="fp8,bf16")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--pool_layout", choices=["engine", "token_major"], default="engine")
    parser.add_argument("--graph_mode", action=argparse.BooleanOptionalAction, default=True,
                        help="also FlashInfer planned in its CUDA-graph mode")
    parser.add_argument("--anchor_dir", default=str(ANCHOR_DIR))
    parser.add_argument("--install_dir", default="/tmp/flashinfer_anchor",
                        help="where the anchor is unpacked and its JIT cache kept (FLASHINFER_WORKSPACE_BASE)")
    parser.add_argument("--jit_timeout", type=float, default=300.0,
                        help="seconds to wait for the JIT after our side is timed")
    parser.add_argument("--out", default=None, help="folder for results.json and table.md")
    parser.add_argument("--ours_fp8_widenings", default="",
                        help="comma list: ours on FP8 pools again with $TRITONLLM_ATTN_FP8_BITS set to each "
                             "(kernels/triton_attention.py FP8_WIDENINGS), rows 'ours WIDENING'")
    parser.add_argument("--ours_tilings", default="",
                        help="comma list of BN:WARPS:STAGES (the decode tile forced, splits as chosen) or Nsplits "
                             "(the key splits forced, tile as chosen): ours again under each, rows 'ours ENTRY'")
    parser.add_argument("--ours_tiling_pools", default="bf16", help="the pools --ours_tilings applies to")
    parser.add_argument("--table_from", default=None, help="a run's results.json: print its tables and stop")
    parser.add_argument("--smoke", action="store_true",
                        help="TRITON_INTERPRET=1 on the CPU: the harness at tiny shapes against the reference, untimed")
    args = parser.parse_args()
    if args.smoke:
        smoke(widenings=[w for w in args.ours_fp8_widenings.split(",") if w],
              tilings=[t for t in args.ours_tilings.split(",") if t])
        return
    if args.table_from:
        run = json.loads(Path(args.table_from).read_text())
        print(markdown_table(run["rows"], run["info"]))
        return
    t0 = time.perf_counter()
    pools = [p for p in args.pools.split(",") if p]
    cases = [Case(pool, b, c) for pool in pools for c in map(int, args.contexts.split(","))
             for b in map(int, args.batches.split(","))]
    info: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "pool_layout": args.pool_layout, "heads": [NUM_HEADS, NUM_KV_HEADS, HEAD_DIM], "page": PAGE}
    install = Path(args.install_dir)
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(install / "ws"))
    build = None
    try:
        info["anchor"] = install_anchor(Path(args.anchor_dir), install / "pkg")
        info["toolchain_env"] = cuda_toolchain_env(install)
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
        jobs = max(1, (os.cpu_count() or 2) // 2)
        build = JitBuild([POOL_DTYPES[p] for p in pools], jobs)
        print(f"flashinfer {flashinfer.__version__} imported ({time.perf_counter() - t0:.0f} s); JIT of "
              f"{len(build.specs)} modules started (MAX_JOBS {os.environ['MAX_JOBS']} each, CUDA_HOME "
              f"{os.environ.get('CUDA_HOME', '?')})", flush=True)
    except Exception as error:
        info["anchor_error"] = f"{type(error).__name__}: {error}"
        print("FLASHINFER UNAVAILABLE:", info["anchor_error"], flush=True)

    def save() -> None:  # after each phase and FlashInfer case: a run cut short still leaves its figures
        if args.out:
            out_dir = Path(args.out)
            out_dir.mkdir(parents=True, exist_ok=True)
            info["seconds"] = round(time.perf_counter() - t0, 1)
            (out_dir / "results.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")
            (out_dir / "table.md").write_text(markdown_table(rows, info) + "\n")

    info["copy_tb_s"] = round(copy_bandwidth_tb_s(), 3)
    print(f"device-to-device copy: {info['copy_tb_s']} TB/s (read + write)", flush=True)
    rows, ours_out = [], {}

    def record(case: Case, data: CaseData, kernel: str, us: float, out: torch.Tensor, ref: torch.Tensor,
               plan_us: float | None = None) -> None:
        tb_s = data.kv_bytes / us / 1e6
        row = {"pool": case.pool, "batch": case.batch, "context": case.context, "kernel": kernel,
               "us": round(us, 1), "kv_tb_s": round(tb_s, 3), "pct_copy": round(100 * tb_s / info["copy_tb_s"], 1),
               "copies": data.copies, "diff_ref": max_diff(out[:ref.shape[0]], ref),
               "diff_ours": max_diff(out, ours_out[case.name, case.pool]), "plan_us": plan_us and round(plan_us, 1)}
        rows.append(row)
        print(row, flush=True)

    widenings = [w for w in args.ours_fp8_widenings.split(",") if w]
    for widening in widenings:  # refused before any timing
        fp8_widening_set(widening)
    tilings = [t for t in args.ours_tilings.split(",") if t]
    tiling_pools = set(args.ours_tiling_pools.split(","))
    for entry in tilings:
        forced_decode(entry)
    for case in cases:  # ours first: FlashInfer's JIT compiles meanwhile
        data = CaseData(case, args.pool_layout)
        ref = data.reference()
        us, out = run_ours(data)
        ours_out[case.name, case.pool] = out
        record(case, data, "ours", us, out, ref)
        for widening in widenings if case.pool == "fp8" else []:
            with fp8_widening_set(widening):
                us, out = run_ours(data)
            record(case, data, f"ours {widening}", us, out, ref)
        for entry in tilings if case.pool in tiling_pools else []:
            try:
                with forced_decode(entry):
                    us, out = run_ours(data)
                record(case, data, f"ours {entry}", us, out, ref)
            except Exception as error:  # a tiling over the shared memory: recorded, the run goes on
                info.setdefault("ours_tiling_errors", {})[f"{case.pool} {case.name} {entry}"] = (
                    f"{type(error).__name__}: {str(error)[-300:]}")
                print("OURS TILING FAILED:", case, entry, info["ours_tiling_errors"], flush=True)
        del data
        torch.cuda.empty_cache()
    save()
    if build is not None:
        info["jit"] = build.wait(args.jit_timeout)
        print("JIT:", json.dumps(info["jit"], indent=1), flush=True)
        built = {name for name, r in info["jit"].items() if isinstance(r, float)}
        variants = {k: v for k, v in ANCHOR_VARIANTS.items() if args.graph_mode or not v[1]}
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        for case in cases:
            data = CaseData(case, args.pool_layout)
            if "same_memory" not in info:
                info["same_memory"] = data.same_memory
                print(f"FlashInfer reads the pool as {data.anchor_layout} tensors at our views' addresses "
                      f"(no copy): {data.same_memory}", flush=True)
            ref = data.reference()
            for kernel, (tensor_cores, graph_mode) in variants.items():
                module = next(s.name for s in build.specs[int(tensor_cores)::2]
                              if f"dtype_kv_{'e4m3' if case.pool == 'fp8' else 'bf16'}_" in s.name)
                if module not in built:
                    continue
                try:
                    us, plan_us, out = run_flashinfer(data, tensor_cores, graph_mode, workspace)
                    record(case, data, kernel, us, out, ref, plan_us)
                except Exception as error:
                    message = f"{type(error).__name__}: {str(error)[-1500:]}"
                    info.setdefault("anchor_run_errors", {})[f"{case.pool} {case.name} {kernel}"] = message
                    print("FLASHINFER RUN FAILED:", case, kernel, message, flush=True)
            del data
            torch.cuda.empty_cache()
            save()
    save()
    print(markdown_table(rows, info))


def summary_table(rows: list[dict]) -> str:
    """One line per (pool, batch, context): each kernel's K/V TB/s (its % of copy in brackets) and FlashInfer's
    fastest over ours as it runs by default (> 1: FlashInfer faster)."""
    kernels = list(dict.fromkeys(["ours"] + [r["kernel"] for r in rows]))  # ours, its variants, FlashInfer's
    cases: dict[tuple, dict] = {}
    for r in rows:
        cases.setdefault((r["pool"], r["batch"], r["context"]), {})[r["kernel"]] = r
    lines = ["| pool | batch x context | " + " | ".join(f"{k} TB/s (% copy)" for k in kernels)
             + " | best FlashInfer / ours |", "|---|---|" + "---:|" * (len(kernels) + 1)]
    for (pool, batch, context), by_kernel in cases.items():
        cells = [f"{by_kernel[k]['kv_tb_s']:.2f} ({by_kernel[k]['pct_copy']:.0f}%)" if k in by_kernel else "-"
                 for k in kernels]
        theirs = [r["us"] for k, r in by_kernel.items() if not k.startswith("ours")]
        ratio = f"{by_kernel['ours']['us'] / min(theirs):.2f}" if theirs and "ours" in by_kernel else "-"
        lines.append(f"| {pool} | {batch}x{context} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def markdown_table(rows: list[dict], info: dict) -> str:
    """One line per (pool, batch, context, kernel), ours first in each case; plan us only for FlashInfer."""
    head = (f"Decode attention, one layer ({NUM_HEADS} q / {NUM_KV_HEADS} KV heads x {HEAD_DIM}, page {PAGE}, "
            f"{info.get('pool_layout')} pool), {info.get('device')}; copy {info.get('copy_tb_s')} TB/s; "
            f"flashinfer {info.get('flashinfer', 'unavailable')}")
    lines = [head, "", "| pool | batch x context | kernel | us / layer | K/V TB/s | % of copy | plan us (host) "
             "| max abs diff vs ours | vs reference |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        plan = "" if r["plan_us"] is None else f"{r['plan_us']:,}"
        lines.append(f"| {r['pool']} | {r['batch']}x{r['context']} | {r['kernel']} | {r['us']:,} | {r['kv_tb_s']} | "
                     f"{r['pct_copy']} | {plan} | {r['diff_ours']:.3g} | {r['diff_ref']:.3g} |")
    return "\n".join(lines + ["", summary_table(rows)])


if __name__ == "__main__":
    main()
