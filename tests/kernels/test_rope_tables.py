"""Rope tables (kernels/rotary.py) against transformers' own frequency functions, and partial
rotary expressed as a table plus a dim order, so the whole-head kernels stay as they are.

CPU float32: inverse frequencies within 1e-6 relative (the same formulas, evaluated in another
order); the attention factor exactly.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb  # partial-rotary aware

from kernels.rotary import (
    apply_rotary_ref,
    build_cos_sin_cache,
    partial_rotary_order,
    rope_attention_factor,
    rope_inv_freq,
    rotary_and_write_kv_ref,
)

HEAD_DIM, THETA, POSITIONS = 64, 10000.0, 256


def _hf(scaling: dict, seq_len: int | None = None, **config) -> tuple[torch.Tensor, float]:
    """transformers' (inv_freq, attention factor) for ``scaling`` on a 4-head, head_dim-64 config."""
    hf_config = transformers.LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4,
                                         max_position_embeddings=POSITIONS, **config,
                                         rope_parameters={"rope_theta": THETA, **scaling})
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu", seq_len=seq_len)


def _ours(scaling: dict) -> tuple[torch.Tensor, float]:
    return rope_inv_freq(HEAD_DIM, THETA, scaling), rope_attention_factor(scaling)


SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.8,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 48,
                         "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                              "attention_factor": 1.5},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_static_scalings_equal_transformers(name):
    scaling = SCALINGS[name]
    expected_freq, expected_factor = _hf(dict(scaling))
    freq, factor = _ours({**scaling, "max_position_embeddings": POSITIONS})
    torch.testing.assert_close(freq, expected_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("factor", [None, 2.0])
def test_longrope_short_and_long_factors_equal_transformers(factor):
    short, long = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)], [3.0 + 0.5 * i for i in range(HEAD_DIM // 2)]
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": 64, **({"factor": factor} if factor else {})}
    ours = {**scaling, "max_position_embeddings": POSITIONS}
    for seq_len, use_long in [(None, False), (65, True)]:
        expected_freq, expected_factor = _hf(dict(scaling), seq_len=seq_len)
        freq = rope_inv_freq(HEAD_DIM, THETA, {**ours, "use_long_factors": use_long})
        torch.testing.assert_close(freq, expected_freq, rtol=1e-6, atol=0)
        assert rope_attention_factor(ours) == pytest.approx(expected_factor, rel=1e-12)
    # The table takes the long factors exactly when the engine holds positions past the original length.
    long_table = build_cos_sin_cache(POSITIONS, HEAD_DIM, THETA, ours)
    short_table = build_cos_sin_cache(64, HEAD_DIM, THETA, ours)
    long_freq = rope_inv_freq(HEAD_DIM, THETA, {**ours, "use_long_factors": True})
    torch.testing.assert_close(long_table[5, :HEAD_DIM // 2], (5 * long_freq).cos() * rope_attention_factor(ours))
    assert not torch.allclose(long_table[:64], short_table)


def test_dynamic_ntk_is_the_unscaled_rope_within_max_position_embeddings():
    expected, _ = _hf({"rope_type": "dynamic", "factor": 4.0}, seq_len=POSITIONS)
    torch.testing.assert_close(rope_inv_freq(HEAD_DIM, THETA, {"rope_type": "dynamic", "factor": 4.0}), expected,
                               rtol=1e-6, atol=0)
    beyond, _ = _hf({"rope_type": "dynamic", "factor": 4.0}, seq_len=2 * POSITIONS)
    assert not torch.allclose(beyond, expected)  # what an engine never holds (max_seq_len <= positions)


def test_partial_rotary_order():
    assert partial_rotary_order(8, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert partial_rotary_order(8, 8).tolist() == list(range(8))
    assert sorted(partial_rotary_order(96, 24).tolist()) == list(range(96))


@pytest.mark.parametrize("head_dim,rotary_dim", [(12, 6), (96, 24), (64, 64)])
def test_partial_rotary_through_the_whole_head_reference(head_dim, rotary_dim):
    """Reordered heads rotated by the padded table == transformers' partial rope, reordered."""
    torch.manual_seed(0)
    num_tokens, heads = 9, 3
    q, k = torch.randn(num_tokens, heads, head_dim), torch.randn(num_tokens, 1, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 30, 31, 100, 200, 255])
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    table = build_cos_sin_cache(POSITIONS, head_dim, THETA, scaling, rotary_dim=rotary_dim)
    order = partial_rotary_order(head_dim, rotary_dim)
    out_q, out_k = apply_rotary_ref(q[..., order], k[..., order], positions, table)

    freqs = torch.outer(positions.float(), rope_inv_freq(rotary_dim, THETA, scaling))
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = rope_attention_factor(scaling)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), emb.cos() * factor,
                                      emb.sin() * factor, unsqueeze_dim=0)
    torch.testing.assert_close(out_q, hf_q.transpose(0, 1)[..., order], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k, hf_k.transpose(0, 1)[..., order], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_fused_rotary_kernel_with_a_partial_table(device):
    """The Triton kernel takes a partial-rotary table as any other: pass-through dims unchanged."""
    from kernels.rotary import rotary_and_write_kv_triton

    head_dim, rotary_dim, heads, kv_heads, num_tokens = 96, 24, 6, 2, 11
    table = build_cos_sin_cache(512, head_dim, THETA, None, device=device, rotary_dim=rotary_dim)
    generator = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(num_tokens, n, head_dim, generator=generator).to(device, torch.bfloat16)
               for n in (heads, kv_heads, kv_heads))
    positions = torch.arange(num_tokens, device=device) * 37
    slots = torch.arange(num_tokens, device=device)
    caches = [torch.zeros(4, 16, kv_heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(4)]
    q_ref = rotary_and_write_kv_ref(q.clone(), k, v, positions, table, caches[0], caches[1], slots)
    q_out = rotary_and_write_kv_triton(q.clone(), k, v, positions, table, caches[2], caches[3], slots)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(caches[2], caches[0], rtol=1e-2, atol=1e-2)
    half, passed = rotary_dim // 2, (head_dim - rotary_dim) // 2
    pass_dims = list(range(half, half + passed)) + list(range(head_dim // 2 + half, head_dim))
    assert torch.equal(q_out[..., pass_dims], q[..., pass_dims])  # cos 1, sin 0: exactly unchanged
