"""kernels/cross_attention_decode.py against its reference and against the paged-attention path the
unfused decoder takes for cross-attention (kernels/attention.py with one-query rows): rows of
different encoder lengths over shuffled blocks of a head-major pool, splits past a row's keys.
GPU: bf16; CPU: Triton's interpreter (TRITON_INTERPRET=1) in float32, else the references only."""
from __future__ import annotations

import torch
from kernel_testing import relative_error

from kernels.attention import paged_attention
from kernels.attention_metadata import AttentionMetadata


def _case(device, dtype, lengths=(300, 17, 129), heads=3, dim=64, page=32):
    gen = torch.Generator().manual_seed(len(lengths))
    width = -(-max(lengths) // page) + 1
    blocks = len(lengths) * width
    # head-major in memory, viewed (blocks, page, heads, dim) as the runner's pools are
    pool = torch.randn(2, blocks, heads, page, dim, generator=gen).to(dtype).to(device).transpose(2, 3)
    tables = torch.randperm(blocks, generator=gen)[:len(lengths) * width].view(len(lengths), width).int().to(device)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype).to(device)
    return q, pool[0], pool[1], tables, torch.tensor(lengths, dtype=torch.int32, device=device)


def test_reference_equals_paged_attention():
    from kernels.cross_attention_decode import cross_attention_decode

    q, k, v, tables, lengths = _case("cpu", torch.float32)
    n = q.shape[0]
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=tables,
                             cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), context_lens=lengths,
                             max_seqlen_q=1, max_context_len=int(lengths.max()), is_decode_only=True,
                             cu_seqlens_q_host=list(range(n + 1)), context_lens_host=lengths.tolist())
    expected = paged_attention(q, k, v, meta, 0.125)
    torch.testing.assert_close(cross_attention_decode(q, k, v, tables, lengths, 0.125, 300), expected,
                               rtol=1e-5, atol=1e-5)


def test_kernel_matches_reference(device):
    from kernels.cross_attention_decode import cross_attention_decode_ref, cross_attention_decode_triton

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, tables, lengths = _case(device, dtype)
    expected = cross_attention_decode_ref(q, k, v, tables, lengths, 0.125)
    for max_len in (300, 520):  # a launch sized for longer inputs (a graph's): splits past every row's keys
        got = cross_attention_decode_triton(q, k, v, tables, lengths, 0.125, max_len)
        assert relative_error(got, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5), max_len
    short = torch.tensor([100], dtype=torch.int32, device=device)
    one = cross_attention_decode_triton(q[:1], k, v, tables[:1], short, 0.125, 100)  # one split, no merge
    assert relative_error(one, cross_attention_decode_ref(q[:1], k, v, tables[:1], short, 0.125)) < (
        1e-2 if dtype == torch.bfloat16 else 1e-5)
