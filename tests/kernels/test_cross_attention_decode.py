"""kernels/cross_attention_decode.py (kernels/one_query_attention.py's kernel without a bias) against its
reference and against the general paged kernel the engine took before (kernels/attention.py with
one-query rows): rows of different encoder lengths over shuffled blocks of a head-major pool, bf16 /
fp32 and FP8 E4M3 pools, key splits (merged) and splits past a row's keys, heads a program that do not
divide the heads, a CUDA-graph replay of a padded bucket. GPU: bf16 queries; CPU: Triton's interpreter
(TRITON_INTERPRET=1) in float32, else the references only."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error, replayed

from kernels.attention import paged_attention
from kernels.attention_metadata import AttentionMetadata

FP8 = torch.float8_e4m3fn


def _case(device, dtype, lengths=(300, 17, 129), heads=3, dim=64, page=32, pool_dtype=None):
    gen = torch.Generator().manual_seed(len(lengths))
    width = -(-max(lengths) // page) + 1
    blocks = len(lengths) * width
    # head-major in memory, viewed (blocks, page, heads, dim) as the runner's pools are
    pool = torch.randn(2, blocks, heads, page, dim, generator=gen).to(pool_dtype or dtype).to(device).transpose(2, 3)
    tables = torch.randperm(blocks, generator=gen)[:len(lengths) * width].view(len(lengths), width).int().to(device)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype).to(device)
    return q, pool[0], pool[1], tables, torch.tensor(lengths, dtype=torch.int32, device=device)


def _meta(tables, lengths):
    n = tables.shape[0]
    return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=tables.device), block_tables=tables,
                             cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=tables.device),
                             context_lens=lengths, max_seqlen_q=1, max_context_len=int(lengths.max()),
                             is_decode_only=True, cu_seqlens_q_host=list(range(n + 1)),
                             context_lens_host=lengths.tolist())


def test_reference_equals_paged_attention():
    from kernels.cross_attention_decode import cross_attention_decode

    q, k, v, tables, lengths = _case("cpu", torch.float32)
    expected = paged_attention(q, k, v, _meta(tables, lengths), 0.125)
    torch.testing.assert_close(cross_attention_decode(q, k, v, tables, lengths, 0.125, 300), expected,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool", ["model", "fp8"])
def test_kernel_matches_reference(device, pool):
    """Splits 1 and 4 and decode_splits' choice; a launch sized for longer inputs (a graph's: splits past
    every row's keys); 2 heads a program over 3 heads, with the next key tile prefetched (stages 2); one row of
    one split (no merge)."""
    from kernels.cross_attention_decode import cross_attention_decode_ref, cross_attention_decode_triton, cross_tiling

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, tables, lengths = _case(device, dtype, lengths=(150, 17, 70), pool_dtype=FP8 if pool == "fp8" else None)
    expected = cross_attention_decode_ref(q, k, v, tables, lengths, 0.125)
    default = cross_tiling(k.dtype, *q.shape[:2])
    for tiling, splits, max_len in ((default, 1, 150), (default, 4, 150), (default, None, 300),
                                    ((2, 16, 1, 2), 2, 300)):
        got = cross_attention_decode_triton(q, k, v, tables, lengths, 0.125, max_len, tiling=tiling, splits=splits)
        assert relative_error(got, expected) < TOLERANCE[dtype], (tiling, splits, max_len)
    short = torch.tensor([100], dtype=torch.int32, device=device)
    one = cross_attention_decode_triton(q[:1], k, v, tables[:1], short, 0.125, 100)
    assert relative_error(one, cross_attention_decode_ref(q[:1], k, v, tables[:1], short, 0.125)) < TOLERANCE[dtype]


def test_kernel_matches_the_general_paged_kernel(device):
    """The engine's path before (kernels/triton_attention.py, $TRITONLLM_ENCDEC_CROSS_KERNEL=0) on the same
    rows: both kernels against each other, splits 1 and 4."""
    from kernels.cross_attention_decode import cross_attention_decode_triton
    from kernels.triton_attention import paged_attention_triton

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, tables, lengths = _case(device, dtype, lengths=(70, 9, 40), dim=32)
    old = paged_attention_triton(q, k, v, _meta(tables, lengths), 0.125)
    for splits in (1, 4):
        new = cross_attention_decode_triton(q, k, v, tables, lengths, 0.125, 70, splits=splits)
        assert relative_error(new, old) < 2 * TOLERANCE[dtype], splits


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_replays_in_a_cuda_graph(device, splits):
    """A bucket of 4 rows captured once (the 4th a padding row: length 1 over block 0, as
    engine/encoder_decoder/decode_graphs.py fills it), replayed after the queries change."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from kernels.cross_attention_decode import cross_attention_decode_ref, cross_attention_decode_triton

    q, k, v, tables, lengths = _case(device, torch.bfloat16, lengths=(300, 17, 129, 1), pool_dtype=FP8)
    tables[3].zero_()
    def launch():
        return cross_attention_decode_triton(q, k, v, tables, lengths, 0.125, 512, splits=splits)

    launch()  # compiled before the capture
    out = replayed(launch, q)
    ref = cross_attention_decode_ref(q, k, v, tables, lengths, 0.125)
    assert relative_error(out[:3], ref[:3]) < TOLERANCE[torch.bfloat16]

