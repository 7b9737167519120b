"""T5's bias attention kernels (kernels/t5_bias_attention.py) against the torch paths they replace, one GPU.

    python benchmarks/kernels/t5_attention_bench.py --out t5_attention.json

Flan-T5-XL heads (32 x 64, bf16), random data:

- encoder: ``t5_dense_attention`` over a padded batch against torch's fused attention with the
  dense (1, heads, L, L) bias the encoder passed before (``F.scaled_dot_product_attention``), at
  ``--encoder`` batch x length shapes; the bias table's build is outside the timing for both.
- decoder self-attention, decode rows: ``t5_paged_attention`` against
  kernels/relative_position_bias.py ``decode_attention_bias`` (batched torch ops) at ``--decode``
  sequences x context shapes, on a pool of 32-token pages with shuffled tables as wide as the longest.

Each shape also checks the kernel against the float32 reference (max abs error printed) and times
the tilings of DENSE_SWEEP / PAGED_SWEEP.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import cuda_time_ms, machine_summary, utc_now  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.relative_position_bias import decode_attention_bias, position_bias  # noqa: E402
from kernels.t5_bias_attention import (distance_bias, t5_dense_attention_ref, t5_dense_attention_triton,  # noqa: E402
                                       t5_paged_attention_ref, t5_paged_attention_triton)

HEADS, DIM, BUCKETS, MAX_DISTANCE, PAGE = 32, 64, 32, 128, 32
# tilings timed beside the defaults: encoder (BLOCK_M, BLOCK_N, warps, stages), decode (BLOCK_N, warps, stages)
DENSE_SWEEP = [(128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3)]
PAGED_SWEEP = [(64, 4, 2), (32, 2, 3), (64, 2, 3), (32, 4, 2), (128, 4, 2)]


def encoder_case(batch: int, length: int, device) -> dict:
    table = torch.randn(BUCKETS, HEADS, device=device, dtype=torch.bfloat16)
    qkv = torch.randn(batch, length, 3, HEADS, DIM, device=device, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    bias = distance_bias(table, bidirectional=True, max_distance=MAX_DISTANCE)
    positions = torch.arange(length, device=device)
    dense = position_bias(table, positions, positions, bidirectional=True,
                          max_distance=MAX_DISTANCE).unsqueeze(0).to(torch.bfloat16)

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=dense, scale=1.0).transpose(1, 2)

    ours = t5_dense_attention_triton(q, k, v, lengths, 1.0, bias)
    rows = min(batch, 2)
    ref = t5_dense_attention_ref(q[:rows], k[:rows], v[:rows], lengths[:rows], 1.0, bias)
    flops = 4 * batch * HEADS * length * length * DIM
    entry = {"batch": batch, "length": length, "max_abs_err": (ours[:rows].float() - ref.float()).abs().max().item(),
             "sdpa_max_abs_err": (sdpa()[:rows].float() - ref.float()).abs().max().item(),
             "kernel_ms": cuda_time_ms(lambda: t5_dense_attention_triton(q, k, v, lengths, 1.0, bias)),
             "sdpa_bias_ms": cuda_time_ms(sdpa)}
    entry["kernel_tflops"] = flops / entry["kernel_ms"] / 1e9
    entry["sdpa_tflops"] = flops / entry["sdpa_bias_ms"] / 1e9
    entry["tilings_ms"] = {}
    for tiling in DENSE_SWEEP:
        try:
            entry["tilings_ms"][str(tiling)] = cuda_time_ms(
                lambda: t5_dense_attention_triton(q, k, v, lengths, 1.0, bias, tiling=tiling))
        except Exception as err:  # noqa: BLE001 - a tiling that does not compile (shared memory) is skipped
            entry["tilings_ms"][str(tiling)] = repr(err)[:80]
    return entry


def decode_case(num_seqs: int, context: int, width: int, device) -> dict:
    table = torch.randn(BUCKETS, HEADS, device=device, dtype=torch.bfloat16)
    pages_each = -(-width // PAGE)
    num_blocks = num_seqs * pages_each + 1
    k_cache = torch.randn(num_blocks, PAGE, HEADS, DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 1, device=device)[:num_seqs * pages_each].view(num_seqs, pages_each) + 1
    q = torch.randn(num_seqs, HEADS, DIM, device=device, dtype=torch.bfloat16)
    contexts = [max(1, context - (i % 7)) for i in range(num_seqs)]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), block_tables=tables.to(torch.int32),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device), max_seqlen_q=1,
        max_context_len=width, is_decode_only=True, cu_seqlens_q_host=list(range(num_seqs + 1)),
        context_lens_host=contexts)
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encoder", default="8x512,64x512", help="batch x length shapes of the encoder attention")
    p.add_argument("--decode", default="256x64x160,256x128x160,64x128x160",
                   help="sequences x context x table width of the decode self-attention")
    p.add_argument("--out", default="t5_attention.json")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    results = {"date": utc_now(), "machine": machine_summary("cuda"), "encoder": [], "decode": []}
    for shape in args.encoder.split(","):
        batch, length = (int(n) for n in shape.split("x"))
        results["encoder"].append(encoder_case(batch, length, device))
        print(results["encoder"][-1], flush=True)
    for shape in args.decode.split(","):
        seqs, context, width = (int(n) for n in shape.split("x"))
        results["decode"].append(decode_case(seqs, context, width, device))
        print(results["decode"][-1], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
