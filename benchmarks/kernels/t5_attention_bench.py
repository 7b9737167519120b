"""T5's bias attention kernels (kernels/t5_bias_attention.py) against the torch paths they replace, one GPU.

    python benchmarks/kernels/t5_attention_bench.py --out t5_attention.json

Flan-T5-XL heads (32 x 64, bf16), random data:

- encoder: ``t5_dense_attention_triton`` (each of DENSE_KERNELS; DENSE_SWEEP's tilings) over a padded
  batch against torch's fused attention with the dense (1, heads, L, L) bias the encoder passed
  before (``F.scaled_dot_product_attention``, bf16 and float32 bias, default / memory-efficient /
  cuDNN backends) and, with ``--flex``, FlexAttention with the bias as a score_mod, at ``--encoder``
  batch x length shapes (the dense bias's build outside the timing; the kernels' per-call
  ``dense_distance_bias`` inside). Markdown to ``--encoder-md``::

    python benchmarks/kernels/t5_attention_bench.py --decode "" --paths "" --encoder-md t5_encoder.md
- decoder self-attention, decode rows: ``t5_paged_attention`` against
  kernels/relative_position_bias.py ``decode_attention_bias`` (batched torch ops) at ``--decode``
  sequences x context shapes, on a pool of 32-token pages with shuffled tables as wide as the longest.

Each shape also checks the kernel against the float32 reference (max abs error printed) and times
the tilings of DENSE_SWEEP / PAGED_SWEEP.

- decode paths (``--paths``, "" skips): the decode kernel (kernels/one_query_attention.py, one query row per
  head, DECODE_TILING and DECODE_SWEEP) against the tensor-core path it replaced
  (``decode_kernel=False``) at ``--paths-batches`` x ``--paths-contexts`` over bf16 and FP8 E4M3
  pools (head-major, as the runner allocates them), every row the full context; the sweep on the
  ``--sweep-pools`` only. Device time from
  CUDA-graph replays of one call per pool copy (benchmarks/common.py ``graph_call_us``; enough
  copies that they do not fit in L2), and the K/V bytes read per second. Markdown (date, machine,
  commit) printed and written to ``--md``::

    python benchmarks/kernels/t5_attention_bench.py --encoder "" --decode "" --md t5_decode.md
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import (command_line, cuda_time_ms, git_commit, graph_call_us, machine_summary,  # noqa: E402
                               utc_now)
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.relative_position_bias import decode_attention_bias, position_bias  # noqa: E402
from kernels.t5_bias_attention import (DECODE_TILING, DENSE_KERNEL, DENSE_KERNELS, DENSE_TILINGS,  # noqa: E402
                                       bias_of_distances, distance_bias, t5_dense_attention_ref,
                                       t5_dense_attention_triton, t5_paged_attention_ref, t5_paged_attention_triton)

HEADS, DIM, BUCKETS, MAX_DISTANCE, PAGE = 32, 64, 32, 128, 32
# (BLOCK_M, BLOCK_N, warps, stages[, maxnreg]) per encoder kernel, beside its default; sm_90 (Triton 3.6) registers
# a thread and programs an SM by registers (65536 a SM): split (128, 32, 8, 2) 106 (two), capped at 96 no spills;
# (128, 32, 8, 3) 104; (64, 32, 4, 2) 107 (four, 32 KB shared); (64, 32, 4, 3) 108. ahead: (128, 32, 8, 2) 120;
# (64, 32, 4, 2) 125 (four); (64, 32, 4, 3) 116; (128, 32, 8, 3) 115; (64, 64, 4, 2) 202 (two). The first H200
# sweep (9a46289) also timed split at (64, 128, 4, 2), (64, 64, 4, 2[, 128]), (64, 64, 4, 3), (128, 64, 4, 2),
# (128, 64, 8, 2, 128), (128, 64, 8, 3): 5.44-6.62 ms at 256 x 512 against (128, 32, 8, 2)'s 5.18. tma (q, K, V
# through TMA descriptors): (64, 32, 4, 3) 96 registers, (64, 32, 4, 2) 98, (128, 32, 8, 2) 116.
# Keys: a kernel (its bias read 2 floats a load, the default since d0455ef: cached in L1), or "<kernel>/v4": read
# in 16-byte cp.async, which bypass L1 (1 float a load is refused: misaligned on an H200).
DENSE_SWEEP = {"split/v4": [(64, 32, 4, 3)], "ahead/v4": [(64, 32, 4, 2)],
               "tma": [(64, 32, 4, 2)], "tma/v4": [(64, 32, 4, 3)],
               "ahead": [(64, 32, 4, 3), (128, 32, 8, 2), (128, 32, 8, 3)],
               "split": [(64, 32, 4, 2), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2, 96)],
               "gather": [(128, 32, 8, 2), (64, 32, 4, 2)]}
# paged kernel tilings timed beside PAGED_TILING: (BLOCK_N, warps, stages)
PAGED_SWEEP = [(64, 4, 2), (32, 2, 3), (64, 2, 3), (32, 4, 2), (128, 4, 2)]
# decode kernel tilings timed beside DECODE_TILING: (HEADS_PER_PROGRAM, BLOCK_N, warps, stages)
# (one-warp programs: their key reductions stay in the warp; sm_90 registers of each: 70-132, no spills)
DECODE_SWEEP = [(1, 64, 4, 1), (1, 128, 4, 1), (1, 32, 2, 1), (2, 32, 2, 1), (4, 32, 4, 1), (4, 64, 8, 1),
                (2, 128, 8, 1), (1, 32, 1, 1), (2, 16, 1, 1)]
L2_BYTES = 60 << 20  # pools this large in all are read from HBM (H200: 50 MB of L2)


def encoder_case(batch: int, length: int, device, *, sweep=True, flex: bool = False, on_path=None,
                 defaults=DENSE_KERNELS, sdpa: bool = True, ceilings: bool = False) -> dict:
    """The encoder attention at ``batch`` x ``length`` (every input full): each of DENSE_KERNELS at its default
    tiling (``defaults``: those kernels only) and, ``sweep`` True (or a list of DENSE_SWEEP keys: those), the new
    ones at DENSE_SWEEP's; (``sdpa``) torch SDPA with the materialized (1, heads, L, L) bias (bf16 and float32;
    default, memory-efficient and cuDNN backends) and
    (``flex``) FlexAttention with the bias as a score_mod: ms (CUDA events, median) and TFLOPS (QK and PV), max
    abs error against the float32 reference on the first two rows. ``ceilings``: two rows without T5's bias
    work, their errors not comparable: the default kernel with a table of max_distance 1 (every key tile off
    the diagonal far: no bias loads) and torch's flash attention without a bias. ``on_path(entry)`` after every path (a run cut
    short keeps what it measured)."""
    table = torch.randn(BUCKETS, HEADS, device=device, dtype=torch.bfloat16)
    qkv = torch.randn(batch, length, 3, HEADS, DIM, device=device, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)  # views of one projection's output, as the engine passes them
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    bias = distance_bias(table, bidirectional=True, max_distance=MAX_DISTANCE)
    rows = min(batch, 2)
    ref = t5_dense_attention_ref(q[:rows], k[:rows], v[:rows], lengths[:rows], 1.0, bias).float()
    flops = 4 * batch * HEADS * length * length * DIM
    entry = {"batch": batch, "length": length, "heads": HEADS, "head_dim": DIM, "gflop": flops / 1e9,
             "paths": {}}

    def timed(name: str, fn) -> None:
        try:
            err = (fn()[:rows].float() - ref).abs().max().item()
            ms = cuda_time_ms(fn)
            entry["paths"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_err": err}
        except Exception as exc:  # noqa: BLE001 - a tiling past shared memory, a backend that refuses the mask
            entry["paths"][name] = {"error": repr(exc)[:120]}
        print(f"  {batch}x{length} {name}: {entry['paths'][name]}", flush=True)
        if on_path is not None:
            on_path(entry)

    for kernel in defaults:
        timed(f"{kernel} default", lambda kernel=kernel: t5_dense_attention_triton(q, k, v, lengths, 1.0, bias,
                                                                                   kernel=kernel))
    swept = DENSE_SWEEP if sweep is True else {k: DENSE_SWEEP[k] for k in sweep or ()}  # or the entries named
    for name, tilings in swept.items():  # the old kernel at its default only
        kernel, _, vector = name.partition("/v")  # "split/v4": the split kernel reading its bias 4 floats a load
        for tiling in tilings:
            timed(f"{name} {tiling}", lambda kernel=kernel, tiling=tiling, vector=vector: t5_dense_attention_triton(
                q, k, v, lengths, 1.0, bias, kernel=kernel, tiling=tiling, bias_vector=int(vector or 0) or None))
    positions = torch.arange(length, device=device)
    dense_fp32 = position_bias(table, positions, positions, bidirectional=True, max_distance=MAX_DISTANCE).unsqueeze(0)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    backends = {"default": None, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    for mask_name, mask in (("bf16", dense_fp32.to(torch.bfloat16)), ("fp32", dense_fp32)) if sdpa else ():
        for backend_name, backend in backends.items():
            def run_sdpa(mask=mask, backend=backend):
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=1.0).transpose(1, 2)
            timed(f"sdpa {backend_name}, bias {mask_name} (1, heads, L, L)", run_sdpa)
    if ceilings:
        near_diagonal = distance_bias(torch.zeros(BUCKETS, HEADS, device=device), bidirectional=True, max_distance=1)
        timed(f"{DENSE_KERNEL} default, max_distance 1 (ceiling: far tiles only)",
              lambda: t5_dense_attention_triton(q, k, v, lengths, 1.0, near_diagonal))

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, scale=1.0).transpose(1, 2)
        timed("sdpa flash, no bias (ceiling)", flash)
    if flex:
        from torch.nn.attention.flex_attention import flex_attention

        extended = bias_of_distances(bias, torch.arange(1 - length, length, device=device))  # a column a distance
        compiled = torch.compile(flex_attention)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + extended[h, kv_idx - q_idx + length - 1]

        timed("flex_attention score_mod", lambda: compiled(qt, kt, vt, score_mod=score_mod, scale=1.0).transpose(1, 2))
    return entry


def encoder_markdown(entries: list[dict], argv: list[str] | None) -> str:
    quoted = [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]
    lines = [f"### T5 encoder attention: kernels, tilings and torch paths ({utc_now()})", "",
             f"{machine_summary('cuda')}, commit {git_commit()}, `{command_line(__file__, quoted)}`. "
             f"Flan-T5-XL heads ({HEADS} x {DIM}), bf16, bidirectional bias (max_distance {MAX_DISTANCE}), every "
             f"input full; ms = median of 20 CUDA-event timings; TFLOPS = 4 * batch * heads * L^2 * dim / time. "
             f"Kernels: {', '.join(DENSE_KERNELS)} (default {DENSE_KERNEL}); default tilings {DENSE_TILINGS} "
             f"(BLOCK_M, BLOCK_N, warps, stages).", "",
             "| batch x L | path | ms | TFLOPS | max abs err |", "|---|---|---:|---:|---:|"]
    for e in entries:
        ranked = sorted(e["paths"].items(), key=lambda kv: kv[1].get("ms", float("inf")))
        for name, r in ranked:
            if "ms" in r:
                lines.append(f"| {e['batch']}x{e['length']} | {name} | {r['ms']:.3f} | {r['tflops']:.0f} "
                             f"| {r['max_abs_err']:.1e} |")
            else:
                lines.append(f"| {e['batch']}x{e['length']} | {name} | - | - | {r['error']} |")
    return "\n".join(lines) + "\n"


def decode_metadata(tables: torch.Tensor, contexts: list[int], longest: int) -> AttentionMetadata:
    """A decode-only batch's metadata: one new token a sequence, its pages ``tables`` (num_seqs, pages), its
    ``contexts`` keys, the launch sized for ``longest``."""
    num_seqs, device = len(contexts), tables.device
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), block_tables=tables.to(torch.int32),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device), max_seqlen_q=1,
        max_context_len=longest, is_decode_only=True, cu_seqlens_q_host=list(range(num_seqs + 1)),
        context_lens_host=contexts)


def decode_case(num_seqs: int, context: int, width: int, device) -> dict:
    table = torch.randn(BUCKETS, HEADS, device=device, dtype=torch.bfloat16)
    pages_each = -(-width // PAGE)
    num_blocks = num_seqs * pages_each + 1
    k_cache = torch.randn(num_blocks, PAGE, HEADS, DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 1, device=device)[:num_seqs * pages_each].view(num_seqs, pages_each) + 1
    q = torch.randn(num_seqs, HEADS, DIM, device=device, dtype=torch.bfloat16)
    contexts = [max(1, context - (i % 7)) for i in range(num_seqs)]
    meta = decode_metadata(tables, contexts, width)
    bias = distance_bias(table, bidirectional=False, max_distance=MAX_DISTANCE)
    ours = t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias)
    ref = t5_paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 1.0, table, MAX_DISTANCE)
    entry = {"seqs": num_seqs, "context": context, "table_width_tokens": pages_each * PAGE,
             "max_abs_err": (ours.float() - ref).abs().max().item(),
             "kernel_ms": cuda_time_ms(lambda: t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias)),
             "torch_ops_ms": cuda_time_ms(lambda: decode_attention_bias(q, k_cache, v_cache, meta, 1.0, table,
                                                                         MAX_DISTANCE)),
             "tilings_ms": {}}
    for tiling in PAGED_SWEEP:
        entry["tilings_ms"][str(tiling)] = cuda_time_ms(
            lambda: t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias, tiling=tiling))
    return entry


def decode_paths_case(num_seqs: int, context: int, pool_dtype: torch.dtype, device, *, sweep: bool = True) -> dict:
    """The decode kernel against the tensor-core path: ``num_seqs`` rows of ``context`` keys each;
    ``sweep``: the DECODE_SWEEP tilings too."""
    pages_each = -(-context // PAGE)
    num_blocks = num_seqs * pages_each + 1
    kv_bytes = 2 * num_seqs * context * HEADS * DIM * torch.empty(0, dtype=pool_dtype).element_size()
    copies = max(1, min(8, -(-L2_BYTES // kv_bytes)))
    table = torch.randn(BUCKETS, HEADS, device=device, dtype=torch.bfloat16)
    bias = distance_bias(table, bidirectional=False, max_distance=MAX_DISTANCE)
    contexts = [context] * num_seqs
    inputs = []
    for _ in range(copies):
        k_cache, v_cache = (torch.randn(num_blocks, HEADS, PAGE, DIM, device=device, dtype=torch.bfloat16)
                            .to(pool_dtype).transpose(1, 2) for _ in range(2))  # head-major, like the runner's pool
        tables = torch.randperm(num_blocks - 1, device=device)[:num_seqs * pages_each].view(num_seqs, pages_each) + 1
        meta = decode_metadata(tables, contexts, context)
        q = torch.randn(num_seqs, HEADS, DIM, device=device, dtype=torch.bfloat16)
        inputs.append((q, k_cache, v_cache, meta))
    q, k_cache, v_cache, meta = inputs[0]
    rows = min(num_seqs, 16)  # the reference loops over sequences in Python: checked on the first rows
    head = AttentionMetadata(
        slot_mapping=meta.slot_mapping, block_tables=meta.block_tables[:rows], cu_seqlens_q=meta.cu_seqlens_q[:rows + 1],
        context_lens=meta.context_lens[:rows], max_seqlen_q=1, max_context_len=context, is_decode_only=True,
        cu_seqlens_q_host=list(range(rows + 1)), context_lens_host=contexts[:rows])
    ref = t5_paged_attention_ref(q[:rows].float(), k_cache.float(), v_cache.float(), head, 1.0, table, MAX_DISTANCE)

    def timed(**options) -> tuple[float, float]:
        out = t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias, **options)
        err = (out[:rows].float() - ref).abs().max().item()
        us = graph_call_us(lambda *a: t5_paged_attention_triton(*a, 1.0, bias, **options), inputs)
        return us, err

    old_us, old_err = timed(decode_kernel=False)
    new_us, new_err = timed()
    entry = {"seqs": num_seqs, "context": context, "pool": str(pool_dtype).replace("torch.", ""),
             "kv_mb": kv_bytes / 1e6, "copies": copies, "old_us": old_us, "old_max_abs_err": old_err,
             "new_us": new_us, "new_max_abs_err": new_err, "tilings_us": {}}
    for tiling in DECODE_SWEEP if sweep else []:
        entry["tilings_us"][str(tiling)] = timed(decode_tiling=tiling)[0]
    return entry


def decode_paths_markdown(entries: list[dict], argv: list[str] | None) -> str:
    gbs = lambda e, us: e["kv_mb"] * 1e6 / (us * 1e-6) / 1e9  # noqa: E731
    quoted = [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]  # "" stays visible
    lines = [f"### T5 decode self-attention: decode kernel vs tensor-core path ({utc_now()})", "",
             f"{machine_summary('cuda')}, commit {git_commit()}, `{command_line(__file__, quoted)}`. "
             f"Flan-T5-XL heads ({HEADS} x {DIM}), pages of {PAGE}, every row the full context, "
             f"one new token a row; us from CUDA-graph replays (pool copies past L2); GB/s = K/V bytes / time. "
             f"Decode tiling {DECODE_TILING} (heads a program, keys a step, warps, stages).", "",
             "| rows | context | pool | K/V MB | tensor-core us | GB/s | decode kernel us | GB/s | speedup "
             "| best sweep tiling (us) | max abs err old / new |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for e in entries:
        best = min(e["tilings_us"].items(), key=lambda kv: kv[1], default=("-", float("nan")))
        lines.append(f"| {e['seqs']} | {e['context']} | {e['pool']} | {e['kv_mb']:.1f} | {e['old_us']:.1f} "
                     f"| {gbs(e, e['old_us']):.0f} | {e['new_us']:.1f} | {gbs(e, e['new_us']):.0f} "
                     f"| {e['old_us'] / e['new_us']:.2f}x | {best[0]} ({best[1]:.1f}) "
                     f"| {e['old_max_abs_err']:.1e} / {e['new_max_abs_err']:.1e} |")
    lines += ["", "Sweep (us): " + "; ".join(
        f"{e['seqs']}x{e['context']} {e['pool']}: " + ", ".join(f"{t} {us:.1f}" for t, us in e["tilings_us"].items())
        for e in entries if e["tilings_us"]), ""]
    return "\n".join(lines)


def shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",") if shape]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encoder", default="256x512,16x512", help="batch x length shapes of the encoder attention")
    p.add_argument("--encoder-sweep", default="1", help="0: the encoder kernels at their default tilings only; "
                   "DENSE_SWEEP keys (comma-separated): those entries alone")
    p.add_argument("--flex", action="store_true", help="time FlexAttention (torch.compile) in the encoder section")
    p.add_argument("--encoder-defaults", default=",".join(DENSE_KERNELS),
                   help="encoder kernels timed at their default tiling (comma-separated; \"\" none)")
    p.add_argument("--no-sdpa", action="store_true", help="skip the encoder section's torch SDPA paths")
    p.add_argument("--ceilings", action="store_true", help="also time the encoder without T5's bias work (the "
                   "default kernel with max_distance 1; torch's flash attention without a bias)")
    p.add_argument("--encoder-md", default=None, help="write the encoder section's markdown here (after every shape)")
    p.add_argument("--decode", default="256x64x160,256x128x160,64x128x160",
                   help="sequences x context x table width of the decode self-attention")
    p.add_argument("--paths", default="bf16,fp8", help="pool dtypes of the decode paths section (\"\" skips it)")
    p.add_argument("--paths-batches", default="64,256", help="rows of the decode paths section")
    p.add_argument("--paths-contexts", default="32,128", help="contexts of the decode paths section")
    p.add_argument("--sweep-pools", default="bf16", help="pools whose decode paths cases time DECODE_SWEEP too "
                   "(each tiling compiles once a pool dtype)")
    p.add_argument("--out", default="t5_attention.json")
    p.add_argument("--md", default=None, help="also write the decode paths section's markdown here")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    results = {"date": utc_now(), "machine": machine_summary("cuda"), "commit": git_commit(), "encoder": [],
               "decode": [], "decode_paths": []}
    def save_encoder(entry: dict) -> None:  # the finished shapes and this one so far
        Path(args.out).write_text(json.dumps({**results, "encoder": results["encoder"] + [entry]}, indent=2))
        if args.encoder_md:
            Path(args.encoder_md).write_text(encoder_markdown(results["encoder"] + [entry], argv))

    for batch, length in shapes(args.encoder):
        sweep = {"0": False, "1": True}.get(args.encoder_sweep, args.encoder_sweep.split(","))
        results["encoder"].append(encoder_case(batch, length, device, sweep=sweep, flex=args.flex, on_path=save_encoder,
                                               defaults=[k for k in args.encoder_defaults.split(",") if k],
                                               sdpa=not args.no_sdpa, ceilings=args.ceilings))
    if results["encoder"]:
        print(encoder_markdown(results["encoder"], argv))
    for seqs, context, width in shapes(args.decode):
        results["decode"].append(decode_case(seqs, context, width, device))
        print(results["decode"][-1], flush=True)
    pools = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    for name in (n for n in args.paths.split(",") if n):
        for seqs in (int(n) for n in args.paths_batches.split(",")):
            for context in (int(n) for n in args.paths_contexts.split(",")):
                results["decode_paths"].append(decode_paths_case(seqs, context, pools[name], device,
                                                                 sweep=name in args.sweep_pools.split(",")))
                print(results["decode_paths"][-1], flush=True)
                if args.md:  # after every case: a run cut short keeps what it measured
                    Path(args.md).write_text(decode_paths_markdown(results["decode_paths"], argv))
    Path(args.out).write_text(json.dumps(results, indent=2))
    if results["decode_paths"]:
        print(decode_paths_markdown(results["decode_paths"], argv))
    return results


if __name__ == "__main__":
    main()
