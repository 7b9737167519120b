#!/usr/bin/env python3
"""The MLA decode kernel alone (kernels/mla_attention.py, issue 55): achieved bandwidth over the latent
cache at contexts 1k-32k, against the GPU's copy bandwidth (goal >= 80%).

    PYTHONPATH=$PWD python benchmarks/kernels/mla_kernel_bench.py [--shape v3|v2_lite] [--contexts 1024,...,32768]
        [--batches 1,8,32] [--pool bf16,fp8] [--tree 0] [--configs auto,auto+cvt,16:128:64,...] [--v-dim 128]
        [--graph-max-context 4096] [--check] [--out mla.json] [--markdown FILE]
    PYTHONPATH=$PWD python benchmarks/kernels/mla_kernel_bench.py --tiny   # CPU, seconds: the reference, tiny shape

One layer's decode step: ``batch`` sequences of ``context`` cached latent rows each (pages shuffled
through a pool far larger than L2), one new token each, all of the shape's heads (DeepSeek-V3: 128
heads, V2-Lite: 16; kv_lora_rank 512 + rope 64 per row). A decode row must read each of its
sequence's rows once: bytes = batch x context x (R + P) x pool itemsize, the kernel's whole traffic up
to the queries and the (T, splits, H, R) float32 partials.

Timing: device time from CUDA-graph replays (benchmarks.common.graph_call_us), as the engine runs a
decode step; one graph holds one call per set of block tables, the sets' pages disjoint in a pool of
>= 256 MB, so the rows come from HBM, not from L2 (a batch-1 1k context is 1.2 MB). The column
"eager us" is what an eager call costs between CUDA events: the host's launches (the token map's
three torch ops, the kernel's, the combine's) when the host is slower than the device. It was
the only timing before 2026-11-29 14:xx, and the 403-420 us it gave at batch 1 for 1k-32k contexts
were that host time, not the kernel's (the engine's decode graphs replay the kernel in ~7 us).

Compute: each head does R + P + R multiply-adds a key (scores over [c | k_r], then the value sum over
c), 2,176 flops for DeepSeek's 512 + 64: 278,528 a key over V3's 128 heads against 1,152 bytes in
bf16, 242 flops a byte. At the H200's ~4.2 TB/s that is ~1,000 TFLOPS, its dense bf16 peak: 128
heads are compute-bound (the TFLOPS column), and 80% of the copy bandwidth is out of reach for a
kernel on mma.sync tensor cores (16-row head groups); 16 heads (V2-Lite, V3 at TP 8) are
memory-bound, where the goal applies.

``--configs`` block_h:max_splits:min_span[:block_n[:num_warps]], the kernel's tunables
(mla_attention_triton): the default 16:128:64 (block_n 32, 4 warps); 16:16:32 is the split policy
before 2026-11-29 (at most 16 splits of >= 1 tile). What ptxas gave for sm_90 (Triton 3.9 on the CPU,
bf16): 16 heads x 32 keys on 4 warps 255 registers with spills (likely the score product's A operand,
the 16 x 512 absorbed queries, held whole by each warp: 128 registers), on 8 warps 184, 16 x 16 on 4
warps 220, 32 x 16 on 8 warps 203; none software-pipelines the latent tile there (only the
block-table loads become cp.async; but that Triton pipelined no textbook attention loop either), so
latency may be hidden only by the 1-2 programs an SM holds.
``--configs d<block_n>:warps:stages[:max_splits[:min_span[:programs_per_sm]]]``: the decode kernel
(kernels/mla_decode.py: one page's run of rows a tile, software-pipelined; stages 0 = the next tile
prefetched into registers) at that tiling and split policy.
``--tree N``: each sequence verifies an N-node chain instead (the tree-mask path).
``--configs auto``: mla_attention_triton's own choice (the engine's), the kernel that ran in the "kernel" column;
endings (parse_config) switch one option for an A/B in one process, e.g. ``auto+cvt`` (FP8 codes widened by
Triton's conversion, the path before session 29) or ``auto+L0`` (the split policy before). ``--v-dim``: W_UV
applied in the combine as the engine's layers do; ``--graph-max-context``: splits sized as a decode graph captured
for that longest context sizes them. The "of copy" fraction: latent bytes a second over copy_bandwidth's (a 2 GiB
device-to-device copy, read + write counted) measured at the start of the same process.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (command_line, copy_bandwidth, cuda_time_ms, git_commit, graph_call_us,  # noqa: E402
                               int_list, machine_summary, print_table, utc_now)
from kernels.attention import KV_FP8_DTYPE  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels import mla_decode  # noqa: E402
from kernels.mla_decode import DECODE_TILING, DECODE_TILING_PARTS, decode_kernel_default, widens_by_bits  # noqa: E402
from kernels.mla_attention import (MAX_SPLITS, MIN_SPAN, decode_kernel_enabled, decode_tiling_for,  # noqa: E402
                                   default_column_parts, launch_splits, mla_attention_ref, mla_attention_triton)

SHAPES = {"v3": dict(heads=128, rank=512, rope=64), "v2_lite": dict(heads=16, rank=512, rope=64),
          "tiny": dict(heads=4, rank=32, rope=8)}
PAGE = 64
GOAL = 0.80
POOL_BYTES = 256 << 20  # the graph's sets of block tables cover at least this much pool (> 5x L2)
MAX_SETS = 128


def decode_step(shape: dict, batch: int, context: int, pool: str, tree: int, device: str, dtype: torch.dtype,
                sets: int = 1, max_context_len: int | None = None):
    """(q_latent, q_rope, cache, metas) of one layer's step: ``batch`` sequences at ``context`` keys
    each, their last max(1, tree) tokens new (a chain's tree mask when tree > 0); ``sets`` metadata
    whose block tables take disjoint shuffled pages of one pool (timing from HBM, not L2).
    ``max_context_len``: the metadata's (a decode graph's: the longest context it may serve, which sizes
    the key splits); None: ``context``."""
    heads, rank, rope = shape["heads"], shape["rank"], shape["rope"]
    q_len = max(1, tree)
    pages = -(-context // PAGE)
    num_blocks = sets * batch * pages + 1
    order = list(range(1, num_blocks))
    random.Random(0).shuffle(order)
    cache = torch.randn(num_blocks, PAGE, rank + rope, device=device, dtype=dtype)
    if pool == "fp8":
        cache = cache.to(KV_FP8_DTYPE)
    all_tables = torch.tensor(order, dtype=torch.int32, device=device).view(sets, batch, pages)
    cu = [i * q_len for i in range(batch + 1)]
    metas = []
    for tables in all_tables:
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=device), block_tables=tables,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
            max_seqlen_q=q_len, max_context_len=max(context, max_context_len or 0), is_decode_only=q_len == 1,
            cu_seqlens_q_host=cu, context_lens_host=[context] * batch)
        if tree:  # a chain: node j sees nodes 0..j (the causal rows, through the tree-mask path)
            chain = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool, device=device))
            meta.tree_mask = chain.repeat(batch, 1)
        metas.append(meta)
    q_latent = torch.randn(cu[-1], heads, rank, device=device, dtype=dtype)
    q_rope = torch.randn(cu[-1], heads, rope, device=device, dtype=dtype)
    return q_latent, q_rope, cache, metas


CONFIG_KEYS = ("block_h", "max_splits", "min_span", "block_n", "num_warps")
DECODE_KEYS = ("block_n", "num_warps", "stages", "max_splits", "min_span", "programs_per_sm")


def parse_config(text: str) -> dict:
    """"16:128:64" -> dict(block_h=16, max_splits=128, min_span=64, decode_kernel=False): the general
    kernel, two more fields optional, block_n and num_warps ("16:128:64:32:8"), the kernel's defaults
    where left out. "d32:4:3" -> the decode kernel (kernels/mla_decode.py) at BLOCK_N 32, 4 warps, 3
    stages (0: the register prefetch), then optionally max_splits, min_span, programs_per_sm
    ("d32:4:3:256:32:4"; left out: kernels/mla_decode.py's DECODE_SPLITS). "auto": what
    mla_attention_triton picks by itself (the engine's path: kernel, tiling, splits, FP8 widening).
    Endings: "+cvt" an FP8 pool's codes widened by Triton's conversion (the path before session 29;
    TRITONLLM_MLA_FP8_BITS=0), "+bits" by bits (kernels/e4m3_bits.py), neither: the kernel's default;
    "+c<N>" the combine's loads N splits at a time (0: all the grid's, the combine before session 29);
    "+h" the splits' partials in the queries' dtype (half_partials), "+f" in float32; "+k" the decode kernel's
    products with the keys as rows (keys_major); "+L<N>" the
    decode split policy's long_span (0: the grid always 8 times the SMs, the policy before session 29); "+p<N>" the
    decode kernel's latent in N (2, 4, 8) column parts (kernels/mla_decode_parts.py; "auto+pN": DECODE_TILING_PARTS[N]),
    "+p1" the one-part kernel ("auto" alone: kernels/mla_attention.py default_column_parts' choice); "+t" each tile's
    page looked up a tile ahead (table_ahead: kernels/mla_decode.py DECODE_TABLE_AHEAD), "+t0" not."""
    base, *options = text.split("+")
    widening = {}
    for option in options:
        assert option in ("cvt", "bits", "h", "f", "k", "t", "t0") or (
            option[:1] in "cLp" and option[1:].isdigit()), \
            f"--configs {text!r}: the endings are +cvt, +bits, +c<splits>, +h, +f, +k, +L<keys>, +p<parts>, +t, +t0"
        if option in ("t", "t0"):
            widening["table_ahead"] = option == "t"
        elif option in ("cvt", "bits"):
            widening["fp8_bits"] = option == "bits"
        elif option in ("h", "f"):
            widening["half_partials"] = option == "h"
        elif option == "k":
            widening["keys_major"] = True
        elif option[0] == "L":
            widening["long_span"] = int(option[1:])
        elif option[0] == "p":
            widening["parts"] = int(option[1:])
        else:
            widening["combine_chunk"] = int(option[1:])
    if base == "auto":
        return dict(auto=True, **widening)
    if base.startswith("d"):
        values = [int(x) for x in base[1:].split(":")]
        assert 3 <= len(values) <= len(DECODE_KEYS), f"--configs {text!r}: d<block_n>:warps:stages[:max_splits" \
                                                     "[:min_span[:programs_per_sm]]][+cvt|+bits]"
        got = dict(zip(DECODE_KEYS, values))
        block_n, warps, stages = got.pop("block_n"), got.pop("num_warps"), got.pop("stages")
        return dict(decode_kernel=True, decode_tiling=(block_n, warps, stages), **got, **widening)
    values = [int(x) for x in base.split(":")]
    assert 3 <= len(values) <= len(CONFIG_KEYS), f"--configs {text!r}: block_h:max_splits:min_span[:block_n[:warps]]"
    return dict(zip(CONFIG_KEYS, values), decode_kernel=False, **widening)


def config_name(config: dict) -> str:
    """parse_config's input back (the table's and the JSON's config column)."""
    ending = ("" if "fp8_bits" not in config else "+bits" if config["fp8_bits"] else "+cvt") + (
        "" if "combine_chunk" not in config else f"+c{config['combine_chunk']}") + (
        "" if "half_partials" not in config else "+h" if config["half_partials"] else "+f") + (
        "+k" if config.get("keys_major") else "") + (
        "" if "long_span" not in config else f"+L{config['long_span']}") + (
        "" if "parts" not in config else f"+p{config['parts']}") + (
        "" if "table_ahead" not in config else "+t" if config["table_ahead"] else "+t0")
    if config.get("auto"):
        return "auto" + ending
    if config.get("decode_kernel"):
        extra = [config[k] for k in DECODE_KEYS[3:] if k in config]
        return "d" + ":".join(str(v) for v in (*config["decode_tiling"], *extra)) + ending
    return ":".join(str(config[k]) for k in CONFIG_KEYS if k in config) + ending


def kernel_args(config: dict) -> dict:
    """mla_attention_triton's keyword arguments for ``config`` (an "auto" one: none but the widening)."""
    return {k: v for k, v in config.items() if k != "auto"}


def resolved(config: dict, pool: str, dtype: torch.dtype, num_tokens: int, heads: int, decode: bool = True,
             device="cuda", max_context_len: int | None = None, rank: int = 512) -> dict:
    """``config`` as mla_attention_triton resolves it for a step (``decode``: every sequence one new token)
    on a CUDA device: an "auto" one through the same rules (decode_kernel_enabled, kernels/mla_decode.py
    widens_by_bits and decode_kernel_default, kernels/mla_attention.py decode_tiling_for and default_column_parts);
    fp8_bits filled in."""
    fp8_pool = pool == "fp8"
    bits = widens_by_bits(fp8_pool, dtype, True, config.get("fp8_bits"))
    out = dict(kernel_args(config), fp8_bits=bits)
    if config.get("auto"):
        programs = num_tokens * -(-heads // 16)
        use_decode = decode and decode_kernel_enabled() and decode_kernel_default(fp8_pool, programs, bits)
        out["decode_kernel"] = use_decode
        if use_decode:
            tiling, keys_major = decode_tiling_for(fp8_pool, bits, PAGE, num_tokens, heads, 16, device, max_context_len,
                                                   None, config.get("max_splits"), config.get("min_span"),
                                                   config.get("programs_per_sm"), config.get("long_span"))
            if config.get("parts", 1) > 1:  # mla_attention_triton's tiling for the column-parts kernel
                tiling, keys_major = DECODE_TILING_PARTS[config["parts"]], False
            elif "parts" not in config:  # default_column_parts, once the grid is known
                splits = launch_splits(num_tokens, heads, 16, device, True, tiling[0], max_context_len,
                                       config.get("max_splits"), config.get("min_span"),
                                       config.get("programs_per_sm"), config.get("long_span"))[0]
                parts = default_column_parts(rank, tiling, keys_major, num_tokens * -(-heads // 16) * splits, device,
                                             PAGE)
                if parts > 1:
                    out["parts"], tiling = parts, DECODE_TILING_PARTS[parts]
            out["decode_tiling"] = tiling
            out.setdefault("keys_major", keys_major)
            out.setdefault("table_ahead", mla_decode.DECODE_TABLE_AHEAD)  # mla_attention_triton's default
    return out


def chosen_name(config: dict, pool: str) -> str:
    """What ran (a resolved() config), for the log and the JSON: "general", or the decode tiling and, for an
    FP8 pool, the widening."""
    if not config.get("decode_kernel"):
        return "general"
    widening = ("+bits" if config["fp8_bits"] else "+cvt") if pool == "fp8" else ""
    return "d" + ":".join(map(str, config["decode_tiling"])) + widening + ("+k" if config.get("keys_major") else "") + (
        f"+p{config['parts']}" if config.get("parts", 1) > 1 else "") + ("+t" if config.get("table_ahead") else "")


def splits_of(config: dict, num_tokens: int, heads: int, device, max_context_len: int) -> int:
    """The split count mla_attention_triton picks for ``config`` (a resolved() one: kernels/mla_attention.py
    launch_splits with its arguments)."""
    decode = config.get("decode_kernel", False)
    return launch_splits(num_tokens, heads, config.get("block_h", 16), device, decode,
                         config["decode_tiling"][0] if decode else config.get("block_n", 32), max_context_len,
                         config.get("max_splits"), config.get("min_span"), config.get("programs_per_sm"),
                         config.get("long_span"))[0]


def run(args: argparse.Namespace) -> dict:
    shape = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(args.device, repeat=20) or None  # None: no roofline (CPU)
    scale = (shape["rank"] // 4 + shape["rope"]) ** -0.5
    rows = []
    for pool in args.pool:
        for batch in args.batches:
            for context in args.contexts:
                row_bytes = (shape["rank"] + shape["rope"]) * (1 if pool == "fp8" else dtype.itemsize)
                read = batch * context * row_bytes
                sets = 1 if args.device == "cpu" else max(1, min(MAX_SETS, -(-POOL_BYTES // read)))
                q_latent, q_rope, cache, metas = decode_step(shape, batch, context, pool, args.tree, args.device,
                                                             dtype, sets, args.graph_max_context)
                flops = q_latent.shape[0] * shape["heads"] * context * 2 * (2 * shape["rank"] + shape["rope"])
                w_uv = None  # --v-dim: W_UV (H, V, R) applied by the combine, as the engine's layers do
                if args.v_dim:
                    w_uv = (torch.randn(shape["heads"], args.v_dim, shape["rank"], device=args.device)
                            * shape["rank"] ** -0.5).to(dtype)
                want = None  # --check: the torch reference's output (float32 math), once per shape
                if args.check and args.device != "cpu":
                    want = mla_attention_ref(q_latent, q_rope, cache, metas[0], scale).float()
                    if w_uv is not None:
                        want = torch.einsum("thr,hvr->thv", want.to(dtype).float(), w_uv.float())
                for config in (args.configs if args.device != "cpu" else [None]):
                    if config is None:  # the CPU: the reference, wall time
                        call = lambda meta: mla_attention_ref(q_latent, q_rope, cache, meta, scale)  # noqa: E731
                        call(metas[0])
                        start = time.perf_counter()
                        for _ in range(args.repeat):
                            call(metas[0])
                        us = eager_us = (time.perf_counter() - start) * 1e6 / args.repeat
                        splits = None
                    else:
                        call = lambda meta, c=kernel_args(config): mla_attention_triton(  # noqa: E731
                            q_latent, q_rope, cache, meta, scale, w_uv=w_uv, **c)
                        eager_us = cuda_time_ms(lambda: call(metas[0]), repeat=args.repeat) * 1e3
                        us = graph_call_us(call, [(meta,) for meta in metas])
                        ran = resolved(config, pool, dtype, q_latent.shape[0], shape["heads"], not args.tree,
                                       q_latent.device, metas[0].max_context_len, shape["rank"])
                        splits = splits_of(ran, q_latent.shape[0], shape["heads"], q_latent.device,
                                           metas[0].max_context_len)
                    error = None if want is None else ((call(metas[0]).float() - want).norm() / want.norm()).item()
                    achieved = read / (us / 1e6)
                    rows.append(dict(pool=pool, batch=batch, context=context, tree=args.tree,
                                     config=None if config is None else config_name(config),
                                     kernel=None if config is None else chosen_name(ran, pool),
                                     us=us, eager_us=eager_us, latent_bytes=read, GBps=achieved / 1e9,
                                     TFLOPS=flops / (us / 1e6) / 1e12, splits=splits, graph_sets=sets, rel_error=error,
                                     fraction=None if bandwidth is None else achieved / bandwidth))
                    print(row_line(rows[-1]), flush=True)
                    if args.out:  # after every row: a run cut by its guard keeps what it measured
                        Path(args.out).write_text(json.dumps(dict(partial=True, copy_GBps=None if bandwidth is None
                                                                  else bandwidth / 1e9, rows=rows), indent=1))
                del q_latent, q_rope, cache, metas, w_uv
                if args.device != "cpu":
                    torch.cuda.empty_cache()
    return dict(shape=args.shape, dtype=args.dtype, device=args.device, machine=machine_summary(args.device),
                copy_GBps=None if bandwidth is None else bandwidth / 1e9, goal=GOAL, rows=rows,
                command=command_line(__file__), commit=git_commit(), date=utc_now())


def row_line(r: dict) -> str:
    """One measured row as a line of the log."""
    frac = "-" if r["fraction"] is None else f"{r['fraction']:.0%}"
    return (f"{r['pool']} batch {r['batch']} ctx {r['context']} {r['config'] or 'ref'}"
            f"{'' if r.get('kernel') in (None, r['config']) else ' (' + r['kernel'] + ')'}: {r['us']:.1f} us "
            f"(eager {r['eager_us']:.0f}) {r['GBps']:.0f} GB/s = {frac} of copy, splits {r['splits']}"
            + ("" if r.get("rel_error") is None else f", rel err {r['rel_error']:.1e}"))


def markdown(results: dict) -> str:
    bw = results["copy_GBps"]
    lines = [f"MLA decode kernel, {results['shape']} shape ({SHAPES[results['shape']]['heads']} heads), "
             f"{results['dtype']} queries, {results['machine']}; copy bandwidth "
             f"{'n/a' if bw is None else f'{bw:,.0f} GB/s'}; goal >= {GOAL:.0%} of it over the latent rows "
             f"({results['commit']}, {results['date']})", "",
             "| pool | batch | context | tree nodes | config | kernel | us / layer (graph) | eager us | latent MB | "
             "GB/s | of copy bw | TFLOPS | splits |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        frac = "-" if r["fraction"] is None else f"{r['fraction']:.0%}"
        lines.append(f"| {r['pool']} | {r['batch']} | {r['context']:,} | {r['tree'] or 1} | {r['config'] or 'ref'} | "
                     f"{r.get('kernel') or '-'} | "
                     f"{r['us']:,.1f} | {r['eager_us']:,.1f} | {r['latent_bytes'] / 1e6:,.1f} | {r['GBps']:,.0f} | "
                     f"{frac} | {r['TFLOPS']:,.1f} | {r['splits'] or '-'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="v3")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--contexts", type=int_list, default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--batches", type=int_list, default=[1, 8, 32])
    p.add_argument("--pool", default="bf16,fp8", help="comma-separated: bf16 (the queries' dtype) and/or fp8")
    p.add_argument("--tree", type=int, default=0, help="verify an N-node chain per sequence (tree-mask path)")
    p.add_argument("--v-dim", type=int, default=0,
                   help="apply a random W_UV of this value head size in the combine (the engine's path; V2-Lite and "
                        "V3: 128); 0: the latent output")
    p.add_argument("--graph-max-context", type=int, default=None,
                   help="size the key splits for this longest context, as a decode graph captured for max_seq_len "
                        "N does (default: each row's own context)")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--configs", default=f"16:{MAX_SPLITS}:{MIN_SPAN},d{':'.join(map(str, DECODE_TILING))}",
                   help="comma-separated block_h:max_splits:min_span[:block_n[:warps]] (the general kernel; 16:16:32 = "
                        "the split policy before 2026-11-29) or d<block_n>:warps:stages[:max_splits[:min_span[:pps]]] "
                        "(the decode kernel)")
    p.add_argument("--check", action="store_true",
                   help="each config's output against the torch reference (relative error column in the JSON and log)")
    p.add_argument("--tiny", action="store_true", help="tiny shape, float32, on the CPU (the reference), seconds")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None, help="append the table to this file")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.dtype, args.device, args.repeat = "tiny", "float32", "cpu", 2
        args.contexts, args.batches = [128, 512], [1, 2]
    args.pool = [x for x in args.pool.split(",") if x]
    args.configs = [parse_config(x) for x in args.configs.split(",") if x]
    if args.device == "cpu":
        args.pool = ["bf16"]  # the CPU reference reads the pool in the queries' dtype
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(markdown(results), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
