"""The Triton wrappers read their index, scale and weight inputs as the values those views hold,
whatever their layout (kernels/_triton.py ``dense``).

A kernel given a bare pointer reads element i at ``ptr + i``. A view that is not laid out so -- a
broadcast (stride 0: one position expanded over a tree depth's rows, commit 13783c7), every other
element of a wider buffer, a column of a table -- then reads the wrong memory, silently on CUDA
(the torch references honour strides). Each case runs a wrapper twice on the same values: once as
contiguous tensors, once as views of every other element of buffers whose other elements hold a
value that changes the result (a wrong position, slot -1, a zero weight); the outputs must be
identical. Skipped on CPU unless TRITON_INTERPRET=1 (tests/kernels/kernel_testing.py).
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from test_kernel_attention import make_batch

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def packed(t: torch.Tensor, poison) -> torch.Tensor:
    return t


def interleaved(t: torch.Tensor, poison) -> torch.Tensor:
    """t's values as every other element of a buffer whose others hold ``poison``: not contiguous,
    and a kernel reading it as packed gets the poison at odd indices (and past its end)."""
    buffer = torch.full((*t.shape, 2), poison, dtype=t.dtype, device=t.device)
    buffer[..., 0] = t
    view = buffer[..., 0]
    assert t.numel() < 2 or not view.is_contiguous()
    return view


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@case
def rotary_and_write_kv(device, view):
    from kernels.rotary import build_cos_sin_cache, rotary_and_write_kv_triton

    rows, heads, kv_heads, dim = 5, 4, 2, 16
    q, k, v = (torch.randn(rows, h, dim, generator=gen(i)).to(device)
               for i, h in enumerate((heads, kv_heads, kv_heads)))
    cache = build_cos_sin_cache(64, dim, 10000.0, device=device)
    k_cache, v_cache = (torch.zeros(3, 4, kv_heads, dim, device=device) for _ in range(2))
    positions = view(torch.tensor([20, 21, 21, 3, 40], device=device), 0)
    slots = view(torch.tensor([0, 5, 6, 11, 2], device=device), -1)
    q = rotary_and_write_kv_triton(q, k, v, positions, cache, k_cache, v_cache, slots)
    return q, k_cache, v_cache


@case
def paged_attention_mixed(device, view):
    from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

    k, v, k_cache, v_cache, meta = make_batch([(0, 9), (16, 1), (5, 3)], 2, 16, 8, torch.float32, device)
    meta = AttentionMetadata(**{**meta.__dict__, "slot_mapping": view(meta.slot_mapping, -1),
                                "block_tables": view(meta.block_tables, 0), "cu_seqlens_q": view(meta.cu_seqlens_q, 0),
                                "context_lens": view(meta.context_lens, 1)})
    write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(k.shape[0], 4, 16, generator=gen(3)).to(device)
    return paged_attention_triton(q, k_cache, v_cache, meta, 0.25), k_cache


@case
def paged_attention_decode_rotary_append(device, view):
    """The decode kernel that rotates and appends the new K/V itself (kernels/rope_attention.py)."""
    from kernels.rotary import build_cos_sin_cache
    from kernels.triton_attention import paged_attention_triton

    k, v, k_cache, v_cache, meta = make_batch([(7, 1), (20, 1), (0, 1)], 2, 16, 8, torch.float32, device)
    positions = (meta.context_lens - 1).long()
    meta = AttentionMetadata(**{**meta.__dict__, "slot_mapping": view(meta.slot_mapping, -1),
                                "block_tables": view(meta.block_tables, 0), "context_lens": view(meta.context_lens, 1)})
    q = torch.randn(3, 4, 16, generator=gen(3)).to(device)
    table = build_cos_sin_cache(64, 16, 10000.0, device=device)
    out = paged_attention_triton(q, k_cache, v_cache, meta, 0.25, new_kv=(k, v, view(positions, 0), table))
    return out, k_cache, v_cache


@case
def mla_write_and_attention(device, view):
    from kernels.mla_attention import mla_attention_triton, write_latent_cache_triton

    rank, rope = 32, 16
    _, _, cache, _, meta = make_batch([(0, 5), (9, 1)], 1, rank + rope, 8, torch.float32, device)
    cache = cache[:, :, 0]  # (blocks, page, R + P)
    meta = AttentionMetadata(**{**meta.__dict__, "slot_mapping": view(meta.slot_mapping, -1),
                                "block_tables": view(meta.block_tables, 0), "cu_seqlens_q": view(meta.cu_seqlens_q, 0),
                                "context_lens": view(meta.context_lens, 1)})
    latent = torch.randn(6, rank, generator=gen(1)).to(device)
    k_rope = torch.randn(6, rope, generator=gen(2)).to(device)
    write_latent_cache_triton(latent, k_rope, cache, meta.slot_mapping)
    q_latent = torch.randn(6, 4, rank, generator=gen(3)).to(device)
    q_rope = torch.randn(6, 4, rope, generator=gen(4)).to(device)
    return mla_attention_triton(q_latent, q_rope, cache, meta, 0.2), cache


@case
def mla_latent_rope_write(device, view):
    from kernels.mla_latent_write import latent_rope_write_triton
    from kernels.rotary import build_cos_sin_cache

    rank, rope = 32, 16
    q_rope = torch.randn(3, 4, rope, generator=gen(1)).to(device)
    kv = torch.randn(3, rank + rope, generator=gen(2)).to(device)
    weight = view((1 + 0.1 * torch.randn(rank, generator=gen(3))).to(device), 0.0)
    cache = torch.zeros(4, 8, rank + rope, device=device)
    positions = view(torch.tensor([7, 0, 30], device=device), 50)
    slots = view(torch.tensor([9, 17, 2], device=device), -1)
    table = build_cos_sin_cache(64, rope, 10000.0, device=device)
    return latent_rope_write_triton(q_rope, kv, weight, 1e-6, positions, table, cache, slots), cache


@case
def cross_attention_decode(device, view):
    from kernels.cross_attention_decode import cross_attention_decode_triton

    k_cache, v_cache = (torch.randn(6, 16, 2, 16, generator=gen(i)).to(device) for i in (1, 2))
    q = torch.randn(2, 2, 16, generator=gen(3)).to(device)
    tables = view(torch.tensor([[3, 1, 5], [2, 4, 0]], dtype=torch.int32, device=device), 0)
    lengths = view(torch.tensor([40, 19], dtype=torch.int32, device=device), 1)
    return (cross_attention_decode_triton(q, k_cache, v_cache, tables, lengths, 0.25, 48),)


@case
def t5_dense_attention(device, view):
    from kernels.t5_bias_attention import distance_bias, t5_dense_attention_triton

    q, k, v = (torch.randn(2, 20, 2, 16, generator=gen(i)).to(device) for i in range(3))
    bias = distance_bias(torch.randn(8, 2, generator=gen(4)).to(device), bidirectional=True, max_distance=10)
    lengths = view(torch.tensor([20, 7], dtype=torch.int32, device=device), 1)
    out = t5_dense_attention_triton(q, k, v, lengths, 1.0, bias)
    return out[0], out[1, :7]


@case
def t5_paged_decode_attention(device, view):
    from kernels.t5_bias_attention import distance_bias, t5_paged_attention_triton

    k_cache, v_cache = (torch.randn(6, 4, 3, 16, generator=gen(i)).to(device) for i in (1, 2))
    q = torch.randn(3, 3, 16, generator=gen(3)).to(device)
    bias = distance_bias(torch.randn(8, 3, generator=gen(4)).to(device), bidirectional=False, max_distance=10)
    contexts = [7, 1, 12]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=view(torch.tensor([[3, 1, 5], [2, 0, 0], [4, 0, 1]], dtype=torch.int32, device=device), 5),
        cu_seqlens_q=view(torch.arange(4, dtype=torch.int32, device=device), 0),
        context_lens=view(torch.tensor(contexts, dtype=torch.int32, device=device), 9), max_seqlen_q=1,
        max_context_len=12, is_decode_only=True, cu_seqlens_q_host=[0, 1, 2, 3], context_lens_host=contexts)
    return (t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias, decode_tiling=(2, 8, 4, 1)),)


@case
def causal_conv1d_decode(device, view):
    from kernels.causal_conv1d import causal_conv1d_decode_triton

    x = torch.randn(3, 24, generator=gen(1)).to(device)
    weight = view(torch.randn(24, 4, generator=gen(2)).to(device), 0.0)
    bias = view(torch.randn(24, generator=gen(7)).to(device), 0.0)
    states = torch.randn(4, 24, 3, generator=gen(3)).to(device)
    out = causal_conv1d_decode_triton(x, weight, bias, states, view(torch.tensor([2, 0, 3], dtype=torch.int32,
                                                                                 device=device), -1))
    return out, states


@case
def ssm_decode(device, view):
    from kernels.ssd_scan import ssm_decode_triton

    rows, heads, p, groups, n = 3, 4, 16, 2, 16
    x = torch.randn(rows, heads, p, generator=gen(1)).to(device)
    dt = torch.randn(rows, heads, generator=gen(2)).to(device)
    B, C = (torch.randn(rows, groups, n, generator=gen(i)).to(device) for i in (3, 4))
    A, D, dt_bias = (view(torch.randn(heads, generator=gen(i)).to(device), 0.0) for i in (5, 6, 7))
    states = torch.randn(4, heads, p, n, generator=gen(8)).to(device)
    slots = view(torch.tensor([1, 3, 0], dtype=torch.int32, device=device), -1)
    return ssm_decode_triton(x, dt, A, B, C, D, dt_bias, states, slots), states


@case
def selective_scan_decode(device, view):
    from kernels.selective_scan import selective_scan_decode_triton

    rows, d, n = 3, 24, 16
    x, dt, z = (torch.randn(rows, d, generator=gen(i)).to(device) for i in (1, 2, 3))
    B, C = (torch.randn(rows, n, generator=gen(i)).to(device) for i in (4, 5))
    A = -torch.rand(d, n, generator=gen(6)).to(device)
    Dskip, dt_bias = (view(torch.randn(d, generator=gen(i)).to(device), 0.0) for i in (7, 8))
    states = torch.randn(4, d, n, generator=gen(9)).to(device)
    slots = view(torch.tensor([1, 3, 0], dtype=torch.int32, device=device), -1)
    return selective_scan_decode_triton(x, dt, A, B, C, Dskip, dt_bias, z, states, slots), states


@case
def sampled_tokens(device, view):
    from kernels.sampling import _best_per_row

    logits = torch.randn(3, 3000, generator=gen(1)).to(device)
    temperature = view(torch.tensor([0.8, 1.5, 0.0], device=device), 0.0)
    seeds, offsets = (view(torch.tensor(values, device=device), 0) for values in ([11, 12, 13], [4, 5, 6]))
    return (_best_per_row(logits, (temperature, seeds, offsets)),)


@case
def norms(device, view):
    from kernels.layernorm import layer_norm_triton
    from kernels.rmsnorm import rms_norm_triton

    x = torch.randn(3, 48, generator=gen(1)).to(device)
    weight, bias = (view(torch.randn(48, generator=gen(i)).to(device), 0.0) for i in (2, 3))
    return rms_norm_triton(x, weight, 1e-6)[0], layer_norm_triton(x, weight, bias, 1e-5)[0]


@case
def skinny_linear(device, view):
    from kernels.linear import skinny_linear_triton

    x = torch.randn(2, 64, generator=gen(1)).to(device)
    weight = torch.randn(40, 64, generator=gen(2)).to(device)
    return (skinny_linear_triton(x, weight, view(torch.randn(40, generator=gen(3)).to(device), 0.0)),)


@case
def token_bitmask(device, view):
    from kernels.grammar_mask import apply_token_bitmask_triton

    logits = torch.randn(3, 100, generator=gen(1)).to(device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 4), generator=gen(2), dtype=torch.int32).to(device)
    return (apply_token_bitmask_triton(logits, bitmask, view(torch.tensor([3, 0, 2], device=device), 1)),)


@case
def moe_epilogues(device, view):
    from kernels.moe_epilogue import PLAIN_SILU, expert_activation
    from kernels.moe_grouped_mm import combine

    h = torch.randn(4, 32, generator=gen(1)).to(device)
    row_expert = view(torch.tensor([1, 0, 2, 1], dtype=torch.int32, device=device), 0)
    activated = expert_activation(h, row_expert, PLAIN_SILU)
    y = torch.randn(4, 16, generator=gen(2)).to(device)
    ids = view(torch.tensor([[0, 2], [1, 0]], dtype=torch.int32, device=device), 1)
    weights = view(torch.rand(2, 2, generator=gen(3)).to(device), 0.0)
    dest = view(torch.tensor([3, 0, 2, 1], dtype=torch.int32, device=device), 0)
    bias = torch.randn(3, 16, generator=gen(4)).to(device)
    return activated, combine(y, dest, ids, weights, bias)


@case
def fused_moe_routed(device, view):
    from kernels.fused_moe import fused_moe_triton

    x = torch.randn(3, 32, generator=gen(1)).to(device)
    gate_up = 0.2 * torch.randn(4, 2 * 16, 32, generator=gen(2)).to(device)
    down = 0.2 * torch.randn(4, 32, 16, generator=gen(3)).to(device)
    ids = view(torch.tensor([[0, 3], [2, 0], [1, 2]], dtype=torch.int32, device=device), 1)
    weights = view(torch.rand(3, 2, generator=gen(4)).to(device), 0.0)
    return (fused_moe_triton(x, gate_up, down, weights, ids),)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_views_read_as_the_values_they_hold(device, name, monkeypatch):
    import kernels.moe_epilogue
    import kernels.moe_grouped_mm

    for module in (kernels.moe_epilogue, kernels.moe_grouped_mm):  # their public entries (Triton on CUDA tensors)
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    want = CASES[name](device, packed)
    got = CASES[name](device, interleaved)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{name}: output {i} differs (max diff {(a.float() - b.float()).abs().max():.3g})"
