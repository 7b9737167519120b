"""Decode cross-attention (kernels/cross_attention_decode.py) against the general paged kernel it replaces, one GPU.

    python benchmarks/kernels/cross_attention_bench.py --out cross_attention.json --md cross_attention.md

Every row one query token over its request's encoder K/V (``--shapes`` rows x heads x keys, head dim 64,
every row the full length), cross pools of 32-token pages (head-major, as the runner allocates them,
shuffled block tables) in ``--pools`` (bf16, FP8 E4M3): the general paged kernel
(kernels/attention.py ``paged_attention``, the engine's path before, $TRITONLLM_ENCDEC_CROSS_KERNEL=0)
against ``cross_attention_decode_triton`` at its defaults (``cross_tiling``, ``decode_splits``) and at
the ``--tilings`` x ``--splits`` sweep. Device time from CUDA-graph replays of one call per
pool copy (benchmarks/common.py ``graph_call_us``; enough copies that they do not fit in L2); GB/s = K/V bytes
read / time, beside a same-run device-to-device copy rate (read + write bytes / time, the
roofline the goal of 85% refers to). Each case checks both paths against the float32 reference
(first rows). Markdown (date, machine, commit) to ``--md`` and JSON to ``--out``, rewritten after every timing (a
timeout keeps the finished ones).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import (command_line, copy_bandwidth, git_commit, graph_call_us, machine_summary,  # noqa: E402
                               utc_now)
from kernels.attention import paged_attention  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.cross_attention_decode import (cross_attention_decode_ref, cross_attention_decode_triton,  # noqa: E402
                                            cross_tiling)
from kernels.one_query_attention import decode_splits  # noqa: E402

DIM, PAGE, SCALE = 64, 32, 0.125
L2_BYTES = 60 << 20  # pools this large in all are read from HBM (H200: 50 MB of L2)
POOLS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def cross_meta(tables: torch.Tensor, keys: int) -> AttentionMetadata:
    """The runner's cross metadata (engine/encoder_decoder/model.py cross_metadata): row i its own sequence."""
    rows, device = tables.shape[0], tables.device
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), block_tables=tables,
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device),
        context_lens=torch.full((rows,), keys, dtype=torch.int32, device=device), max_seqlen_q=1,
        max_context_len=keys, is_decode_only=True, cu_seqlens_q_host=list(range(rows + 1)),
        context_lens_host=[keys] * rows)


def case(rows: int, heads: int, keys: int, pool: str, tilings: list, splits_list: list[int], device,
         progress=lambda entry: None) -> dict:
    """One shape and pool; ``progress(entry)`` after each timing of the sweep (a run cut short keeps them)."""
    dtype = POOLS[pool]
    pages = -(-keys // PAGE)
    blocks = rows * pages + 1
    kv_bytes = 2 * rows * keys * heads * DIM * torch.empty(0, dtype=dtype).element_size()
    copies = max(1, min(8, -(-L2_BYTES // kv_bytes)))
    inputs = []
    for _ in range(copies):
        k_cache, v_cache = (torch.randn(blocks, heads, PAGE, DIM, device=device, dtype=torch.bfloat16)
                            .to(dtype).transpose(1, 2) for _ in range(2))
        tables = (torch.randperm(blocks - 1, device=device)[:rows * pages].view(rows, pages) + 1).int()
        q = torch.randn(rows, heads, DIM, device=device, dtype=torch.bfloat16)
        inputs.append((q, k_cache, v_cache, tables, cross_meta(tables, keys)))
    q, k_cache, v_cache, tables, meta = inputs[0]
    checked = min(rows, 8)
    ref = cross_attention_decode_ref(q[:checked], k_cache, v_cache, tables[:checked], meta.context_lens[:checked],
                                     SCALE).float()

    def old(q, k_cache, v_cache, tables, meta):
        return paged_attention(q, k_cache, v_cache, meta, SCALE)

    def new(q, k_cache, v_cache, tables, meta, **options):
        return cross_attention_decode_triton(q, k_cache, v_cache, tables, meta.context_lens, SCALE, keys, **options)

    def timed(fn, **options) -> tuple[float, float]:
        err = (fn(*inputs[0], **options)[:checked].float() - ref).abs().max().item()
        return graph_call_us(lambda *a: fn(*a, **options), inputs), err

    old_us, old_err = timed(old)
    new_us, new_err = timed(new)
    tiling = cross_tiling(dtype, rows, heads)
    step_bytes = 2 * tiling[0] * tiling[1] * DIM * torch.empty(0, dtype=dtype).element_size()
    entry = {"rows": rows, "heads": heads, "keys": keys, "pool": pool, "kv_mb": kv_bytes / 1e6, "copies": copies,
             "default_tiling": str(tiling), "default_splits": decode_splits(rows, -(-heads // tiling[0]), keys,
                                                                             tiling[1], step_bytes, device),
             "old_us": old_us, "old_max_abs_err": old_err, "new_us": new_us, "new_max_abs_err": new_err,
             "sweep_us": {}}
    for tiling in tilings:
        for splits in splits_list or [None]:
            name = f"{tiling} s{splits or 'auto'}"
            try:
                us, err = timed(new, tiling=tiling, splits=splits)
                entry["sweep_us"][name] = us if err <= 4 * max(new_err, 1e-2) else f"err {err:.1e}"
            except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is reported, not fatal
                entry["sweep_us"][name] = repr(exc)[:80]
            progress(entry)
    return entry


def markdown(results: dict, argv: list[str] | None) -> str:
    copy = results["copy_GBps"]
    gbs = lambda e, us: e["kv_mb"] * 1e3 / us  # noqa: E731  (MB / us = TB/s; x1e3: GB/s)
    quoted = [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]
    lines = [f"### Decode cross-attention: one-query kernel vs the general paged kernel ({results['date']})", "",
             f"{results['machine']}, commit {results['commit']}, `{command_line(__file__, quoted)}`. "
             f"Head dim {DIM}, "
             f"pages of {PAGE}, every row the full encoder length; us from CUDA-graph replays (pool copies past L2); "
             f"GB/s = K/V bytes / time; same-run copy rate {copy:.0f} GB/s (read + write). Tilings: (heads a "
             f"program, keys a step, warps, stages; stages 2: the next tile prefetched), s: key splits.", "",
             "| rows x heads x keys | pool | K/V MB | paged kernel us | GB/s | new us (tiling, splits) | GB/s "
             "| % of copy | speedup | best sweep (us, % of copy) | max abs err old / new |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for e in results["cases"]:
        timed = {k: v for k, v in e["sweep_us"].items() if isinstance(v, float)}
        best = min(timed.items(), key=lambda kv: kv[1], default=("-", float("nan")))
        lines.append(f"| {e['rows']} x {e['heads']} x {e['keys']} | {e['pool']} | {e['kv_mb']:.1f} | {e['old_us']:.1f} "
                     f"| {gbs(e, e['old_us']):.0f} | {e['new_us']:.1f} ({e['default_tiling']}, s{e['default_splits']}) "
                     f"| {gbs(e, e['new_us']):.0f} | {100 * gbs(e, e['new_us']) / copy:.0f}% "
                     f"| {e['old_us'] / e['new_us']:.2f}x | {best[0]} ({best[1]:.1f}, "
                     f"{100 * gbs(e, best[1]) / copy:.0f}%) "
                     f"| {e['old_max_abs_err']:.1e} / {e['new_max_abs_err']:.1e} |")
    lines += ["", "Sweep (us): " + "; ".join(
        f"{e['rows']}x{e['heads']}x{e['keys']} {e['pool']}: "
        + ", ".join(f"{t} {us:.1f}" if isinstance(us, float) else f"{t} {us}" for t, us in e["sweep_us"].items())
        for e in results["cases"] if e["sweep_us"]), ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="256x32x512,64x32x512,64x20x1500,1x20x1500", help="rows x heads x keys")
    p.add_argument("--pools", default="fp8,bf16")
    p.add_argument("--tilings", default="1x32x1x1,1x64x1x1,1x64x2x1,2x32x1x1,2x32x2x1,1x16x1x1,1x128x4x1",
                   help="HEADS x BLOCK_N x warps x stages tilings swept (\"\" none)")
    p.add_argument("--splits", default="", help="split counts swept at each tiling (\"\": decode_splits only)")
    p.add_argument("--out", default="cross_attention.json")
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    tilings = [tuple(int(n) for n in t.split("x")) for t in args.tilings.split(",") if t]
    splits_list = [int(n) for n in args.splits.split(",") if n]
    results = {"date": utc_now(), "machine": machine_summary("cuda"), "commit": git_commit(),
               "copy_GBps": copy_bandwidth("cuda") / 1e9, "cases": []}
    print(f"copy rate {results['copy_GBps']:.0f} GB/s", flush=True)
    for shape in (s for s in args.shapes.split(",") if s):
        rows, heads, keys = (int(n) for n in shape.split("x"))
        for pool in (n for n in args.pools.split(",") if n):
            done = list(results["cases"])

            def save(entry, done=done):  # after every timing: a run cut short keeps what it measured
                results["cases"] = done + [entry]
                if args.md:
                    Path(args.md).write_text(markdown(results, argv))
                Path(args.out).write_text(json.dumps(results, indent=2))

            save(case(rows, heads, keys, pool, tilings, splits_list, device, progress=save))
            print(results["cases"][-1], flush=True)
    print(markdown(results, argv))
    return results


if __name__ == "__main__":
    main()
